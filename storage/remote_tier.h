// RemoteTier: the shared tier (L3) on Redis Cluster. Chunks are written to it in the
// background after they land locally (WriteAsync never blocks a put: when its queue is
// full, or the cluster is unreachable, the write is dropped and counted) and read
// through on a local miss. The data model (segments spread over the slots, a commit
// record written last) is in remote_record.h.
//
// What it promises:
//  - Never a torn or foreign chunk: a record is used only if its own CRC32C, its
//    layout fingerprint and its segments' generation match; every segment is checked
//    against its CRC32C and the whole chunk against its CRC32C before the caller sees
//    success. Anything else is a miss (counted by cause); a corrupt record or segment
//    also deletes the record, so no other daemon trips on it, and so does a record whose
//    segments are gone (torn), so the chunk can be shared again. Both deletes are a
//    compare-and-delete of the record as read: a newer record another writer committed
//    meanwhile stays. An error reply from a node (max clients, ACL, ...) says nothing
//    about the bytes: it is a failed read, like a timeout, and deletes nothing.
//  - A Delete or Clear is not undone by a write queued before it: the chunk's (the
//    namespace's) queued writes are dropped, and one already being sent either stops
//    before its commit or, committed as the Delete ran, removes its own record.
//  - Never failing because the cluster is full or gone: an OOM reply drops the write
//    (counted as full); an unreachable cluster marks the tier degraded (RemoteHealth:
//    log and metric, probes with backoff) and reads miss at once. Only a probe that
//    reaches every master (PING) ends it, not one node answering a read.
//  - Expiry by Redis TTLs: records live `ttl`, segments a minute longer, so a record
//    never outlives its segments by expiry. Capacity is the cluster's (its maxmemory
//    and eviction policy); a record whose segments were evicted reads as a miss.
//  - Bounded: at most max_pending_bytes of chunks queued or being written (each holds
//    its pool bytes until written; a larger chunk goes alone, when nothing else does), at most connections_per_node connections per node,
//    at most batch_bytes of segments in one pipeline.
//
// Thread-safety: thread-safe. write_threads background threads; the destructor drops
// the writes still queued (their chunks are still local) and waits for those running.
#ifndef KVTIER_STORAGE_REMOTE_TIER_H_
#define KVTIER_STORAGE_REMOTE_TIER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/chunk_id.h"
#include "storage/redis/redis_cluster.h"
#include "storage/remote_health.h"
#include "storage/remote_record.h"
#include "storage/storage_tier.h"

namespace kvtier {

// What a reader knows of a namespace's layout, to judge a commit record by.
struct RemoteLayout {
  uint64_t fingerprint = 0;  // Records carry it; another layout's are foreign.
  // Bytes of every chunk of the layout; a record of this layout that says otherwise is
  // corrupt (forged or damaged yet CRC-valid) and is deleted before its size is used.
  // 0: sizes not checked (tests of the tier alone, whose chunks vary).
  uint64_t chunk_bytes = 0;
};

struct RemoteTierOptions {
  RedisClusterOptions cluster;  // No seeds: no remote tier.
  std::string key_prefix = "kvt";
  uint32_t segment_bytes = 1u << 20;
  absl::Duration ttl = absl::Hours(24);
  uint64_t max_pending_bytes = 256ull << 20;
  // Segment bytes sent or fetched in one pipelined batch.
  uint64_t batch_bytes = 16ull << 20;
  int write_threads = 2;
  absl::Duration min_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(10);
  // For the StorageTier interface (Write, Read), which names no layout: the layout of
  // namespace `ns`. Unset: those calls are refused with FailedPrecondition.
  std::function<absl::StatusOr<RemoteLayout>(uint64_t ns)> layout_of;
  // Sync point for tests: runs on the writer thread once a write's segments have landed,
  // just before its commit record is sent. Null (always, outside tests): nothing runs.
  std::function<void(const ChunkId&)> before_commit;
  // Sync points for tests: after_commit runs once a write's commit record has landed,
  // before the write checks whether a Delete or Clear cancelled it; cancel_waits runs
  // when a Delete or Clear finds a write of one of its chunks being sent, before it
  // waits for that write to end.
  std::function<void(const ChunkId&)> after_commit;
  std::function<void(const ChunkId&)> cancel_waits;
  // Sync point for tests: runs once a batch of a write's segments has landed, before the
  // write checks whether a Delete or Clear cancelled it.
  std::function<void(const ChunkId&)> after_segment_batch;
  // Sync point for tests: runs in Clear once the namespace's writes are cancelled,
  // before it looks for its records.
  std::function<void(uint64_t ns)> after_clear_cancel;

  bool enabled() const { return !cluster.seeds.empty(); }
  absl::Status Validate() const;
};

struct RemoteTierStats {
  bool degraded = false;
  uint64_t degradations = 0;
  uint64_t hits = 0;                 // Chunks read and verified.
  uint64_t misses = 0;               // No record (or skipped while degraded).
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t writes = 0;               // Chunks committed.
  uint64_t writes_present = 0;       // Skipped: another writer had committed it.
  uint64_t writes_dropped = 0;       // Queue full, degraded, or shutting down.
  uint64_t write_failures = 0;       // Sent but not committed (unreachable, errors).
  uint64_t writes_full = 0;          // The cluster answered OOM.
  uint64_t writes_cancelled = 0;     // A Delete or Clear of the chunk overtook it.
  uint64_t read_failures = 0;        // Unreachable mid-read, or an error reply.
  uint64_t checksum_failures = 0;    // Corrupt records or segments (deleted).
  uint64_t torn = 0;                 // A record whose segments are not all there.
  uint64_t torn_removed = 0;         // Such records removed by the reader that found them.
  uint64_t foreign = 0;              // A record of another layout, or another version.
  uint64_t eval_refusals = 0;        // Compare-deletes the cluster refused (DEL instead).
  uint64_t pending_bytes = 0;        // Queued or being written now.
  RedisClusterStats cluster;
};

class RemoteTier final : public StorageTier {
 public:
  // Returns: Ok, InvalidArgument. An unreachable cluster is not an error (degraded).
  static absl::StatusOr<std::unique_ptr<RemoteTier>> Open(RemoteTierOptions options);
  ~RemoteTier();
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  // Queues a chunk that landed locally. `pieces` (covering meta.size) stay valid while
  // `keep_alive` is held. Never blocks; returns whether it was queued.
  // `done` (may be null) gets how the write ended, on a writer thread (on this one
  // when the write is not queued; on the deleting thread when a Delete or Clear drops it
  // from the queue): Ok (committed, or another writer had), ResourceExhausted (the
  // cluster is full), Unavailable (not queued, unreachable, dropped at shutdown),
  // Aborted (a Delete or Clear of the chunk overtook it), Internal (an error reply).
  bool WriteAsync(const ChunkId& id, const ChunkMeta& meta, uint64_t layout_fingerprint,
                  std::vector<absl::string_view> pieces, std::shared_ptr<const void> keep_alive,
                  WriteDone done = nullptr);

  // The chunk's commit record, if it has one for this layout. Returns: Ok, NotFound
  // (absent, foreign, corrupt, or the tier is degraded), Unavailable (unreachable now,
  // or the node answered with an error).
  absl::StatusOr<RemoteRecord> ReadRecord(const ChunkId& id, const RemoteLayout& layout);
  // Reads the payload of `record` into `sink`, verifying every segment and then the
  // chunk. Returns: Ok, NotFound (segments missing: torn; the record is removed unless
  // it changed since it was read), DataLoss (corrupt; likewise removed), Unavailable
  // (unreachable, or a node answered with an error).
  absl::Status ReadPayload(const ChunkId& id, const RemoteRecord& record, ChunkSink& sink);
  // ReadRecord for many chunks of one layout, in one pipelined round trip; one result
  // per id, in order.
  std::vector<absl::StatusOr<RemoteRecord>> ReadRecords(absl::Span<const ChunkId> ids,
                                                        const RemoteLayout& layout);
  // ReadPayload for many chunks: their segments fetched in pipelines of up to
  // batch_bytes (small chunks share one, a large one takes several), each chunk into
  // its own sink; one status per chunk, in order. A chunk that fails does not stop the
  // others.
  std::vector<absl::Status> ReadPayloads(absl::Span<const ChunkId> ids,
                                         absl::Span<const RemoteRecord* const> records,
                                         absl::Span<ChunkSink* const> sinks);
  // Whether each of `ids` has a commit record (one pipelined round trip). All false
  // while degraded. A record whose segments were since evicted still answers true;
  // the read then misses.
  std::vector<bool> ContainsMany(absl::Span<const ChunkId> ids) const override;
  // Read for many chunks: the records of each namespace's chunks in one pipelined round
  // trip (ReadRecords), then their payloads in groups of about batch_bytes
  // (ReadPayloads), in the order given; each chunk's `done` runs when its group has
  // landed. A chunk that misses (absent, foreign, corrupt, unreachable) gets NotFound
  // or DataLoss, as Read would.
  void ReadMany(absl::Span<const ChunkId> ids, SinkForEach sink_for,
                ReadEachDone done) override;
  // False while degraded: reads miss at once until a probe succeeds.
  bool reachable() const override { return !health_.degraded(); }
  // Cancels the chunk's write not yet committed (see CancelWrites), then deletes the
  // record and its segments. Returns whether a record existed. Errors: Unavailable
  // (also while degraded: the copy is left to expire).
  absl::StatusOr<bool> Delete(const ChunkId& id) override;
  // Cancels the namespace's writes not yet committed, then deletes every record and
  // segment of namespace `ns`: SCAN over every master of a slot map read afresh, each
  // key deleted through the cluster's routing (MOVED, ASK: a key SCAN found on a node
  // importing its slot). Returns how many records were deleted. Errors: Unavailable
  // (a node unreachable or answering with an error; what was deleted stays deleted).
  absl::StatusOr<uint64_t> Clear(uint64_t ns);

  // StorageTier, for the chunks of namespaces options.layout_of knows.
  // Contains asks the cluster (a round trip); Write is WriteAsync (`done` when it
  // has landed); Read is ReadRecord then ReadPayload (`done` on the caller's thread);
  // DeleteNamespace is Clear. There is no capacity here: the cluster's maxmemory
  // bounds it. Stats: hits, misses and the bytes written.
  Tier tier() const override { return Tier::kRemote; }
  Role role() const override { return Role::kShared; }
  uint64_t capacity_bytes() const override { return 0; }
  bool Contains(const ChunkId& id) const override;
  void Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
             WriteDone done) override;
  void Read(const ChunkId& id, SinkFor sink_for, ReadDone done) override;
  absl::StatusOr<uint64_t> DeleteNamespace(uint64_t ns,
                                           std::vector<ChunkId>* = nullptr) override {
    return Clear(ns);
  }
  TierStats Stats() const override;

  // Waits until no write is queued or running (tests, benchmarks).
  void WaitIdle();
  RemoteTierStats GetStats() const;
  bool degraded() const { return health_.degraded(); }

 private:
  struct Job {
    ChunkId id;
    ChunkMeta meta;
    uint64_t layout_fingerprint;
    std::vector<absl::string_view> pieces;
    std::shared_ptr<const void> keep_alive;
    WriteDone done;  // May be null.
  };
  RemoteTier(RemoteTierOptions options, std::unique_ptr<RedisCluster> cluster);
  void WriterLoop();
  absl::Status Write(const Job& job);
  // Drops the queued writes of the chunks `match` picks (their `done` gets Aborted, here),
  // marks those being written cancelled, and waits for them to end (for at most twice
  // the cluster's I/O timeout: each step of a write has that timeout). Called before Delete and Clear look at the cluster, which
  // is what makes Write's check after its commit enough (see there); the wait keeps a
  // write whose commit was on its way from landing after the Delete or Clear returned,
  // visible until it removed itself (for the TTL, if that removal failed: the Delete's
  // own look then finds the record and deletes it).
  void CancelWrites(absl::FunctionRef<bool(const ChunkId&)> match);
  // Whether `job`, being written, was cancelled.
  bool Cancelled(const Job& job) const;
  // A compare-and-delete of commit records: each goes only if it still holds
  // `expected` (the bytes read or written), and then its generation's segments go too.
  // Best effort (a failure leaves the record to its TTL). Returns how many went.
  struct RecordToRemove {
    ChunkId id;
    std::string expected;
    uint64_t generation = 0;  // With segments = 0 when the record could not be decoded.
    uint32_t segments = 0;
  };
  uint64_t RemoveRecords(absl::Span<const RecordToRemove> records);
  // options_.layout_of(ns), or FailedPrecondition without one.
  absl::StatusOr<RemoteLayout> LayoutOf(uint64_t ns) const;
  // Deletes segments [0, n) of `generation` (a write that did not commit).
  void DeleteSegments(const ChunkId& id, uint64_t generation, uint32_t n);
  // Counts `s` against health when it says the cluster was unreachable.
  void Observe(const absl::Status& s) const;
  // Whether an operation may go to the cluster: healthy, or degraded with a probe due
  // that finds every master of the slot map answering (RedisCluster::PingMasters),
  // which ends the degraded state. False: refused at once.
  bool Admit() const;

  const RemoteTierOptions options_;
  std::unique_ptr<RedisCluster> cluster_;
  mutable RemoteHealth health_;  // Reads through const StorageTier calls count too.

  mutable absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The writes being sent now (each Job lives on its writer thread), and whether a
  // Delete or Clear has cancelled it since it was taken from the queue.
  absl::flat_hash_map<const Job*, bool> running_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> writers_;

  std::atomic<uint64_t> hits_{0}, misses_{0}, bytes_read_{0}, bytes_written_{0}, writes_{0},
      writes_present_{0}, writes_dropped_{0}, write_failures_{0}, writes_full_{0},
      writes_cancelled_{0}, read_failures_{0}, checksum_failures_{0}, torn_{0},
      torn_removed_{0}, foreign_{0}, eval_refusals_{0};
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REMOTE_TIER_H_
