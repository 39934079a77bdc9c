// SsdTier: the SSD tier (L2) on RocksDB. Payloads go to a BlobDB-enabled column family
// ("data") so they are written once into blob files instead of being rewritten by
// compaction. A chunk is stored as segments of segment_bytes (rows <row key><be32 i>), so
// that neither a write batch nor a memtable ever holds a whole 32-256 MiB chunk: the
// memory the SSD tier needs outside the RAM pool stays at about the memtable budget plus
// one segment, whatever the chunk size.
//
// A put is three steps: a marker in "pending", the segments, then one batch that writes
// the chunk's "meta" row (size, CRC32C, token count, write time) and deletes the marker.
// The meta row is the commit record: a chunk without one does not exist. After a crash,
// start-up deletes the segments of every chunk still marked pending. The in-memory index
// (what is here, how big, recency) is rebuilt by scanning "meta" only. A fourth column
// family, "layouts", keeps registered layouts so namespaces survive restarts.
//
// Every read is verified against the stored CRC32C; a chunk that fails is deleted,
// counted and reported as DataLoss, never returned. Capacity (payload bytes) is bounded:
// a put that would exceed it first evicts least recently used chunks. An optional TTL
// hides and deletes chunks older than it.
//
// Thread-safety: all methods are thread-safe. RocksDB calls run without the index lock.
#ifndef KVTIER_STORAGE_SSD_TIER_H_
#define KVTIER_STORAGE_SSD_TIER_H_

#include <cstdint>
#include <functional>
#include <memory>
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
#include "storage/chunk_id.h"
#include "storage/io_pool.h"
#include "storage/lru_policy.h"

namespace kvtier {

struct SsdTierOptions {
  // Directory of the RocksDB database; created if missing.
  std::string path;
  // Most payload bytes kept; older chunks are evicted past it. Blob files not yet
  // garbage-collected can make disk use run somewhat above it.
  uint64_t capacity_bytes = 16ull << 30;
  // Chunks older than this are hidden and deleted; zero keeps them until evicted.
  absl::Duration ttl = absl::ZeroDuration();
  // fsync the WAL on every put. Off by default: an acknowledged put survives a killed
  // daemon either way (the WAL is in the page cache), only not a power cut.
  bool sync_writes = false;
  // Values at least this large go to blob files.
  uint64_t blob_min_bytes = 4096;
  // Chunks are stored in segments of this many bytes (>= 64 KiB).
  uint64_t segment_bytes = 4ull << 20;
  // Threads reading one chunk's segments in parallel (the SSD's queue depth per read).
  int read_threads = 4;
  // Memtable budget across column families (bytes). Payloads pass through the memtable
  // before they reach a blob file, so this is also the SSD tier's RAM overhead.
  uint64_t write_buffer_bytes = 32ull << 20;
  // Filesystem to use; null means the real one. Tests inject faults here.
  std::shared_ptr<rocksdb::FileSystem> file_system;
  // Clock for TTL; tests inject a fake one.
  std::function<absl::Time()> now = [] { return absl::Now(); };

  absl::Status Validate() const;
};

struct SsdTierStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t chunks = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t expirations = 0;
  uint64_t checksum_failures = 0;
  uint64_t write_errors = 0;
};

// Where SsdTier::ReadPayload puts a chunk's bytes (a RAM pool chunk, or a buffer).
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

class SsdTier {
 public:
  // Opens (or creates) the database and rebuilds the index. Returns: Ok,
  // InvalidArgument (bad options), Unavailable (RocksDB could not open).
  static absl::StatusOr<std::unique_ptr<SsdTier>> Open(SsdTierOptions options);
  ~SsdTier();

  // Stores a chunk whose payload is the concatenation of `parts`; idempotent (a present
  // chunk is left as is). Returns: Ok, InvalidArgument (larger than the capacity),
  // ResourceExhausted (the disk is full), Unavailable (other I/O error).
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
  // meta (Returns: Ok, NotFound, DataLoss, Unavailable), then the payload, read in
  // parallel segments into `sink` and verified against meta.crc32c (Returns: Ok,
  // NotFound (deleted meanwhile), DataLoss (now deleted), Unavailable).
  absl::StatusOr<ChunkMeta> ReadMeta(const ChunkId& id);
  absl::Status ReadPayload(const ChunkId& id, const ChunkMeta& meta, ChunkSink& sink);
  // Reads bytes [offset, offset + len) of the payload into `out` (len bytes), from the
  // segments that cover it; for streaming a chunk a frame at a time. RocksDB verifies
  // each segment's checksum; the chunk's CRC32C is the caller's to check, over the whole
  // payload. Returns: Ok, InvalidArgument (range past the chunk), NotFound (deleted
  // meanwhile), DataLoss (a segment is bad: the chunk is now deleted), Unavailable.
  absl::Status ReadRange(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                         uint64_t len, char* out);
  // Counts a hit for a chunk that will be read with ReadRange (ReadPayload counts its own).
  void CountRangedRead();
  // Deletes a chunk whose payload a caller found corrupt, counts it, and says so.
  // Returns DataLoss, for the caller to pass on.
  absl::Status DropCorrupt(const ChunkId& id);

  bool Contains(const ChunkId& id) const;
  // Returns true if the chunk was present. Errors: Unavailable.
  absl::StatusOr<bool> Delete(const ChunkId& id);
  absl::StatusOr<uint64_t> DeleteNamespace(uint64_t ns);
  // Deletes chunks past their TTL; returns how many.
  uint64_t ExpireOld();

  absl::Status SaveLayout(uint64_t ns, absl::string_view encoding);
  absl::StatusOr<std::vector<std::pair<uint64_t, std::string>>> LoadLayouts() const;

  SsdTierStats GetStats() const;
  // Flushes memtables so a clean shutdown leaves no WAL to replay.
  absl::Status Flush();

 private:
  struct IndexEntry {
    uint64_t size = 0;
    absl::Time written_at;
  };

  SsdTier(SsdTierOptions options, std::unique_ptr<rocksdb::Env> env,
          std::unique_ptr<rocksdb::DB> db,
          std::vector<rocksdb::ColumnFamilyHandle*> handles);
  absl::Status RebuildIndex();
  bool ExpiredLocked(const IndexEntry& e) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Deletes from RocksDB and the index. Errors: Unavailable.
  absl::Status DeleteChunk(const ChunkId& id);
  // Adds the deletes of a chunk's rows to `batch`. size 0: unknown, delete every
  // possible segment with a range tombstone.
  void AddDeletes(rocksdb::WriteBatch& batch, const std::string& row, uint64_t size) const;
  uint32_t SegmentCount(uint64_t size) const;
  void ForgetLocked(const ChunkId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MapWriteError(const rocksdb::Status& s, absl::string_view what);
  // Deletes a chunk that failed verification, counts it, and says so.
  absl::Status Corrupt(const ChunkId& id, const rocksdb::Status& cause);

  const SsdTierOptions options_;
  // Wraps options_.file_system when set; must outlive db_.
  std::unique_ptr<rocksdb::Env> env_;
  std::unique_ptr<rocksdb::DB> db_;
  // Order: default, meta, data, layouts, pending. Owned; destroyed before db_.
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  rocksdb::ColumnFamilyHandle* meta_cf_;
  rocksdb::ColumnFamilyHandle* data_cf_;
  rocksdb::ColumnFamilyHandle* layouts_cf_;
  rocksdb::ColumnFamilyHandle* pending_cf_;

  // Serializes chunk writes (see Put). Never held together with mu_ in the other order:
  // Put takes write_mu_ after releasing mu_, and takes mu_ inside it.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  absl::flat_hash_map<ChunkId, IndexEntry> index_ ABSL_GUARDED_BY(mu_);
  LruPolicy lru_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes reserved by puts in flight, so concurrent puts do not overshoot capacity.
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  SsdTierStats counters_ ABSL_GUARDED_BY(mu_);
  // Last: its threads read through db_ and must stop first.
  std::unique_ptr<IoPool> readers_;
};

// Encoding of RocksDB keys: be64(namespace) || 16-byte chunk key. Exposed for tests.
std::string SsdRowKey(const ChunkId& id);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_SSD_TIER_H_
