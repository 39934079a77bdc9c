#include "storage/ssd_tier.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rocksdb/env.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/write_batch.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/log_limiter.h"
#include "storage/rocksdb_logger.h"
#include "storage/ssd_row.h"
#include "storage/steady_now.h"

namespace kvtier {
namespace {

// The CRC32C of a payload from the CRC32Cs of its consecutive pieces of `piece` bytes.
uint32_t WholeCrc(absl::Span<const uint32_t> piece_crcs, uint64_t size, uint64_t piece) {
  uint32_t crc = 0;
  for (size_t i = 0; i < piece_crcs.size(); ++i) {
    const uint64_t len = std::min(piece, size - i * piece);
    crc = crc32c::Combine(crc, piece_crcs[i], len);
  }
  return crc;
}

absl::Status Unavailable(absl::string_view what, const rocksdb::Status& s) {
  return absl::UnavailableError(absl::StrCat("SSD tier: ", what, ": ", s.ToString()));
}

// At start-up: DataLoss where RocksDB found its own files corrupt (Open then repairs the
// index), else Unavailable.
absl::Status IndexError(absl::string_view what, const rocksdb::Status& s) {
  if (!s.IsCorruption()) return Unavailable(what, s);
  return absl::DataLossError(absl::StrCat("SSD tier: ", what, ": ", s.ToString()));
}

rocksdb::Slice AsSlice(absl::string_view s) { return rocksdb::Slice(s.data(), s.size()); }

// Column families of the version-1 layout (payload segments in BlobDB): dropped at open.
constexpr const char* kOldFamilies[] = {"data", "pending"};

}  // namespace

absl::Status SsdTierOptions::Validate() const {
  if (path.empty()) return absl::InvalidArgumentError("data_dir must not be empty");
  if (capacity_bytes == 0) {
    return absl::InvalidArgumentError("ssd_capacity must be greater than zero");
  }
  if (ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ssd_ttl must not be negative");
  }
  if (write_buffer_bytes < (4ull << 20)) {
    return absl::InvalidArgumentError("ssd_write_buffer must be at least 4 MiB");
  }
  if (read_threads < 1) return absl::InvalidArgumentError("ssd read_threads must be >= 1");
  if (absl::Status s = eviction.Validate(); !s.ok()) return s;
  PayloadLogOptions log;
  log.dir = path;
  log.piece_bytes = piece_bytes;
  log.io_bytes = io_bytes;
  log.file_bytes = FileBytes();
  log.write_depth = write_depth;
  return log.Validate();
}

uint64_t SsdTierOptions::FileBytes() const {
  if (file_bytes != 0) return file_bytes;
  return std::clamp<uint64_t>(capacity_bytes / 32, io_bytes, std::max<uint64_t>(io_bytes, 256ull << 20));
}

uint64_t SsdTierOptions::MinFreeBytes() const {
  if (min_free_bytes != 0) return min_free_bytes;
  return 2 * write_buffer_bytes + (64ull << 20);
}

// The index database's options and column families, for opening and for repairing it.
struct SsdTier::IndexDb {
  std::unique_ptr<rocksdb::Env> env;  // Over options.file_system; null: the default.
  rocksdb::DBOptions options;
  std::shared_ptr<IndexDatabase::WalFailures> wal_failures;
  std::vector<rocksdb::ColumnFamilyDescriptor> families;  // Those of an older layout too.
};

SsdTier::IndexDb SsdTier::IndexDbFor(const SsdTierOptions& options) {
  IndexDb db;
  rocksdb::DBOptions& db_options = db.options;
  if (options.file_system) {
    db.env = rocksdb::NewCompositeEnv(options.file_system);
    db_options.env = db.env.get();
  }
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.db_write_buffer_size = options.write_buffer_bytes;
  db_options.max_background_jobs = 2;
  // RocksDB's warnings and errors go to the daemon's log, not to a LOG file on the disk
  // the index shares (see RocksDbLogger: a LOG writer that hit a full disk aborts the
  // process on its next line).
  db_options.info_log = std::make_shared<RocksDbLogger>(rocksdb::InfoLogLevel::WARN_LEVEL);
  db_options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  db_options.use_fsync = false;
  // No preallocation: the WAL and tables hold only index rows, and a WAL preallocated
  // to the memtable's size (tens of MiB) would count against the disk for nothing.
  db_options.allow_fallocate = false;
  db.wal_failures = IndexDatabase::WatchWalFailures(&db_options);

  rocksdb::ColumnFamilyOptions small;
  small.compression = rocksdb::kNoCompression;
  small.write_buffer_size = std::min<uint64_t>(options.write_buffer_bytes / 2, 64ull << 20);

  db.families = {
      {rocksdb::kDefaultColumnFamilyName, small},
      {"meta", small},
      {"layouts", small},
  };
  // RocksDB logs an error when it looks for a database in a directory that is not there
  // yet, which every first start would show.
  {
    std::error_code ec;
    std::filesystem::create_directories(options.path, ec);  // Open reports a failure.
  }
  // A database from before the payload files has two more families; they must be opened
  // to be dropped.
  std::vector<std::string> existing;
  if (rocksdb::DB::ListColumnFamilies(db_options, options.path, &existing).ok()) {
    for (const char* old : kOldFamilies) {
      if (std::find(existing.begin(), existing.end(), old) != existing.end()) {
        db.families.push_back({old, small});
      }
    }
  }
  return db;
}

uint64_t SsdTierOptions::DiskBytesNeeded() const {
  return capacity_bytes + capacity_bytes / 16 + FileBytes() + MinFreeBytes();
}

uint64_t SsdTierOptions::LargestCapacityFor(uint64_t room) const {
  const uint64_t overhead = FileBytes() + MinFreeBytes();
  return room > overhead ? (room - overhead) / 17 * 16 : 0;
}

absl::StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(SsdTierOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<SsdTier>> tier = OpenOnce(options);
  if (!absl::IsDataLoss(tier.status())) return tier;
  // A cache must not refuse to start over its own index: repair it and start with what
  // can be read. RocksDB's RepairDB keeps every table it can read whole and moves the
  // others to <path>/lost; chunks whose rows went with them are payload no row names,
  // reclaimed like any other.
  LogError(tier.status().message(), "; repairing the index (RocksDB RepairDB): chunks whose "
           "rows cannot be read are dropped, damaged files go to ", options.path, "/lost");
  {
    IndexDb db = IndexDbFor(options);
    rocksdb::Status r = rocksdb::RepairDB(options.path, db.options, db.families);
    if (!r.ok()) return Unavailable("repairing the corrupt index", r);
  }
  tier = OpenOnce(options);
  if (absl::IsDataLoss(tier.status())) {
    return absl::UnavailableError(absl::StrCat(
        tier.status().message(), " (still, after a repair): move ", options.path,
        " aside to start with an empty SSD tier"));
  }
  if (tier.ok()) {
    absl::MutexLock lock(&(*tier)->mu_);
    (*tier)->counters_.index_repairs = 1;
  }
  return tier;
}

absl::StatusOr<std::unique_ptr<SsdTier>> SsdTier::OpenOnce(SsdTierOptions options) {
  IndexDb index = IndexDbFor(options);
  std::unique_ptr<rocksdb::Env> env = std::move(index.env);
  const rocksdb::DBOptions& db_options = index.options;
  const std::vector<rocksdb::ColumnFamilyDescriptor>& families = index.families;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.path, families, &handles, &raw);
  if (!s.ok()) {
    return IndexError(absl::StrCat("data_dir: cannot open RocksDB at ", options.path), s);
  }
  std::unique_ptr<rocksdb::DB> db(raw);
  uint64_t old_format_rows = 0;
  while (handles.size() > 3) {
    rocksdb::ColumnFamilyHandle* h = handles.back();
    handles.pop_back();
    if (h->GetName() == "data") {
      // Count the version-1 chunks (their meta rows are dropped as unreadable below).
      std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), handles[1]));
      for (it->SeekToFirst(); it->Valid(); it->Next()) ++old_format_rows;
    }
    rocksdb::Status d = db->DropColumnFamily(h);
    db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    if (!d.ok()) return Unavailable("dropping the version-1 payload rows", d);
  }

  PayloadLogOptions log_options;
  log_options.dir = options.path + "/payload";
  log_options.file_bytes = options.FileBytes();
  log_options.io_bytes = options.io_bytes;
  log_options.piece_bytes = options.piece_bytes;
  log_options.write_depth = options.write_depth;
  log_options.read_depth = 2 * options.read_threads;
  log_options.direct_io = options.direct_io;
  log_options.sync = options.sync_writes;
  log_options.min_free_bytes = options.MinFreeBytes();
  log_options.file_ops = options.file_ops;
  auto log = PayloadLog::Open(std::move(log_options));
  if (!log.ok()) return log.status();

  // Reopened, should a WAL write fail, with the families left.
  std::vector<rocksdb::ColumnFamilyDescriptor> kept(families.begin(), families.begin() + 3);
  auto index_db = std::make_unique<IndexDatabase>(std::move(db), std::move(handles), db_options,
                                                  std::move(kept), options.path,
                                                  index.wal_failures, options.now);
  std::unique_ptr<SsdTier> tier(new SsdTier(std::move(options), std::move(env),
                                            std::move(index_db), *std::move(log)));
  if (absl::Status r = tier->RebuildIndex(old_format_rows); !r.ok()) return r;
  // A capacity the disk cannot hold is an operator's mistake worth a line; the tier
  // keeps to what fits from the start, rather than find out when a put fails.
  if (struct statvfs fs {}; statvfs(tier->options_.path.c_str(), &fs) == 0) {
    const uint64_t room = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize +
                          tier->log_->GetStats().disk_bytes;
    const SsdTierOptions& o = tier->options_;
    if (room < o.DiskBytesNeeded()) {
      LogWarning("SSD tier: ssd_capacity is ", o.capacity_bytes >> 20,
                 " MiB, but the file system holding ", o.path, " has room for ", room >> 20,
                 " MiB; the payload files take up to ssd_capacity x 17/16 plus one ",
                 o.FileBytes() >> 20, " MiB file being filled, and ", o.MinFreeBytes() >> 20,
                 " MiB must stay free for the index: the tier will hold only what fits and "
                 "evict to stay there; lower ssd_capacity to at most ",
                 o.LargestCapacityFor(room) >> 20, " MiB");
      const uint64_t fit = tier->DiskFit();
      absl::MutexLock lock(&tier->mu_);
      tier->limit_bytes_ = fit;
    }
  }
  return tier;
}

SsdTier::SsdTier(SsdTierOptions options, std::unique_ptr<rocksdb::Env> env,
                 std::unique_ptr<IndexDatabase> db, std::unique_ptr<PayloadLog> log)
    : options_(std::move(options)),
      env_(std::move(env)),
      db_(std::move(db)),
      log_(std::move(log)),
      policy_(MakeEvictionPolicy(options_.eviction)),
      readers_(std::make_unique<IoPool>(options_.read_threads)) {
  limit_bytes_ = options_.capacity_bytes;
}

SsdTier::~SsdTier() {
  readers_.reset();  // No read may run past the database.
  db_.reset();
}

absl::Status SsdTier::RebuildIndex(uint64_t old_format_rows) {
  struct Found {
    ChunkId id;
    SsdRow row;
  };
  std::vector<Found> found;
  std::vector<std::string> drop_rows;  // Unreadable, expired, over capacity, or lost.
  uint64_t bad = 0;
  rocksdb::Status scanned = db_->Scan(
      /*layouts=*/false, [&](const rocksdb::Slice& k, const rocksdb::Slice& v) {
        Found f;
        const absl::string_view key(k.data(), k.size());
        if (!ParseSsdRowKey(key, &f.id) ||
            !DecodeSsdRow(absl::string_view(v.data(), v.size()), &f.row)) {
          drop_rows.emplace_back(key);
          ++bad;
          return true;
        }
        found.push_back(std::move(f));
        return true;
      });
  if (!scanned.ok()) return IndexError("scanning the index at start-up", scanned);

  // Newest first: capacity keeps the most recently written.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.row.written_at > b.row.written_at;
  });
  uint64_t expired = 0, over = 0, lost = 0, kept_bytes = 0;
  std::vector<Found*> keep;
  for (Found& f : found) {
    if (options_.ttl > absl::ZeroDuration() && f.row.written_at + options_.ttl <= options_.now()) {
      ++expired;
    } else if (kept_bytes + f.row.extent.footprint() > options_.capacity_bytes) {
      ++over;  // A smaller capacity than last run.
    } else if (f.row.piece_bytes != log_->piece_bytes() || !log_->Adopt(f.row.extent)) {
      ++lost;  // Its payload file is gone or too short (or written with other pieces).
    } else {
      kept_bytes += f.row.extent.footprint();
      keep.push_back(&f);
      continue;
    }
    drop_rows.push_back(SsdRowKey(f.id));
  }
  {
    absl::MutexLock lock(&mu_);
    // Oldest first, so the least recently written sit at the LRU's cold end.
    for (auto k = keep.rbegin(); k != keep.rend(); ++k) {
      Found& f = **k;
      InsertLocked(f.id, IndexEntry{f.row.meta, f.row.written_at, f.row.extent,
                                    std::make_shared<const std::vector<uint32_t>>(
                                        std::move(f.row.piece_crcs))});
    }
    counters_.expirations += expired;
    counters_.evictions += over;
    counters_.lost_at_start += lost;
  }
  if (!drop_rows.empty()) {
    rocksdb::Status s = db_->Write(rocksdb::WriteOptions(), [&](auto& batch, const auto& f) {
      for (const std::string& row : drop_rows) batch.Delete(f.meta, row);
    });
    if (!s.ok()) return Unavailable("dropping stale rows at start-up", s);
  }
  // Files no row points into: puts cut off by a crash, chunks dropped above.
  const int dead_files = log_->FinishRecovery();
  if (old_format_rows > 0) {
    LogWarning("SSD tier: dropped ", old_format_rows,
               " chunks stored in the version-1 layout (payloads in RocksDB); clients "
               "recompute them");
  } else if (bad > 0) {
    LogWarning("SSD tier: dropped ", bad, " unreadable index rows at start-up");
  }
  if (lost > 0) {
    LogWarning("SSD tier: dropped ", lost, " chunks whose payload file is missing or short");
  }
  absl::MutexLock lock(&mu_);
  LogInfo("SSD tier: recovered ", index_.size(), " chunks (", payload_bytes_, " bytes) from ",
          options_.path, "; dropped ", expired, " expired and ", over,
          " over capacity; deleted ", dead_files, " payload files holding nothing live",
          log_->GetStats().direct_io ? "" : "; the filesystem has no O_DIRECT, writes are buffered");
  return absl::OkStatus();
}

bool SsdTier::ExpiredLocked(const IndexEntry& e) const {
  return options_.ttl > absl::ZeroDuration() && e.written_at + options_.ttl <= options_.now();
}

void SsdTier::InsertLocked(const ChunkId& id, IndexEntry e) {
  used_bytes_ += e.extent.footprint();
  payload_bytes_ += e.meta.size;
  ns_bytes_[id.ns] += e.meta.size;
  by_file_[e.extent.file].insert(id);
  if (e.corrupt) ++corrupt_entries_;
  const ChunkLineage lineage = e.meta.lineage;
  if (!dropped_corrupt_.empty()) {  // Put afresh: a reader that misses it now says so.
    dropped_corrupt_.erase(
        std::remove_if(dropped_corrupt_.begin(), dropped_corrupt_.end(),
                       [&](const auto& d) { return d.first == id; }),
        dropped_corrupt_.end());
  }
  index_[id] = std::move(e);
  // A chunk being put has its place already (see Put); entering it again would move it.
  if (!placed_.contains(id)) policy_->OnInsert(id, lineage);
}

std::optional<SsdTier::IndexEntry> SsdTier::ForgetLocked(const ChunkId& id) {
  auto it = index_.find(id);
  if (it == index_.end()) return std::nullopt;
  IndexEntry e = std::move(it->second);
  index_.erase(it);
  if (e.corrupt) --corrupt_entries_;
  used_bytes_ -= e.extent.footprint();
  payload_bytes_ -= e.meta.size;
  if (auto n = ns_bytes_.find(id.ns); n != ns_bytes_.end()) {
    n->second -= e.meta.size;
    if (n->second == 0) ns_bytes_.erase(n);
  }
  if (!placed_.contains(id)) policy_->OnRemove(id);  // Else the put in flight keeps it.
  if (auto f = by_file_.find(e.extent.file); f != by_file_.end()) {
    f->second.erase(id);
    if (f->second.empty()) by_file_.erase(f);
  }
  return e;
}

absl::Status SsdTier::MapWriteError(const rocksdb::Status& s, absl::string_view what) {
  {
    absl::MutexLock lock(&mu_);
    ++counters_.write_errors;
  }
  // A failed write can leave RocksDB in a background-error state that refuses every
  // later write: IndexDatabase::Write resumes it, or reopens it, at the next write.
  // A write refused because an earlier background flush hit a full disk carries the
  // cause only in its text, not its subcode.
  if (s.IsNoSpace() || s.subcode() == rocksdb::Status::kSpaceLimit ||
      absl::StrContains(s.ToString(), "No space left") ||
      absl::StrContains(s.ToString(), "NoSpace")) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "SSD tier: disk full while ", what, " (", s.ToString(),
        "); free space under data_dir or lower ssd_capacity"));
  }
  return Unavailable(what, s);
}

uint64_t SsdTier::DiskFit() {
  absl::StatusOr<uint64_t> room = log_->Room();
  if (!room.ok()) return options_.capacity_bytes;
  // As SsdTierOptions::LargestCapacityFor, but a disk with less room than two payload
  // files still holds half of it: a full disk costs a put a file's worth of eviction.
  const uint64_t filling = std::min(options_.FileBytes(), *room / 2);
  return std::min(options_.capacity_bytes, (*room - filling) / 17 * 16);
}

void SsdTier::SetLimit(uint64_t bytes) {
  uint64_t was;
  {
    absl::MutexLock lock(&mu_);
    was = limit_bytes_;
    limit_bytes_ = bytes;
  }
  if (was == options_.capacity_bytes && bytes < was) {
    LogWarning("SSD tier: the file system holding ", options_.path,
               " is full: the tier now keeps to ", bytes >> 20, " MiB of its ",
               options_.capacity_bytes >> 20,
               " MiB ssd_capacity, evicting to stay there, until space comes back");
  } else if (was < options_.capacity_bytes && bytes == options_.capacity_bytes) {
    LogInfo("SSD tier: the file system holding ", options_.path,
            " has room for the whole ssd_capacity again");
  }
}

void SsdTier::MakeRoom(uint64_t incoming) {
  uint64_t limit;
  {
    absl::MutexLock lock(&mu_);
    limit = limit_bytes_ + limit_bytes_ / 16;
  }
  if (log_->disk_bytes() + incoming <= limit) return;
  absl::MutexLock gc(&gc_mu_);
  log_->RetryDeletes();
  // Each round deletes one file (less what its live chunks take again), so this ends;
  // a round that frees nothing (a file that cannot be deleted, or whose chunks a put
  // or a delete holds) ends it too, rather than trying that file again and again.
  for (int round = 0; round < 256 && log_->disk_bytes() + incoming > limit; ++round) {
    auto candidate = log_->MostGarbage();
    if (!candidate) return;
    const uint64_t before = log_->disk_bytes();
    Relocate(candidate->file);
    if (log_->disk_bytes() >= before) return;
  }
}

void SsdTier::Relocate(uint32_t file) {
  std::vector<std::pair<ChunkId, IndexEntry>> chunks;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = by_file_.find(file); it != by_file_.end()) {
      for (const ChunkId& id : it->second) chunks.emplace_back(id, index_.at(id));
    }
  }
  uint64_t moved_bytes = 0;
  for (auto& [id, e] : chunks) {
    auto moved = log_->Move(e.extent, *e.piece_crcs);
    if (absl::IsDataLoss(moved.status())) {
      Corrupt(id, moved.status().message(), e.extent).IgnoreError();
      continue;
    }
    if (!moved.ok()) {
      // A line a second: on a full disk every put tries, and fails the same way.
      static LogLimiter limiter(absl::Seconds(1));
      if (auto held = limiter.Allow(SteadyNow())) {
        LogWarning("SSD tier: garbage collection of ", PayloadLog::FileName(file),
                   " stopped: ", moved.status().message(), " (", *held, " more like it)");
      }
      return;
    }
    bool committed = false;
    {
      // Under the index lock, so that a delete of this chunk cannot fall between the
      // check and the row write and be undone by it.
      absl::MutexLock lock(&mu_);
      auto it = index_.find(id);
      if (it != index_.end() && it->second.extent == e.extent) {
        SsdRow row{e.meta, e.written_at, *moved, static_cast<uint32_t>(log_->piece_bytes()),
                   *e.piece_crcs};
        rocksdb::WriteOptions wo;
        wo.sync = options_.sync_writes;
        const std::string key = SsdRowKey(id);  // Not `id` in the lambda: a binding.
        rocksdb::Status s = db_->Write(wo, [&](auto& batch, const auto& f) {
          batch.Put(f.meta, key, EncodeSsdRow(row));
        });
        if (s.ok()) {
          auto f = by_file_.find(file);
          if (f != by_file_.end()) {
            f->second.erase(id);
            if (f->second.empty()) by_file_.erase(f);
          }
          it->second.extent = *moved;
          by_file_[moved->file].insert(id);
          committed = true;
        }
      }
    }
    log_->Release(committed ? e.extent : *moved);
    if (committed) moved_bytes += e.extent.footprint();
  }
  absl::MutexLock lock(&mu_);
  ++counters_.gc_files;
  counters_.gc_bytes += moved_bytes;
}

absl::Status SsdTier::Put(const ChunkId& id, const ChunkMeta& meta,
                          absl::Span<const absl::string_view> parts) {
  bool limited;
  {
    absl::MutexLock lock(&mu_);
    limited = limit_bytes_ < options_.capacity_bytes;
  }
  if (limited) SetLimit(DiskFit());  // Room may have come back, or gone.
  absl::Status s = PutOnce(id, meta, parts);
  // The file system filled before the tier did (a capacity larger than the disk, or
  // someone else's files). A cache yields rather than refuse every put until an
  // operator acts. The tier keeps to what the disk holds now (later puts evict to it in
  // the policy's order, and keep it up to date until the disk has room for the whole
  // capacity again); and for this put, a file's worth of chunks is evicted, the file
  // with the fewest live bytes, until the put fits: the policy's victims may lie in
  // every file and free nothing, and garbage collection needs the room that is missing.
  const uint64_t footprint = PayloadExtent{0, 0, meta.size}.footprint();
  for (int pass = 0; absl::IsResourceExhausted(s) && pass < 64; ++pass) {
    // Not for want of free space (a write that failed ENOSPC all the same, or room that
    // came back meanwhile): not for this put to evict.
    if (!log_->Full(footprint)) return s;
    const uint64_t fit = DiskFit();
    // A chunk an emptied tier would have no room for evicts nothing for nothing.
    if (footprint > fit) return s;
    SetLimit(fit);
    absl::StatusOr<bool> evicted = EvictLeastLiveFile();
    if (!evicted.ok()) return evicted.status();
    if (!*evicted) return s;  // Nothing left to free.
    s = PutOnce(id, meta, parts);
  }
  return s;
}

absl::Status SsdTier::PutOnce(const ChunkId& id, const ChunkMeta& meta,
                              absl::Span<const absl::string_view> parts) {
  const PayloadExtent shape{0, 0, meta.size};
  const uint64_t footprint = shape.footprint();
  std::vector<std::pair<ChunkId, IndexEntry>> victims;
  bool replaces_expired = false;  // This put's own expired copy is among the victims.
  if (options_.put_waits_for_row_delete) {
    bool waits;
    {
      absl::MutexLock lock(&mu_);
      waits = unrowing_.contains(id);
    }
    if (waits) options_.put_waits_for_row_delete(id);
  }
  {
    absl::MutexLock lock(&mu_);
    // A second put of a chunk waits for the first, then finds it stored; a put of a
    // chunk being deleted waits for its row to go.
    struct Waiting {
      const absl::flat_hash_set<ChunkId>* putting;
      const absl::flat_hash_map<ChunkId, uint32_t>* unrowing;
      const ChunkId* id;
    } waiting{&putting_, &unrowing_, &id};
    mu_.Await(absl::Condition(
        +[](Waiting* w) {
          return !w->putting->contains(*w->id) && !w->unrowing->contains(*w->id);
        },
        &waiting));
    auto it = index_.find(id);
    if (it != index_.end() && !HiddenLocked(it->second)) return absl::OkStatus();
    if (footprint > options_.capacity_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk of ", meta.size, " bytes exceeds ssd_capacity (", options_.capacity_bytes,
          ")"));
    }
    if (footprint > limit_bytes_) {  // Evicting every chunk would not make room for it.
      return absl::ResourceExhaustedError(absl::StrCat(
          "SSD tier: disk full: the file system holding ", options_.path,
          " has room for ", limit_bytes_ >> 20, " MiB of chunks now, less than this chunk's ",
          meta.size, " bytes; free space under data_dir or lower ssd_capacity"));
    }
    if (it != index_.end()) {
      // Past its TTL, or found corrupt, and its row not deleted yet: this put replaces
      // it, so the chunk is stored afresh rather than acknowledged and then hidden. Its
      // old bytes are dead once the new row overwrites the old one; should this put
      // store nothing, the old copy goes back into the index (below) for the sweep to
      // delete.
      replaces_expired = !it->second.corrupt;
      victims.emplace_back(id, *ForgetLocked(id));
    }
    while (used_bytes_ + reserved_bytes_ + footprint > limit_bytes_) {
      auto victim = policy_->PickVictim([&](const ChunkId& c) {
        mu_.AssertHeld();
        return index_.contains(c);
      });
      if (!victim) break;  // The rest is reserved by puts in flight.
      victims.emplace_back(*victim, *ForgetLocked(*victim));
      BeginUnrowLocked(*victim);
      ++counters_.evictions;
    }
    reserved_bytes_ += footprint;
    putting_.insert(id);
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;

  // The victims' rows go first (their bytes are freed only once no row points at them).
  rocksdb::Status s;
  bool expired_self = false;
  std::vector<ChunkId> evicted;  // The victims but this put's own expired copy.
  for (const auto& [v, e] : victims) {
    if (v != id) {
      evicted.push_back(v);
    } else {
      expired_self = true;  // Overwritten by this put's row instead.
    }
  }
  BeforeRowDelete(evicted);
  if (!evicted.empty()) {
    s = db_->Write(wo, [&](auto& batch, const auto& f) {
      for (const ChunkId& v : evicted) batch.Delete(f.meta, SsdRowKey(v));
    });
  }
  const bool victims_gone = s.ok();
  if (victims_gone) {
    for (const auto& [v, e] : victims) {
      if (v == id) continue;
      log_->Release(e.extent);
    }
    EndUnrow(evicted);
    for (const ChunkId& v : evicted) {
      if (options_.on_evict) options_.on_evict(v);
    }
  }

  std::vector<uint32_t> piece_crcs;
  absl::StatusOr<PayloadExtent> extent = absl::UnknownError("not written");
  absl::Status status;
  bool placed = false;
  if (victims_gone) {
    MakeRoom(footprint);
    // The chunk takes its place in the eviction order as it takes its place in the
    // payload files, under one lock: concurrent puts (write-back's flushers) then enter
    // both in the same order, so plain LRU churn empties the oldest file first and it is
    // deleted whole. Entered when its write completes instead, a put that finished
    // before one placed ahead of it would be evicted after it, leaving a few live chunks
    // in otherwise dead files for garbage collection to copy forward, where they are
    // soon evicted and leave holes that call for more (the write amplification issue 10
    // measured).
    std::optional<PayloadLog::Placement> placement;
    {
      absl::MutexLock order(&place_mu_);
      absl::StatusOr<PayloadLog::Placement> p = log_->Place(meta.size);
      if (p.ok()) {
        placement.emplace(*std::move(p));
        absl::MutexLock lock(&mu_);
        placed_.insert(id);
        policy_->OnInsert(id, meta.lineage);
        placed = true;
      } else {
        extent = p.status();
      }
    }
    if (placement) extent = log_->Write(*std::move(placement), parts, &piece_crcs);
    status = extent.status();
    // The pieces' checksums are of the bytes written: they must add up to the chunk's,
    // or a RAM copy that changed since its put was checked would be stored with
    // checksums that vouch for it, and served from here as sound.
    if (status.ok() && WholeCrc(piece_crcs, meta.size, log_->piece_bytes()) != meta.crc32c) {
      log_->Release(*extent);
      status = absl::DataLossError(absl::StrFormat(
          "SSD tier: the bytes of chunk %s to store do not match its CRC32C (%08x); "
          "nothing stored",
          id.key.ToHex(), meta.crc32c));
    }
  } else {
    status = MapWriteError(s, "evicting chunks");
  }
  const absl::Time now = options_.now();
  if (status.ok()) {
    SsdRow row{meta, now, *extent, static_cast<uint32_t>(log_->piece_bytes()), piece_crcs};
    rocksdb::Status c = db_->Write(wo, [&](auto& batch, const auto& f) {
      batch.Put(f.meta, SsdRowKey(id), EncodeSsdRow(row));
    });
    if (!c.ok()) {
      log_->Release(*extent);
      status = MapWriteError(c, "writing a chunk's index row");
    } else if (expired_self) {
      log_->Release(victims.front().second.extent);  // The row no longer points there.
    }
  } else if (victims_gone && (absl::IsResourceExhausted(status) || absl::IsUnavailable(status))) {
    absl::MutexLock lock(&mu_);
    ++counters_.write_errors;
  }
  std::optional<IndexEntry> replaced;
  {
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= footprint;
    putting_.erase(id);
    if (status.ok()) {
      if (replaces_expired) ++counters_.expirations;
      // An entry put back meanwhile (a delete of this chunk whose row deletion failed)
      // is replaced: this put's row overwrote its row, so its bytes are dead. Its place
      // in the eviction order stays the one this put took (placed_, until just below).
      replaced = ForgetLocked(id);
      InsertLocked(id, IndexEntry{meta, now, *extent,
                                  std::make_shared<const std::vector<uint32_t>>(
                                      std::move(piece_crcs))});
      placed_.erase(id);
    } else if (placed) {
      placed_.erase(id);
      // Nothing stored: out of the eviction order, unless an entry put back meanwhile
      // (see above) holds the place now.
      if (!index_.contains(id)) policy_->OnRemove(id);
    }
  }
  if (replaced) log_->Release(replaced->extent);
  if (victims_gone && expired_self && !status.ok()) {
    // Its row still points at its bytes: back into the index (still expired, so hidden)
    // rather than out of it with its bytes counted live for ever, which kept its payload
    // file from ever being deleted or collected.
    std::vector<std::pair<ChunkId, IndexEntry>> self;
    self.push_back(std::move(victims.front()));
    Restore(std::move(self));
  }
  if (!victims_gone) {
    // Their rows are still there: put them back in the index rather than lose them to a
    // put that stored nothing. (They return as most recently used; the LRU has no way
    // to insert at the cold end.)
    const std::vector<ChunkId> restored = Restore(std::move(victims));
    EndUnrow(evicted);
    absl::MutexLock lock(&mu_);
    for (const ChunkId& v : restored) {
      if (v != id) --counters_.evictions;  // This put's own expired copy was no eviction.
    }
  }
  return status;
}

absl::StatusOr<SsdTier::Chunk> SsdTier::Get(const ChunkId& id) {
  auto meta = ReadMeta(id);
  if (!meta.ok()) return meta.status();
  Chunk chunk;
  chunk.meta = *meta;
  chunk.data.resize(meta->size);
  StringSink sink(&chunk.data);
  if (absl::Status s = ReadPayload(id, *meta, sink); !s.ok()) return s;
  return chunk;
}

namespace {

absl::Status CorruptChunkError(const ChunkId& id) {
  return absl::DataLossError(absl::StrCat(
      "chunk ", id.key.ToHex(), " failed its CRC32C check on the SSD tier (or the device "
      "could not read it) and was deleted; recompute it"));
}

absl::Status StoredAfreshError(const ChunkId& id) {
  return absl::AbortedError(absl::StrCat("chunk ", id.key.ToHex(),
                                         " was deleted or stored afresh while it was read; "
                                         "read it again"));
}

}  // namespace

bool SsdTier::DroppedCorruptLocked(const ChunkId& id,
                                   const std::optional<PayloadExtent>& extent) const {
  return std::any_of(dropped_corrupt_.begin(), dropped_corrupt_.end(), [&](const auto& d) {
    return d.first == id && (!extent.has_value() || d.second == *extent);
  });
}

absl::Status SsdTier::Corrupt(const ChunkId& id, absl::string_view cause,
                             const PayloadExtent& extent) {
  std::optional<IndexEntry> e;
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end() || !(it->second.extent == extent)) {
      // Another reader of this copy dropped it just now: the same verdict.
      if (DroppedCorruptLocked(id, extent)) return CorruptChunkError(id);
      // Deleted, or put afresh elsewhere, since the read: the bad bytes are no one's.
      return StoredAfreshError(id);
    }
    // Found bad before, and kept hidden as its row delete failed: the same verdict.
    if (it->second.corrupt) return CorruptChunkError(id);
    // Taken out of the index under the same lock as the check: one reader counts it.
    dropped_corrupt_.emplace_back(id, it->second.extent);
    if (dropped_corrupt_.size() > kDroppedCorrupt) dropped_corrupt_.pop_front();
    e = ForgetLocked(id);
    e->corrupt = true;  // Should its row delete fail, back into the index hidden.
    BeginUnrowLocked(id);
    ++counters_.checksum_failures;
  }
  LogWarning("SSD tier: chunk ", id.DebugString(),
             " failed its checksum or could not be read, and was deleted",
             cause.empty() ? "" : absl::StrCat(" (", cause, ")"));
  if (absl::Status d = DeleteRow(id, *std::move(e)); !d.ok()) {
    LogError("SSD tier: could not delete corrupt chunk ", id.DebugString(), ": ", d.message(),
             "; it stays hidden until a put replaces it or the sweep deletes it");
  }
  // Here, where the one reader that took it out of the index is known: an event per
  // dropped copy, not per reader that found it bad.
  if (options_.on_corrupt) options_.on_corrupt(id);
  return CorruptChunkError(id);
}

std::optional<ChunkMeta> SsdTier::PeekMeta(const ChunkId& id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end() || HiddenLocked(it->second)) return std::nullopt;
  return it->second.meta;
}

absl::StatusOr<ChunkMeta> SsdTier::ReadMeta(const ChunkId& id) {
  PayloadExtent hidden;
  bool corrupt;
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end()) {
      ++counters_.misses;
      return absl::NotFoundError("chunk not on SSD");
    }
    if (!HiddenLocked(it->second)) {
      policy_->OnAccess(id);
      return it->second.meta;
    }
    ++counters_.misses;
    hidden = it->second.extent;
    corrupt = it->second.corrupt;
  }
  // Not here, whatever becomes of its row: a failed delete (a full disk) is this tier's
  // to retry in its sweep, not a reason for the reader to retry or to skip other tiers.
  absl::StatusOr<bool> gone = DeleteIfStill(id, hidden);
  if (!gone.ok()) {
    static LogLimiter limiter(absl::Seconds(1));
    if (auto held = limiter.Allow(options_.now())) {
      LogWarning("SSD tier: could not delete the row of ", corrupt ? "corrupt" : "expired",
                 " chunk ", id.DebugString(), ": ", gone.status().message(), " (", *held,
                 " more like it held back)");
    }
  } else if (*gone && !corrupt) {
    CountExpired(1);
    if (options_.on_evict) options_.on_evict(id);
  }
  return absl::NotFoundError(corrupt ? "chunk on SSD failed its checksum and was dropped"
                                     : "chunk on SSD expired (ssd_ttl)");
}

void SsdTier::CountExpired(uint64_t n) {
  absl::MutexLock lock(&mu_);
  counters_.expirations += n;
}

absl::Status SsdTier::ReadChunkRange(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                                     uint64_t len,
                                     absl::FunctionRef<void(uint64_t, absl::string_view)> out,
                                     PayloadExtent* extent) {
  // A GC move between the lookup and the read makes the old file vanish: look again.
  for (int attempt = 0;; ++attempt) {
    IndexEntry e;
    {
      absl::MutexLock lock(&mu_);
      auto it = index_.find(id);
      if (it == index_.end()) {
        // Another frame's read of this chunk found it corrupt: say so, as it did.
        if (DroppedCorruptLocked(id, std::nullopt)) return CorruptChunkError(id);
        return absl::NotFoundError("chunk not on SSD (deleted meanwhile)");
      }
      // Stored afresh since the caller read its meta: these are other bytes, which its
      // earlier ranges and its whole-chunk CRC32C do not belong to.
      if (!(it->second.meta == meta)) return StoredAfreshError(id);
      if (it->second.corrupt) return CorruptChunkError(id);  // Dropped; its row remains.
      e = it->second;
    }
    if (extent != nullptr) *extent = e.extent;
    absl::Status s = log_->Read(e.extent, *e.piece_crcs, offset, len, out);
    if (absl::IsDataLoss(s)) {
      absl::Status c = Corrupt(id, s.message(), e.extent);
      if (absl::IsAborted(c) && attempt < 2) continue;  // Replaced meanwhile: read it.
      return c;
    }
    if (!absl::IsNotFound(s) || attempt == 2) return s;
  }
}

absl::Status SsdTier::ReadPayload(const ChunkId& id, const ChunkMeta& meta, ChunkSink& sink) {
  const uint64_t step = log_->io_bytes();
  const uint64_t n = (meta.size + step - 1) / step;
  absl::Mutex mu;
  uint64_t pending = n;
  absl::Status first_error;
  // Where the pieces came from: one copy, or (a GC move, or the same bytes put again,
  // while they were read) several with the same meta.
  std::optional<PayloadExtent> from;
  bool mixed = false;
  auto read_one = [&](uint64_t i) {
    const uint64_t offset = i * step;
    PayloadExtent extent;
    absl::Status s = ReadChunkRange(
        id, meta, offset, std::min(step, meta.size - offset),
        [&sink](uint64_t at, absl::string_view b) { sink.Write(at, b); }, &extent);
    absl::MutexLock lock(&mu);
    if (!s.ok() && first_error.ok()) first_error = std::move(s);
    if (s.ok()) {
      if (from.has_value() && !(*from == extent)) mixed = true;
      from = extent;
    }
    --pending;
  };
  if (n <= 1) {
    if (n == 1) read_one(0);
  } else {
    for (uint64_t i = 0; i < n; ++i) readers_->Submit([&read_one, i] { read_one(i); });
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](uint64_t* p) { return *p == 0; }, &pending));
  }
  if (absl::IsNotFound(first_error)) {
    absl::MutexLock lock(&mu_);
    ++counters_.misses;
    return first_error;
  }
  if (!first_error.ok()) return first_error;
  // Every piece checked out; the whole-chunk CRC catches a row whose piece checksums
  // belong to other bytes. Of pieces read from two copies, which is bad is unknown:
  // neither is dropped, and a read again finds out.
  if (sink.Crc32c() != meta.crc32c) {
    if (mixed || !from.has_value()) return StoredAfreshError(id);
    return Corrupt(id, "whole-chunk CRC32C", *from);
  }
  absl::MutexLock lock(&mu_);
  ++counters_.hits;
  return absl::OkStatus();
}

absl::Status SsdTier::ReadRange(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                                uint64_t len, char* out) {
  if (offset > meta.size || len > meta.size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("range [", offset, ", +", len,
                                                   ") is past the chunk's ", meta.size,
                                                   " bytes"));
  }
  return ReadChunkRange(id, meta, offset, len, [out, offset](uint64_t at, absl::string_view b) {
    std::memcpy(out + (at - offset), b.data(), b.size());
  });
}

void SsdTier::CountRangedRead() {
  absl::MutexLock lock(&mu_);
  ++counters_.hits;
}

absl::Status SsdTier::DropCorrupt(const ChunkId& id, const ChunkMeta& meta) {
  PayloadExtent extent;
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end() || !(it->second.meta == meta)) {
      // Another reader dropped the copy just now: the same verdict. Otherwise the copy
      // stored is not the one the caller read (a put replaced it, with other bytes):
      // it stays.
      if (DroppedCorruptLocked(id, std::nullopt)) return CorruptChunkError(id);
      return StoredAfreshError(id);
    }
    extent = it->second.extent;
  }
  return Corrupt(id, "", extent);
}

bool SsdTier::Contains(const ChunkId& id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  return it != index_.end() && !HiddenLocked(it->second);
}

std::vector<bool> SsdTier::ContainsMany(absl::Span<const ChunkId> ids) const {
  std::vector<bool> present(ids.size(), false);
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = index_.find(ids[i]);
    present[i] = it != index_.end() && !HiddenLocked(it->second);
  }
  return present;
}

std::vector<ChunkId> SsdTier::Restore(std::vector<std::pair<ChunkId, IndexEntry>> entries) {
  std::vector<PayloadExtent> dead;
  std::vector<ChunkId> restored;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, e] : entries) {
      if (index_.contains(id)) {
        dead.push_back(e.extent);
        continue;
      }
      InsertLocked(id, std::move(e));
      restored.push_back(id);
    }
  }
  for (const PayloadExtent& extent : dead) log_->Release(extent);
  return restored;
}

void SsdTier::AwaitUnrowedLocked(const ChunkId& id) {
  if (!unrowing_.contains(id)) return;
  if (options_.delete_waits_for_row_delete) {
    mu_.Unlock();
    options_.delete_waits_for_row_delete(id);
    mu_.Lock();
  }
  struct Waiting {
    const absl::flat_hash_map<ChunkId, uint32_t>* unrowing;
    const ChunkId* id;
  } waiting{&unrowing_, &id};
  mu_.Await(absl::Condition(
      +[](Waiting* w) { return !w->unrowing->contains(*w->id); }, &waiting));
}

void SsdTier::AwaitNamespaceUnrowedLocked(uint64_t ns) {
  if (options_.delete_waits_for_row_delete) {
    std::optional<ChunkId> unrowing;
    for (const auto& [id, n] : unrowing_) {
      if (id.ns == ns) unrowing = id;
    }
    if (unrowing) {
      mu_.Unlock();
      options_.delete_waits_for_row_delete(*unrowing);
      mu_.Lock();
    }
  }
  struct Waiting {
    const absl::flat_hash_map<ChunkId, uint32_t>* unrowing;
    uint64_t ns;
  } waiting{&unrowing_, ns};
  mu_.Await(absl::Condition(
      +[](Waiting* w) {
        for (const auto& [id, n] : *w->unrowing) {
          if (id.ns == w->ns) return false;
        }
        return true;
      },
      &waiting));
}

absl::Status SsdTier::DeleteChunk(const ChunkId& id) {
  std::optional<IndexEntry> e;
  {
    absl::MutexLock lock(&mu_);
    AwaitUnrowedLocked(id);
    e = ForgetLocked(id);
    // Gone already (and its row with it: the wait above). Deleting the row here too
    // could land after a put of the chunk stored afresh, and delete that put's row.
    if (!e) return absl::OkStatus();
    BeginUnrowLocked(id);
  }
  return DeleteRow(id, *std::move(e));
}

absl::StatusOr<bool> SsdTier::DeleteIfStill(const ChunkId& id, const PayloadExtent& extent) {
  std::optional<IndexEntry> e;
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end() || !(it->second.extent == extent)) return false;
    e = ForgetLocked(id);
    BeginUnrowLocked(id);
  }
  if (absl::Status s = DeleteRow(id, *std::move(e)); !s.ok()) return s;
  return true;
}

void SsdTier::BeginUnrowLocked(const ChunkId& id) { ++unrowing_[id]; }

void SsdTier::BeforeRowDelete(absl::Span<const ChunkId> ids) {
  if (!options_.before_row_delete) return;
  for (const ChunkId& id : ids) options_.before_row_delete(id);
}

void SsdTier::EndUnrow(absl::Span<const ChunkId> ids) {
  absl::MutexLock lock(&mu_);
  for (const ChunkId& id : ids) {
    auto it = unrowing_.find(id);
    if (it != unrowing_.end() && --it->second == 0) unrowing_.erase(it);
  }
}

absl::Status SsdTier::DeleteRow(const ChunkId& id, IndexEntry e) {
  BeforeRowDelete({&id, 1});
  // Synced as puts are: its bytes are freed next, and a delete the client saw complete
  // must not be undone by a power cut.
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  rocksdb::Status s = db_->Write(wo, [&](auto& batch, const auto& f) {
    batch.Delete(f.meta, SsdRowKey(id));
  });
  if (!s.ok()) {
    // The row is still there, and a restart would bring the chunk back: it stays in the
    // index too, so that a retried delete finds it instead of reporting it gone.
    std::vector<std::pair<ChunkId, IndexEntry>> back;
    back.emplace_back(id, std::move(e));
    Restore(std::move(back));
    EndUnrow({&id, 1});
    return MapWriteError(s, "deleting a chunk");
  }
  // Freed only now: until the row is gone, a restart would still look for the bytes.
  log_->Release(e.extent);
  EndUnrow({&id, 1});
  return absl::OkStatus();
}

absl::StatusOr<bool> SsdTier::Delete(const ChunkId& id) {
  bool present;
  {
    absl::MutexLock lock(&mu_);
    AwaitUnrowedLocked(id);
    present = index_.contains(id);
  }
  if (!present) return false;
  if (absl::Status s = DeleteChunk(id); !s.ok()) return s;
  return true;
}

uint64_t SsdTier::NamespaceQuotaBytes(const absl::flat_hash_set<uint64_t>& ns) const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (uint64_t n : ns) {
    if (auto it = ns_bytes_.find(n); it != ns_bytes_.end()) bytes += it->second;
  }
  return bytes;
}

absl::StatusOr<uint64_t> SsdTier::ShrinkNamespaces(const absl::flat_hash_set<uint64_t>& ns,
                                                   uint64_t keep) {
  std::vector<std::pair<ChunkId, IndexEntry>> gone;
  uint64_t held = 0;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t n : ns) {
      if (auto it = ns_bytes_.find(n); it != ns_bytes_.end()) held += it->second;
    }
    while (held > keep) {
      auto victim = policy_->PickVictim([&](const ChunkId& c) {
        mu_.AssertHeld();
        return ns.contains(c.ns) && index_.contains(c) && !putting_.contains(c);
      });
      if (!victim) break;
      IndexEntry e = *ForgetLocked(*victim);
      BeginUnrowLocked(*victim);
      held -= e.meta.size;
      gone.emplace_back(*victim, std::move(e));
      ++counters_.evictions;
    }
  }
  if (gone.empty()) return held;
  if (absl::Status s = DeleteEvictedRows(std::move(gone), "evicting chunks over a tenant's "
                                                          "ssd_quota");
      !s.ok()) {
    return s;
  }
  return held;
}

absl::Status SsdTier::DeleteEvictedRows(std::vector<std::pair<ChunkId, IndexEntry>> gone,
                                        absl::string_view what) {
  std::vector<ChunkId> ids;
  for (const auto& [id, e] : gone) ids.push_back(id);
  BeforeRowDelete(ids);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  rocksdb::Status s = db_->Write(wo, [&](auto& batch, const auto& f) {
    for (const auto& [id, e] : gone) batch.Delete(f.meta, SsdRowKey(id));
  });
  if (!s.ok()) {
    // The rows are still there: the chunks stay, back in the index.
    const size_t restored = Restore(std::move(gone)).size();
    EndUnrow(ids);
    absl::MutexLock lock(&mu_);
    counters_.evictions -= restored;
    return MapWriteError(s, what);
  }
  for (const auto& [id, e] : gone) log_->Release(e.extent);
  EndUnrow(ids);
  for (const ChunkId& id : ids) {
    if (options_.on_evict) options_.on_evict(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> SsdTier::EvictLeastLiveFile() {
  const std::optional<uint32_t> file = log_->SealLeastLive();
  if (!file) return false;
  std::vector<std::pair<ChunkId, IndexEntry>> gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_file_.find(*file);
    if (it == by_file_.end()) return false;
    const std::vector<ChunkId> ids(it->second.begin(), it->second.end());
    for (const ChunkId& id : ids) {
      gone.emplace_back(id, *ForgetLocked(id));
      BeginUnrowLocked(id);
      ++counters_.evictions;
    }
  }
  if (gone.empty()) return false;
  if (absl::Status s = DeleteEvictedRows(std::move(gone), "evicting chunks from a full disk");
      !s.ok()) {
    return s;
  }
  return true;
}

absl::StatusOr<uint64_t> SsdTier::DeleteNamespace(uint64_t ns, std::vector<ChunkId>* removed) {
  std::vector<std::pair<ChunkId, IndexEntry>> gone;
  {
    absl::MutexLock lock(&mu_);
    AwaitNamespaceUnrowedLocked(ns);  // As AwaitUnrowedLocked, for each of its chunks.
    std::vector<ChunkId> ids;
    for (const auto& [id, e] : index_) {
      if (id.ns == ns) ids.push_back(id);
    }
    for (const ChunkId& id : ids) {
      gone.emplace_back(id, *ForgetLocked(id));
      BeginUnrowLocked(id);
    }
  }
  std::vector<ChunkId> ids;
  for (const auto& [id, e] : gone) ids.push_back(id);
  BeforeRowDelete(ids);
  if (!gone.empty()) {
    rocksdb::WriteOptions wo;
    wo.sync = options_.sync_writes;  // As DeleteRow.
    rocksdb::Status s = db_->Write(wo, [&](auto& batch, const auto& f) {
      for (const auto& [id, e] : gone) batch.Delete(f.meta, SsdRowKey(id));
    });
    if (!s.ok()) {
      Restore(std::move(gone));  // Their rows are still there; so are they.
      EndUnrow(ids);
      return MapWriteError(s, "clearing a namespace");
    }
  }
  for (const auto& [id, e] : gone) log_->Release(e.extent);
  EndUnrow(ids);
  if (removed != nullptr) removed->insert(removed->end(), ids.begin(), ids.end());
  return gone.size();
}

uint64_t SsdTier::ExpireOld() {
  log_->RetryDeletes();  // Files whose deletion failed (a release will not try again).
  struct Hidden {
    ChunkId id;
    PayloadExtent extent;
    bool corrupt;
  };
  std::vector<Hidden> hidden;
  {
    absl::MutexLock lock(&mu_);
    if (options_.ttl <= absl::ZeroDuration() && corrupt_entries_ == 0) return 0;
    for (const auto& [id, e] : index_) {
      if (HiddenLocked(e)) hidden.push_back({id, e.extent, e.corrupt});
    }
  }
  uint64_t expired = 0;
  for (const Hidden& h : hidden) {
    // Only the copy found hidden: a put may have stored the chunk afresh since.
    absl::StatusOr<bool> gone = DeleteIfStill(h.id, h.extent);
    if (!gone.ok()) {
      LogWarning("SSD tier: TTL sweep: ", gone.status().message());
      break;
    }
    if (!*gone || h.corrupt) continue;  // A corrupt copy's event went out when found.
    ++expired;
    if (options_.on_evict) options_.on_evict(h.id);
  }
  CountExpired(expired);
  return expired;
}

absl::Status SsdTier::SaveLayout(uint64_t ns, absl::string_view encoding) {
  rocksdb::WriteOptions wo;
  wo.sync = true;  // Rare and small; a namespace must not vanish under its chunks.
  rocksdb::Status s = db_->Write(wo, [&](auto& batch, const auto& f) {
    batch.Put(f.layouts, SsdLayoutKey(ns), AsSlice(encoding));
  });
  if (!s.ok()) return MapWriteError(s, "saving a layout");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<uint64_t, std::string>>> SsdTier::LoadLayouts() const {
  std::vector<std::pair<uint64_t, std::string>> out;
  rocksdb::Status s = db_->Scan(
      /*layouts=*/true, [&](const rocksdb::Slice& k, const rocksdb::Slice& v) {
        uint64_t ns;
        if (ParseSsdLayoutKey(absl::string_view(k.data(), k.size()), &ns)) {
          out.emplace_back(ns, v.ToString());
        }
        return true;
      });
  if (!s.ok()) return Unavailable("loading layouts", s);
  return out;
}

void SsdTier::Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
                    WriteDone done) {
  if (absl::Status s = CheckChunkBytes(Tier::kSsd, id, meta, bytes); !s.ok()) return done(s);
  done(Put(id, meta, bytes.pieces));
}

void SsdTier::Read(const ChunkId& id, SinkFor sink_for, ReadDone done) {
  absl::StatusOr<ChunkMeta> meta = ReadMeta(id);
  if (!meta.ok()) return done(meta.status());
  ChunkSink* sink = sink_for(*meta);
  if (sink == nullptr) {
    return done(NoSinkError());
  }
  if (absl::Status s = ReadPayload(id, *meta, *sink); !s.ok()) return done(s);
  done(*std::move(meta));
}

TierStats SsdTier::Stats() const {
  const SsdTierStats s = GetStats();
  TierStats t;
  t.tier = Tier::kSsd;
  t.capacity_bytes = s.capacity_bytes;
  t.used_bytes = s.used_bytes;
  t.payload_bytes = s.payload_bytes;
  t.chunks = s.chunks;
  t.hits = s.hits;
  t.misses = s.misses;
  t.evictions = s.evictions;
  t.expirations = s.expirations;
  return t;
}

SsdTierStats SsdTier::GetStats() const {
  const PayloadLogStats log = log_->GetStats();
  absl::MutexLock lock(&mu_);
  SsdTierStats s = counters_;
  s.capacity_bytes = options_.capacity_bytes;
  s.limit_bytes = limit_bytes_;
  s.used_bytes = used_bytes_;
  s.payload_bytes = payload_bytes_;
  s.disk_bytes = log.disk_bytes;
  s.bytes_written = log.bytes_written;
  s.direct_io = log.direct_io;
  s.chunks = index_.size();
  return s;
}

absl::Status SsdTier::Flush() {
  if (absl::Status s = log_->SyncAll(); !s.ok()) return s;
  rocksdb::Status s = db_->Flush();
  if (!s.ok()) return Unavailable("flushing memtables", s);
  return absl::OkStatus();
}

}  // namespace kvtier
