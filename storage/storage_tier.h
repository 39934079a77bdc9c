// StorageTier: what every tier of the store is to the code that composes them (the GPU
// staging buffers, the host-RAM pool, the SSD tier, the shared remote tier): a place
// that holds whole chunks, with its own capacity and eviction, behind one small
// interface.
//
// The interface is the tier-neutral part: whether a tier holds a chunk, a whole-chunk
// write and read, delete, and stats; then, each with a default for a tier that lacks
// it, batched Contains and Read, ranged reads for streaming, dropping a corrupt copy,
// TTL upkeep, flushing, and per-namespace bytes for quotas. TieredStore keeps one list
// of its tiers, fastest first, and roles in it (the local tier under RAM, the shared
// tier), and does everything through this interface but what only one tier can do:
// a Get served from pool slots and pinning (RAM), a copy into a worker's GPU (staging),
// the layouts saved beside the SSD tier's index, and each tier's own detailed stats.
//
// Reads and writes complete through a callback, so a tier whose I/O is asynchronous
// (a device copy, a write queued for a remote cluster) and one that is not (RAM, SSD:
// `done` runs on the caller's thread) look the same.
//
// Thread-safety: implementations are thread-safe.
#ifndef KVTIER_STORAGE_STORAGE_TIER_H_
#define KVTIER_STORAGE_STORAGE_TIER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "storage/chunk_id.h"

namespace kvtier {

class PoolChunk;

// Where a tier's read puts a chunk's bytes (a RAM pool chunk, or a buffer).
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  // Called from several threads at once, for disjoint ranges.
  virtual void Write(uint64_t offset, absl::string_view bytes) = 0;
  // CRC32C of everything written; called once all writes are done.
  virtual uint32_t Crc32c() const = 0;
};

// A sink into a std::string already sized to the chunk.
class StringSink final : public ChunkSink {
 public:
  explicit StringSink(std::string* out) : out_(out) {}
  void Write(uint64_t offset, absl::string_view bytes) override;
  uint32_t Crc32c() const override;

 private:
  std::string* const out_;
};

// A sink into a pool chunk already sized to the chunk: reads land straight in its slots.
class PoolSink final : public ChunkSink {
 public:
  explicit PoolSink(PoolChunk* chunk) : chunk_(chunk) {}
  void Write(uint64_t offset, absl::string_view bytes) override;
  uint32_t Crc32c() const override;

 private:
  PoolChunk* const chunk_;
};

// A chunk's bytes handed to a tier's Write: `pieces`, in order, cover the chunk; they
// stay valid while `keep_alive` is held, which the tier holds until its write is done.
struct ChunkBytes {
  std::vector<absl::string_view> pieces;
  std::shared_ptr<const void> keep_alive;

  // The bytes of a pool chunk, in its slots (no copy).
  static ChunkBytes Of(std::shared_ptr<const PoolChunk> chunk);
  // The bytes of a buffer.
  static ChunkBytes Of(std::shared_ptr<const std::string> buffer);
  uint64_t size() const;
};

// One tier's state, in the same terms for every tier.
struct TierStats {
  Tier tier = Tier::kNone;
  uint64_t capacity_bytes = 0;  // 0: none (the tier is off) or not this daemon's to bound.
  uint64_t used_bytes = 0;      // What the chunks take of the capacity (slots, file space).
  uint64_t payload_bytes = 0;   // Their payload bytes.
  uint64_t chunks = 0;
  uint64_t pinned_bytes = 0;    // Payload bytes pinned (RAM only).
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;       // Chunks that left for room, by the tier's policy.
  uint64_t expirations = 0;     // Chunks dropped by age (SSD: ssd_ttl); not in evictions.
};

class StorageTier {
 public:
  // How a tier's copy of a chunk counts.
  enum class Role {
    kCopy,    // Only ever a copy of a chunk another local tier holds (GPU staging): it
              // never makes a chunk present, and dropping it loses nothing.
    kLocal,   // This daemon's own copy (RAM, SSD).
    kShared,  // Shared with other daemons, best effort (the remote tier): its failures
              // are a miss, never an error of the daemon's.
  };

  virtual ~StorageTier() = default;

  virtual Tier tier() const = 0;
  virtual Role role() const = 0;
  // The most bytes the tier's chunks may take (0: off, or unbounded here).
  virtual uint64_t capacity_bytes() const = 0;

  // Whether the tier holds the chunk, without reading it or counting a hit. For the
  // remote tier this is a round trip (false when it cannot be asked).
  virtual bool Contains(const ChunkId& id) const = 0;

  // Stores a verified chunk (its CRC32C is meta.crc32c) as a clean copy; idempotent (a
  // chunk already held is left as is, and `done` gets Ok). `done` gets: Ok,
  // InvalidArgument (the bytes do not add up to meta.size, or the chunk is larger than
  // the tier), ResourceExhausted (no room, or the disk is full), Unavailable (I/O or
  // device error, the tier is closing or unreachable). A tier whose write is queued
  // (remote) calls `done` once it has landed or failed.
  using WriteDone = std::function<void(absl::Status)>;
  virtual void Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
                     WriteDone done) = 0;

  // Reads a whole chunk: once its meta is known, `sink_for(meta)` says where its bytes
  // go (null: nowhere, the read ends with ResourceExhausted); the sink's CRC32C is
  // checked against the meta before `done` gets it. The sink must stay valid until
  // `done` runs. `done` gets: Ok (the meta), NotFound, ResourceExhausted (no sink),
  // DataLoss (the tier's copy is corrupt: it is dropped), Unavailable. Counts a hit or a
  // miss.
  using SinkFor = std::function<ChunkSink*(const ChunkMeta&)>;
  using ReadDone = std::function<void(absl::StatusOr<ChunkMeta>)>;
  virtual void Read(const ChunkId& id, SinkFor sink_for, ReadDone done) = 0;

  // Returns whether the tier held the chunk. Errors: Unavailable.
  virtual absl::StatusOr<bool> Delete(const ChunkId& id) = 0;
  // Deletes every chunk of namespace `ns`; returns how many went, and appends their ids
  // to `removed` (may be null; the shared tier and GPU staging leave it as it is).
  // Errors: Unavailable.
  virtual absl::StatusOr<uint64_t> DeleteNamespace(uint64_t ns,
                                                   std::vector<ChunkId>* removed = nullptr) = 0;

  virtual TierStats Stats() const = 0;

  // What follows has a default that fits a tier without the capability; a tier
  // overrides what it does better or at all.

  // Contains for many chunks: one answer per id, in order. The default asks Contains
  // for each; a tier overrides it where a batch is cheaper (one lock, one pipelined
  // round trip).
  virtual std::vector<bool> ContainsMany(absl::Span<const ChunkId> ids) const;

  // Read for many chunks, for a caller with a thread to spend (a fetch job): where
  // ids[i]'s bytes go is `sink_for(i, meta)` (null: nowhere, that chunk ends with
  // ResourceExhausted), and `done(i, result)` runs once for each id, as Read's `done`
  // would, as soon as that chunk has landed: the first can be used before the last is
  // read. A chunk that fails does not stop the others. Returns once every `done` has
  // run. The default reads one chunk at a time; the remote tier fetches them in
  // pipelined batches.
  using SinkForEach = std::function<ChunkSink*(size_t index, const ChunkMeta& meta)>;
  using ReadEachDone = std::function<void(size_t index, absl::StatusOr<ChunkMeta> result)>;
  virtual void ReadMany(absl::Span<const ChunkId> ids, SinkForEach sink_for,
                        ReadEachDone done);

  // Whether the tier can answer now. One that cannot (the remote tier while its
  // cluster is down) misses every read at once, and callers skip work meant for it.
  virtual bool reachable() const { return true; }

  // Streaming a chunk a frame at a time, with no copy of it in RAM (a Get of a chunk
  // the pool has no room for). A tier that can (SSD) says so; ReadRange reads bytes
  // [offset, offset + len) of a chunk whose meta its Read gave into `out`, verifying
  // every byte it returns first. Returns: Ok, InvalidArgument (past the chunk),
  // NotFound (deleted meanwhile), DataLoss (the copy is bad and now dropped),
  // Unavailable; Unimplemented by default.
  virtual bool reads_ranges() const { return false; }
  virtual absl::Status ReadRange(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                                 uint64_t len, char* out);
  // Counts a hit for a chunk about to be read with ReadRange (Read counts its own).
  virtual void CountRangedRead() {}
  // A caller found this tier's copy of a chunk corrupt (a frame's checksum): the tier
  // drops the copy (and counts it, where it counts checksum failures: SSD). `meta` is
  // the copy's as the caller read it; a tier that can tell (SSD) keeps a copy stored
  // afresh since, with other bytes, and returns Aborted. Returns DataLoss, for the
  // caller to pass on. The default deletes the copy.
  virtual absl::Status DropCorrupt(const ChunkId& id, const ChunkMeta& meta);

  // Upkeep the store runs on its schedule: drops chunks past their TTL; returns how
  // many went. The default has no TTL.
  virtual uint64_t ExpireOld() { return 0; }
  // Makes everything written durable, so that a reopen replays nothing (a clean
  // shutdown). The default has nothing to do.
  virtual absl::Status Flush() { return absl::OkStatus(); }

  // For tenants' quotas on this tier: the bytes namespaces `ns` take here (what their
  // chunks take of the tier: the RAM pool's slots, SSD payload bytes), and
  // evicting their chunks in the policy's order until they hold at most `keep` (returns
  // what they hold afterwards). The defaults hold nothing and shrink nothing (a tier
  // no quota names: Unimplemented).
  virtual uint64_t NamespaceQuotaBytes(const absl::flat_hash_set<uint64_t>& ns) const {
    return 0;
  }
  virtual absl::StatusOr<uint64_t> ShrinkNamespaces(const absl::flat_hash_set<uint64_t>& ns,
                                                    uint64_t keep);
};

// What a tier's Write answers when `bytes` do not add up to meta.size (InvalidArgument
// naming the tier and the chunk), or Ok.
absl::Status CheckChunkBytes(Tier tier, const ChunkId& id, const ChunkMeta& meta,
                             const ChunkBytes& bytes);
// What a tier's Read answers when `sink_for` gives no sink.
absl::Status NoSinkError();

// Write, waiting for `done` (on this thread for a synchronous tier). For callers that
// have a thread to spend on the write: the flushers, a write-through commit.
absl::Status WriteAndWait(StorageTier& tier, const ChunkId& id, const ChunkMeta& meta,
                          ChunkBytes bytes);
// Read, likewise.
absl::StatusOr<ChunkMeta> ReadAndWait(StorageTier& tier, const ChunkId& id,
                                      StorageTier::SinkFor sink_for);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_STORAGE_TIER_H_
