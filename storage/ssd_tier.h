// SsdTier: the SSD tier (L2). Payload bytes go to append-only files (PayloadLog) in
// large aligned writes, each byte once; RocksDB keeps what it is good at: one small row
// per chunk (size, CRC32C, token count, where its payload is, a CRC32C per piece), the
// registered layouts, and recovery of both (SsdRow has the schema).
//
// A put appends the payload to the active file, then writes the chunk's row: the row is
// the commit record, so a chunk is visible only once its bytes are in its file (and, with
// sync_writes, on the device: the file is fdatasync'd and the row's WAL write synced
// before the put returns). Without sync_writes an acknowledged put survives a killed
// daemon (its bytes are written through O_DIRECT or sit in the page cache), not a power
// cut. A put cut off by a crash leaves bytes no row points at; they are reclaimed like
// any other dead bytes. The in-memory index (what is here, where, recency) is rebuilt at
// start-up from the rows alone; a row whose payload file is missing or too short is
// dropped, as is a row that fails its own CRC32C, and files no row points into are
// deleted.
//
// Every read is verified piece by piece (piece_bytes, 256 KiB by default) before any of
// its bytes are handed out, so even a chunk streamed a frame at a time never sends an
// unverified byte; a chunk that fails is deleted, counted and reported as DataLoss.
//
// Space. Capacity bounds the live chunks' footprint (payload rounded up to 4 KiB); a put
// that would exceed it evicts least recently used chunks first. A chunk enters the
// eviction order when its payload takes its place in the files, so concurrent puts
// enter both in the same order, and plain LRU churn empties the oldest file first.
// Deleted and evicted chunks leave dead bytes in their files; a file with nothing live
// is deleted, and when the files hold more than capacity + capacity/16, the put about to
// write first moves the live chunks of the file with the most dead bytes forward
// (garbage collection), so the payload files stay within capacity * 17/16 plus the file
// being filled (file_bytes).
// An optional TTL hides and deletes chunks older than it.
//
// Thread-safety: all methods are thread-safe. Payload I/O and RocksDB writes run without
// the index lock, except a GC move's commit, which must not race a delete of its chunk.
#ifndef KVTIER_STORAGE_SSD_TIER_H_
#define KVTIER_STORAGE_SSD_TIER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "rocksdb/db.h"
#include "rocksdb/file_system.h"
#include "rocksdb/write_batch.h"
#include "absl/container/flat_hash_set.h"
#include "storage/chunk_id.h"
#include "storage/storage_tier.h"
#include "storage/index_database.h"
#include "storage/io_pool.h"
#include "storage/eviction_policies.h"
#include "storage/payload_log.h"

namespace kvtier {

struct SsdTierOptions {
  // Directory of the tier: the RocksDB index, and the payload files in payload/.
  // Created if missing.
  std::string path;
  // Most bytes of live chunks kept (each counted rounded up to 4 KiB); the eviction
  // policy's victims are evicted past it.
  uint64_t capacity_bytes = 16ull << 30;
  EvictionPolicyOptions eviction;
  // Chunks older than this are hidden and deleted; zero keeps them until evicted.
  absl::Duration ttl = absl::ZeroDuration();
  // fdatasync the payload and sync the index row on every put, so an acknowledged put
  // survives a power cut. Off by default: an acknowledged put survives a killed daemon
  // either way.
  bool sync_writes = false;
  // Payload bytes per checksum (a multiple of 4 KiB): the unit a read verifies.
  uint64_t piece_bytes = 256ull << 10;
  // Bytes per payload write or read (a multiple of piece_bytes).
  uint64_t io_bytes = 4ull << 20;
  // A payload file takes no new chunks past this size. Zero: capacity / 32, between
  // io_bytes and 256 MiB.
  uint64_t file_bytes = 0;
  // Payload writes in flight across all puts (the SSD's write queue depth).
  int write_depth = 4;
  // Threads reading one chunk's pieces in parallel (the SSD's queue depth per read).
  int read_threads = 4;
  // Open payload files with O_DIRECT where the filesystem supports it.
  bool direct_io = true;
  // RocksDB memtable budget (bytes). Only index rows pass through it now.
  uint64_t write_buffer_bytes = 8ull << 20;
  // Free space payload writes leave on the file system holding `path`, for RocksDB
  // (PayloadLogOptions::min_free_bytes). Zero: MinFreeBytes()'s default.
  uint64_t min_free_bytes = 0;
  // RocksDB's filesystem; null means the real one. Tests inject index faults here.
  std::shared_ptr<rocksdb::FileSystem> file_system;
  // Payload file system calls; null means the real ones. Tests inject faults here.
  std::shared_ptr<PayloadFileOps> file_ops;
  // Clock for TTL; tests inject a fake one.
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Called (without the tier's locks) for each chunk that left the tier for room or by
  // expiry (ssd_ttl).
  std::function<void(const ChunkId&)> on_evict;
  // Called (without the tier's locks) once for each chunk deleted because its copy
  // failed verification, whichever read found it (a whole-chunk read, a range read, a
  // GC move, DropCorrupt), and by whichever of several readers deleted it.
  std::function<void(const ChunkId&)> on_corrupt;
  // Tests only (sync points): called once a chunk has left the index and before its
  // row is deleted (a delete, an eviction, a corrupt copy dropped), and when a put or a
  // delete of a chunk finds it in that state and waits for the row to go first.
  std::function<void(const ChunkId&)> before_row_delete;
  std::function<void(const ChunkId&)> put_waits_for_row_delete;
  std::function<void(const ChunkId&)> delete_waits_for_row_delete;

  absl::Status Validate() const;
  // file_bytes, or its default for this capacity.
  uint64_t FileBytes() const;
  // min_free_bytes, or its default: room for RocksDB to flush its memtables twice over
  // and for its WAL, MANIFEST and a compaction, 2 x write_buffer_bytes + 64 MiB.
  uint64_t MinFreeBytes() const;
  // The disk the tier may take at most: capacity x 17/16 of payload files (dead bytes
  // awaiting GC), one file being filled, and min_free_bytes kept free for the index.
  uint64_t DiskBytesNeeded() const;
  // The largest capacity whose DiskBytesNeeded fits `room` bytes (with this file size).
  uint64_t LargestCapacityFor(uint64_t room) const;
};

struct SsdTierStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;     // Footprint of the chunks held (what capacity bounds).
  uint64_t payload_bytes = 0;  // Their payload bytes.
  uint64_t disk_bytes = 0;     // Bytes in payload files, dead ones included.
  uint64_t bytes_written = 0;  // Payload file bytes written since start (GC included).
  uint64_t gc_files = 0;       // Files reclaimed by moving their live chunks.
  uint64_t gc_bytes = 0;       // Bytes those moves wrote.
  uint64_t lost_at_start = 0;  // Rows dropped at start-up: payload file gone or short.
  uint64_t index_repairs = 0;  // 1 when this start found the index corrupt and repaired it.
  bool direct_io = false;
  uint64_t chunks = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t expirations = 0;
  uint64_t checksum_failures = 0;
  uint64_t write_errors = 0;  // Failed write attempts (a chunk tried again counts again).
  // The capacity the tier keeps to: capacity_bytes, or less while the file system
  // holding it has no room for that much (SsdTierOptions::LargestCapacityFor its room).
  uint64_t limit_bytes = 0;
};

class SsdTier final : public StorageTier {
 public:
  // Opens (or creates) the database and rebuilds the index. An index RocksDB finds
  // corrupt is repaired first (RepairDB, logged): the chunks whose rows it cannot read
  // are dropped, and the tier starts with the rest. Returns: Ok, InvalidArgument (bad
  // options), Unavailable (RocksDB could not open, or repair, the index).
  static absl::StatusOr<std::unique_ptr<SsdTier>> Open(SsdTierOptions options);
  ~SsdTier();

  // Stores a chunk whose payload is the concatenation of `parts`; idempotent (a present
  // chunk is left as is). Returns: Ok, InvalidArgument (larger than the capacity),
  // DataLoss (the bytes do not match meta.crc32c: nothing stored), ResourceExhausted
  // (the disk is full, even with every other chunk evicted), Unavailable (other I/O
  // error). A file system that fills before the tier does holds the tier to what fits
  // (SsdTierStats::limit_bytes): the put evicts, in the policy's order, and tries again.
  absl::Status Put(const ChunkId& id, const ChunkMeta& meta,
                   absl::Span<const absl::string_view> parts);

  struct Chunk {
    ChunkMeta meta;
    std::string data;
  };
  // Reads and verifies a chunk. Returns: Ok, NotFound, DataLoss (failed its checksum;
  // now deleted), Unavailable (I/O error).
  absl::StatusOr<Chunk> Get(const ChunkId& id);

  // The same in two steps, so the caller can choose where the bytes go: the stored
  // meta (Returns: Ok, NotFound), then the payload, read in parallel pieces into `sink`,
  // each piece verified, and the whole against meta.crc32c (Returns: Ok,
  // NotFound (deleted meanwhile), DataLoss (now deleted), Unavailable).
  absl::StatusOr<ChunkMeta> ReadMeta(const ChunkId& id);
  // The description of a chunk held and not expired, with no side effect (no access
  // recorded, no counter, no expiry acted on); nullopt otherwise.
  std::optional<ChunkMeta> PeekMeta(const ChunkId& id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReadPayload(const ChunkId& id, const ChunkMeta& meta, ChunkSink& sink);
  // Reads bytes [offset, offset + len) of the payload into `out` (len bytes), for
  // streaming a chunk a frame at a time. Every piece the range touches is verified
  // against its CRC32C first. Returns: Ok, InvalidArgument (range past the chunk),
  // NotFound (deleted meanwhile), DataLoss (a piece is bad: the chunk is now deleted),
  // Unavailable.
  bool reads_ranges() const override { return true; }
  absl::Status ReadRange(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                         uint64_t len, char* out) override;
  // Counts a hit for a chunk that will be read with ReadRange (ReadPayload counts its own).
  void CountRangedRead() override;
  // Deletes a chunk whose payload a caller found corrupt, counts it, and says so, if
  // the copy stored is still the one described by `meta` (the one the caller read).
  // Returns DataLoss, for the caller to pass on; Aborted if the chunk was stored afresh
  // or deleted since (the bad bytes were no one's; a read again may succeed).
  absl::Status DropCorrupt(const ChunkId& id, const ChunkMeta& meta) override;

  // StorageTier. Write is Put (`done` runs on the caller's thread); Read is ReadMeta
  // then ReadPayload; Stats counts expirations apart from evictions, as GetStats does.
  Tier tier() const override { return Tier::kSsd; }
  Role role() const override { return Role::kLocal; }
  uint64_t capacity_bytes() const override { return options_.capacity_bytes; }
  bool Contains(const ChunkId& id) const override;
  void Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
             WriteDone done) override;
  void Read(const ChunkId& id, SinkFor sink_for, ReadDone done) override;
  // Returns true if the chunk was present. Errors: Unavailable.
  absl::StatusOr<bool> Delete(const ChunkId& id) override;
  absl::StatusOr<uint64_t> DeleteNamespace(uint64_t ns,
                                           std::vector<ChunkId>* removed = nullptr) override;
  TierStats Stats() const override;

  // Contains for many chunks under one lock.
  std::vector<bool> ContainsMany(absl::Span<const ChunkId> ids) const override;
  // Payload bytes the namespaces `ns` hold on this tier. O(namespaces).
  uint64_t NamespaceQuotaBytes(const absl::flat_hash_set<uint64_t>& ns) const override;
  // Evicts chunks of the namespaces `ns` in the policy's order until they hold at most
  // `keep` payload bytes (a tenant's SSD quota); returns the bytes they hold afterwards.
  // Rows go before their bytes are freed, as for any eviction. Errors: Unavailable (the
  // rows could not be deleted; nothing is evicted).
  absl::StatusOr<uint64_t> ShrinkNamespaces(const absl::flat_hash_set<uint64_t>& ns,
                                            uint64_t keep) override;
  // Deletes chunks past their TTL; returns how many.
  uint64_t ExpireOld() override;

  absl::Status SaveLayout(uint64_t ns, absl::string_view encoding);
  absl::StatusOr<std::vector<std::pair<uint64_t, std::string>>> LoadLayouts() const;

  SsdTierStats GetStats() const;
  // Syncs the payload files and flushes memtables, so a clean shutdown leaves no WAL to
  // replay.
  absl::Status Flush() override;

 private:
  struct IndexEntry {
    ChunkMeta meta;
    absl::Time written_at;
    PayloadExtent extent;
    std::shared_ptr<const std::vector<uint32_t>> piece_crcs;
    // Found bad, and its row could not be deleted (the row, still there, would bring it
    // back at a restart): kept hidden, like an expired copy, until a put replaces it or
    // the sweep deletes its row.
    bool corrupt = false;
  };

  struct IndexDb;
  static IndexDb IndexDbFor(const SsdTierOptions& options);
  // Open without the repair. Returns, besides Open's: DataLoss (RocksDB found the index
  // corrupt).
  static absl::StatusOr<std::unique_ptr<SsdTier>> OpenOnce(SsdTierOptions options);
  SsdTier(SsdTierOptions options, std::unique_ptr<rocksdb::Env> env,
          std::unique_ptr<IndexDatabase> db, std::unique_ptr<PayloadLog> log);
  absl::Status RebuildIndex(uint64_t old_format_rows);
  bool ExpiredLocked(const IndexEntry& e) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void CountExpired(uint64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // Expired or corrupt: in the index (its row is still there) but not served.
  bool HiddenLocked(const IndexEntry& e) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return e.corrupt || ExpiredLocked(e);
  }
  void InsertLocked(const ChunkId& id, IndexEntry e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a chunk from the index; returns its entry if it was there.
  std::optional<IndexEntry> ForgetLocked(const ChunkId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Undoes ForgetLocked for entries whose row deletion failed (their rows are still
  // there, so the index must hold them too). An entry whose chunk was put afresh
  // meanwhile is not restored: the new row replaced its row, and its bytes are freed.
  // Returns the chunks restored.
  std::vector<ChunkId> Restore(std::vector<std::pair<ChunkId, IndexEntry>> entries) ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes from the index, then the row, then frees its bytes; a failed row deletion
  // leaves the chunk stored. Errors: ResourceExhausted (disk full), Unavailable.
  absl::Status DeleteChunk(const ChunkId& id);
  // DeleteChunk if the chunk's copy is still the one at `extent` (found expired): a put
  // may have stored it afresh since. Returns whether it deleted it.
  absl::StatusOr<bool> DeleteIfStill(const ChunkId& id, const PayloadExtent& extent)
      ABSL_LOCKS_EXCLUDED(mu_);
  // DeleteChunk's part after the index: `e` is what ForgetLocked took, marked with
  // BeginUnrowLocked; unmarked here once its row is gone or it is back in the index.
  absl::Status DeleteRow(const ChunkId& id, IndexEntry e) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads [offset, offset + len) of a chunk's payload, following it if GC moves it, as
  // long as the copy stored is still the one `meta` describes: Aborted once the chunk
  // was stored afresh with other bytes (a reader must not mix two copies' bytes). Sets
  // `*extent` (if given) to where it read them.
  absl::Status ReadChunkRange(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                              uint64_t len,
                              absl::FunctionRef<void(uint64_t, absl::string_view)> out,
                              PayloadExtent* extent = nullptr);
  // Garbage collection: moves live chunks out of the files with the most dead bytes
  // until `incoming` more bytes fit under the disk limit (or nothing more is freed).
  void MakeRoom(uint64_t incoming) ABSL_LOCKS_EXCLUDED(mu_);
  // Put, without the retry after a full file system.
  absl::Status PutOnce(const ChunkId& id, const ChunkMeta& meta,
                       absl::Span<const absl::string_view> parts) ABSL_LOCKS_EXCLUDED(mu_);
  // The capacity the file system holding the payload files has room for now, at most
  // capacity_bytes (capacity_bytes if it cannot be read).
  uint64_t DiskFit() ABSL_LOCKS_EXCLUDED(mu_);
  // Sets limit_bytes_, saying so when the tier starts or stops being held below its
  // capacity.
  void SetLimit(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts the chunks of the payload file with the fewest live bytes, so that the file
  // dies and is deleted: on a full disk the policy's victims may lie in every file and
  // free nothing. Returns whether it evicted any (Ok), or why not.
  absl::StatusOr<bool> EvictLeastLiveFile() ABSL_LOCKS_EXCLUDED(mu_);
  // The rows of chunks just taken out of the index (BeginUnrowLocked, counted as
  // evictions): deletes them and frees their bytes, or, should the deletion fail, puts
  // them back. `what` names the eviction in an error.
  absl::Status DeleteEvictedRows(std::vector<std::pair<ChunkId, IndexEntry>> gone,
                                 absl::string_view what) ABSL_LOCKS_EXCLUDED(mu_);
  void Relocate(uint32_t file) ABSL_EXCLUSIVE_LOCKS_REQUIRED(gc_mu_);
  absl::Status MapWriteError(const rocksdb::Status& s, absl::string_view what);
  // Deletes a chunk that failed verification, counts it, and says so (DataLoss); of
  // several readers that find the same bad copy at once, one counts and deletes it. Only
  // if the chunk is still stored at `extent`: else Aborted (deleted or put afresh
  // meanwhile; the bad bytes are no one's), or DataLoss if another reader has just
  // dropped that copy as corrupt.
  absl::Status Corrupt(const ChunkId& id, absl::string_view cause,
                       const PayloadExtent& extent);

  const SsdTierOptions options_;
  // Wraps options_.file_system when set; must outlive db_.
  std::unique_ptr<rocksdb::Env> env_;
  std::unique_ptr<IndexDatabase> db_;
  std::unique_ptr<PayloadLog> log_;

  // One garbage collection at a time.
  absl::Mutex gc_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Held across a put's PayloadLog::Place and its entry into the eviction policy, so
  // that chunks enter the policy in the order of their places in the payload files.
  absl::Mutex place_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  absl::flat_hash_map<ChunkId, IndexEntry> index_ ABSL_GUARDED_BY(mu_);
  // The chunks of each payload file, for GC.
  absl::flat_hash_map<uint32_t, absl::flat_hash_set<ChunkId>> by_file_ ABSL_GUARDED_BY(mu_);
  // The copies most recently dropped as corrupt (at most kDroppedCorrupt, oldest first),
  // so that a reader of the same copy that finds it gone says DataLoss, not "deleted
  // meanwhile" (a streamed Get reads several frames of a chunk at once). A chunk put
  // afresh leaves the list.
  static constexpr size_t kDroppedCorrupt = 64;
  std::deque<std::pair<ChunkId, PayloadExtent>> dropped_corrupt_ ABSL_GUARDED_BY(mu_);
  // Index entries with `corrupt` set: the sweep runs for them even without a TTL.
  uint64_t corrupt_entries_ ABSL_GUARDED_BY(mu_) = 0;
  // Whether `id`'s copy at `extent` (any, without) is in dropped_corrupt_.
  bool DroppedCorruptLocked(const ChunkId& id, const std::optional<PayloadExtent>& extent) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Chunks being put: a second put of one waits for the first.
  absl::flat_hash_set<ChunkId> putting_ ABSL_GUARDED_BY(mu_);
  // Chunks out of the index whose rows are being deleted (a count per deleter): a put of
  // one waits, or the deletion, landing after its row, would delete the new row and
  // leave a chunk the next start-up has lost.
  absl::flat_hash_map<ChunkId, uint32_t> unrowing_ ABSL_GUARDED_BY(mu_);
  void BeginUnrowLocked(const ChunkId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A delete of a chunk whose row another thread is deleting (an eviction) waits for
  // it: should that deletion fail, the chunk goes back into the index, and a delete
  // that had found it gone and answered "done" would have been undone.
  void AwaitUnrowedLocked(const ChunkId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AwaitNamespaceUnrowedLocked(uint64_t ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs before_row_delete for each, if set. Without the tier's locks.
  void BeforeRowDelete(absl::Span<const ChunkId> ids) ABSL_LOCKS_EXCLUDED(mu_);
  void EndUnrow(absl::Span<const ChunkId> ids) ABSL_LOCKS_EXCLUDED(mu_);
  // Chunks being put that took their place in the eviction policy (when their payload
  // was placed) and are not in the index yet, or are there only as an entry put back
  // meanwhile: the put owns the policy entry until it ends, so InsertLocked and
  // ForgetLocked leave it alone.
  absl::flat_hash_set<ChunkId> placed_ ABSL_GUARDED_BY(mu_);
  const std::unique_ptr<EvictionPolicy> policy_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t payload_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Payload bytes per namespace (entries removed at zero).
  absl::flat_hash_map<uint64_t, uint64_t> ns_bytes_ ABSL_GUARDED_BY(mu_);
  // Bytes reserved by puts in flight, so concurrent puts do not overshoot capacity.
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The capacity puts evict to: options_.capacity_bytes, or less while the disk is full
  // (SsdTierStats::limit_bytes).
  uint64_t limit_bytes_ ABSL_GUARDED_BY(mu_);
  SsdTierStats counters_ ABSL_GUARDED_BY(mu_);
  // Last: its threads read through log_ and must stop first.
  std::unique_ptr<IoPool> readers_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_SSD_TIER_H_
