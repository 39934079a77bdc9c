#include "storage/ssd_tier.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rocksdb/env.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/write_batch.h"
#include "storage/crc32c.h"
#include "storage/log.h"

namespace kvtier {
namespace {

constexpr uint32_t kMetaVersion = 1;
constexpr size_t kMetaBytes = 32;
constexpr size_t kRowKeyBytes = 8 + ChunkKey::kWireBytes;

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(absl::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  return v;
}

// Meta row: le64 size, le32 crc32c, le32 token_count, le32 codec, le64 written_at (unix
// micros), le32 version.
std::string EncodeMeta(const ChunkMeta& m, absl::Time written_at) {
  std::string out;
  out.reserve(kMetaBytes);
  PutLe(out, m.size, 8);
  PutLe(out, m.crc32c, 4);
  PutLe(out, m.token_count, 4);
  PutLe(out, m.codec, 4);
  PutLe(out, static_cast<uint64_t>(absl::ToUnixMicros(written_at)), 8);
  PutLe(out, kMetaVersion, 4);
  return out;
}

bool DecodeMeta(absl::string_view in, ChunkMeta& m, absl::Time& written_at) {
  if (in.size() != kMetaBytes || GetLe(in, 28, 4) != kMetaVersion) return false;
  m.size = GetLe(in, 0, 8);
  m.crc32c = static_cast<uint32_t>(GetLe(in, 8, 4));
  m.token_count = static_cast<uint32_t>(GetLe(in, 12, 4));
  m.codec = static_cast<uint32_t>(GetLe(in, 16, 4));
  written_at = absl::FromUnixMicros(static_cast<int64_t>(GetLe(in, 20, 8)));
  return true;
}

std::string Be64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * (7 - i))) & 0xff);
  return out;
}
uint64_t GetBe64(absl::string_view in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(in[i]);
  return v;
}

bool ParseRowKey(absl::string_view row, ChunkId& id) {
  if (row.size() != kRowKeyBytes) return false;
  id.ns = GetBe64(row);
  auto key = ChunkKey::FromBytes(row.substr(8));
  if (!key.ok()) return false;
  id.key = *key;
  return true;
}

absl::Status Unavailable(absl::string_view what, const rocksdb::Status& s) {
  return absl::UnavailableError(absl::StrCat("SSD tier: ", what, ": ", s.ToString()));
}

}  // namespace

std::string SsdRowKey(const ChunkId& id) { return Be64(id.ns) + id.key.ToByteString(); }

namespace {

std::string SegmentKey(const std::string& row, uint32_t segment) {
  std::string key = row;
  for (int i = 3; i >= 0; --i) key.push_back(static_cast<char>((segment >> (8 * i)) & 0xff));
  return key;
}

}  // namespace

uint32_t SsdTier::SegmentCount(uint64_t size) const {
  return static_cast<uint32_t>((size + options_.segment_bytes - 1) / options_.segment_bytes);
}

void SsdTier::AddDeletes(rocksdb::WriteBatch& batch, const std::string& row,
                         uint64_t size) const {
  batch.Delete(meta_cf_, row);
  if (size == 0) {
    batch.DeleteRange(data_cf_, SegmentKey(row, 0), row + std::string(5, '\xff'));
    return;
  }
  for (uint32_t i = 0, n = SegmentCount(size); i < n; ++i) {
    batch.Delete(data_cf_, SegmentKey(row, i));
  }
}

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
  if (segment_bytes < (64ull << 10)) {
    return absl::InvalidArgumentError("ssd segment_bytes must be at least 64 KiB");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(SsdTierOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;

  std::unique_ptr<rocksdb::Env> env;
  rocksdb::DBOptions db_options;
  if (options.file_system) {
    env = rocksdb::NewCompositeEnv(options.file_system);
    db_options.env = env.get();
  }
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.db_write_buffer_size = options.write_buffer_bytes;
  db_options.max_background_jobs = 2;
  db_options.keep_log_file_num = 3;
  db_options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  db_options.use_fsync = false;

  rocksdb::ColumnFamilyOptions small;
  small.compression = rocksdb::kNoCompression;
  small.write_buffer_size = 4ull << 20;

  // KV tensors are high-entropy floats: compression costs CPU and saves little.
  rocksdb::ColumnFamilyOptions data;
  data.compression = rocksdb::kNoCompression;
  data.enable_blob_files = true;
  data.min_blob_size = options.blob_min_bytes;
  data.blob_file_size = 256ull << 20;
  data.blob_compression_type = rocksdb::kNoCompression;
  data.enable_blob_garbage_collection = true;
  data.blob_garbage_collection_age_cutoff = 0.25;
  data.write_buffer_size = options.write_buffer_bytes / 2;
  data.max_write_buffer_number = 2;

  std::vector<rocksdb::ColumnFamilyDescriptor> families = {
      {rocksdb::kDefaultColumnFamilyName, small},
      {"meta", small},
      {"data", data},
      {"layouts", small},
      {"pending", small},
  };
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.path, families, &handles, &raw);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("data_dir: cannot open RocksDB at ", options.path, ": ", s.ToString()));
  }
  std::unique_ptr<SsdTier> tier(new SsdTier(std::move(options), std::move(env),
                                            std::unique_ptr<rocksdb::DB>(raw),
                                            std::move(handles)));
  if (absl::Status r = tier->RebuildIndex(); !r.ok()) return r;
  return tier;
}

SsdTier::SsdTier(SsdTierOptions options, std::unique_ptr<rocksdb::Env> env,
                 std::unique_ptr<rocksdb::DB> db,
                 std::vector<rocksdb::ColumnFamilyHandle*> handles)
    : options_(std::move(options)),
      env_(std::move(env)),
      db_(std::move(db)),
      handles_(std::move(handles)),
      meta_cf_(handles_[1]),
      data_cf_(handles_[2]),
      layouts_cf_(handles_[3]),
      pending_cf_(handles_[4]),
      readers_(std::make_unique<IoPool>(options_.read_threads)) {}

SsdTier::~SsdTier() {
  readers_.reset();  // No read may run past the handles.
  for (auto* h : handles_) {
    // Destroying a handle only fails for a null handle; nothing to do about it here.
    db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  }
  rocksdb::Status s = db_->Close();
  if (!s.ok()) LogWarning("SSD tier: closing RocksDB: ", s.ToString());
}

absl::Status SsdTier::RebuildIndex() {
  struct Found {
    ChunkId id;
    IndexEntry entry;
  };
  std::vector<Found> found;
  std::vector<std::string> bad_rows;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta_cf_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    ChunkId id;
    ChunkMeta meta;
    absl::Time written_at;
    if (!ParseRowKey(absl::string_view(it->key().data(), it->key().size()), id) ||
        !DecodeMeta(absl::string_view(it->value().data(), it->value().size()), meta, written_at)) {
      bad_rows.push_back(it->key().ToString());
      continue;
    }
    found.push_back({id, {meta.size, written_at}});
  }
  if (!it->status().ok()) return Unavailable("scanning the index at start-up", it->status());
  it.reset();

  // Oldest first, so the least recently written chunks sit at the LRU's cold end.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.entry.written_at < b.entry.written_at;
  });
  std::vector<std::pair<ChunkId, uint64_t>> drop;  // With their sizes.
  uint64_t expired = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const Found& f : found) {
      if (ExpiredLocked(f.entry)) {
        drop.emplace_back(f.id, f.entry.size);
        ++expired;
        continue;
      }
      index_[f.id] = f.entry;
      lru_.OnInsert(f.id);
      used_bytes_ += f.entry.size;
    }
    // A smaller capacity than last run: drop the oldest until it fits.
    while (used_bytes_ > options_.capacity_bytes) {
      auto victim = lru_.PickVictim([](const ChunkId&) { return true; });
      drop.emplace_back(*victim, index_[*victim].size);
      ForgetLocked(*victim);
      ++counters_.evictions;
    }
  }
  rocksdb::WriteBatch batch;
  for (const std::string& row : bad_rows) AddDeletes(batch, row, 0);
  for (const auto& [id, size] : drop) AddDeletes(batch, SsdRowKey(id), size);
  // Puts cut off by a crash: their segments may be on disk, their meta row is not.
  uint64_t abandoned = 0;
  std::unique_ptr<rocksdb::Iterator> pit(db_->NewIterator(rocksdb::ReadOptions(), pending_cf_));
  for (pit->SeekToFirst(); pit->Valid(); pit->Next()) {
    const std::string row = pit->key().ToString();
    const uint64_t size =
        pit->value().size() == 8 ? GetLe(absl::string_view(pit->value().data(), 8), 0, 8) : 0;
    ChunkId id;
    const bool committed = ParseRowKey(row, id) && [&] {
      absl::MutexLock lock(&mu_);
      return index_.contains(id);
    }();
    if (!committed) {
      AddDeletes(batch, row, size);
      ++abandoned;
    }
    batch.Delete(pending_cf_, row);
  }
  if (!pit->status().ok()) return Unavailable("scanning pending puts at start-up", pit->status());
  pit.reset();
  if (abandoned > 0) {
    LogWarning("SSD tier: removed ", abandoned, " chunks whose put was cut off by a crash");
  }
  if (batch.Count() > 0) {
    rocksdb::Status s = db_->Write(rocksdb::WriteOptions(), &batch);
    if (!s.ok()) return Unavailable("dropping stale rows at start-up", s);
  }
  absl::MutexLock lock(&mu_);
  counters_.expirations += expired;
  if (!bad_rows.empty()) {
    LogWarning("SSD tier: dropped ", bad_rows.size(), " unreadable index rows at start-up");
  }
  LogInfo("SSD tier: recovered ", index_.size(), " chunks (", used_bytes_,
          " bytes) from ", options_.path, "; dropped ", expired, " expired and ",
          drop.size() - expired, " over capacity");
  return absl::OkStatus();
}

bool SsdTier::ExpiredLocked(const IndexEntry& e) const {
  return options_.ttl > absl::ZeroDuration() && e.written_at + options_.ttl <= options_.now();
}

void SsdTier::ForgetLocked(const ChunkId& id) {
  auto it = index_.find(id);
  if (it == index_.end()) return;
  used_bytes_ -= it->second.size;
  lru_.OnRemove(id);
  index_.erase(it);
}

absl::Status SsdTier::MapWriteError(const rocksdb::Status& s, absl::string_view what) {
  {
    absl::MutexLock lock(&mu_);
    ++counters_.write_errors;
  }
  // A failed write can leave RocksDB in a background-error state that refuses every
  // later write. Resume() clears it once the cause is gone; while the disk is still
  // full it fails and the next write tries again.
  db_->Resume().PermitUncheckedError();
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

absl::Status SsdTier::Put(const ChunkId& id, const ChunkMeta& meta,
                          absl::Span<const absl::string_view> parts) {
  std::vector<std::pair<ChunkId, IndexEntry>> victims;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = index_.find(id); it != index_.end()) {
      if (!ExpiredLocked(it->second)) return absl::OkStatus();
      // Past its TTL but not swept yet: this put replaces it (the batch below
      // overwrites both rows), so the chunk is stored afresh rather than acknowledged
      // and then hidden as expired.
      ForgetLocked(id);
      ++counters_.expirations;
    }
    if (meta.size > options_.capacity_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk of ", meta.size, " bytes exceeds ssd_capacity (", options_.capacity_bytes,
          ")"));
    }
    while (used_bytes_ + reserved_bytes_ + meta.size > options_.capacity_bytes) {
      auto victim = lru_.PickVictim([](const ChunkId&) { return true; });
      if (!victim) break;  // The rest is reserved by puts in flight; let RocksDB decide.
      victims.emplace_back(*victim, index_[*victim]);
      ForgetLocked(*victim);
      ++counters_.evictions;
    }
    reserved_bytes_ += meta.size;
  }
  // One chunk write at a time: RocksDB queues concurrent writers behind one WAL anyway,
  // so letting N writers build their batches at once only multiplies memory outside the
  // RAM pool by N.
  absl::MutexLock write_lock(&write_mu_);
  const std::string row = SsdRowKey(id);
  const absl::Time now = options_.now();
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;

  // Step 1: evictions and the pending marker, atomically.
  rocksdb::WriteBatch start_batch;
  for (const auto& [v, e] : victims) AddDeletes(start_batch, SsdRowKey(v), e.size);
  std::string size_le;
  PutLe(size_le, meta.size, 8);
  start_batch.Put(pending_cf_, row, size_le);
  rocksdb::Status s = db_->Write(wo, &start_batch);
  const bool victims_gone = s.ok();

  // Step 2: the segments. A segment's bytes may span several of `parts`.
  size_t part = 0, part_off = 0;
  std::vector<rocksdb::Slice> slices;
  for (uint32_t seg = 0, n = SegmentCount(meta.size); s.ok() && seg < n; ++seg) {
    uint64_t want = std::min<uint64_t>(options_.segment_bytes,
                                       meta.size - uint64_t{seg} * options_.segment_bytes);
    slices.clear();
    while (want > 0 && part < parts.size()) {
      const uint64_t take = std::min<uint64_t>(want, parts[part].size() - part_off);
      slices.emplace_back(parts[part].data() + part_off, take);
      want -= take;
      part_off += take;
      if (part_off == parts[part].size()) {
        ++part;
        part_off = 0;
      }
    }
    if (want > 0) {
      s = rocksdb::Status::InvalidArgument("payload parts shorter than meta.size");
      break;
    }
    const std::string seg_key = SegmentKey(row, seg);
    rocksdb::Slice key_slice(seg_key);
    rocksdb::WriteBatch seg_batch;
    seg_batch.Put(data_cf_, rocksdb::SliceParts(&key_slice, 1),
                  rocksdb::SliceParts(slices.data(), static_cast<int>(slices.size())));
    s = db_->Write(rocksdb::WriteOptions(), &seg_batch);
  }

  // Step 3: the commit record.
  if (s.ok()) {
    rocksdb::WriteBatch commit;
    commit.Put(meta_cf_, row, EncodeMeta(meta, now));
    commit.Delete(pending_cf_, row);
    s = db_->Write(wo, &commit);
  }
  if (!s.ok() && victims_gone) {
    // Best effort; whatever is left stays marked pending and is removed at start-up.
    rocksdb::WriteBatch undo;
    AddDeletes(undo, row, meta.size);
    undo.Delete(pending_cf_, row);
    db_->Write(rocksdb::WriteOptions(), &undo).PermitUncheckedError();
  }
  {
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= meta.size;
    if (s.ok() && !index_.contains(id)) {
      index_[id] = IndexEntry{meta.size, now};
      lru_.OnInsert(id);
      used_bytes_ += meta.size;
    }
    if (!victims_gone) {
      // Step 1 was not applied, so the victims' rows are still there: put them back
      // in the index rather than lose them to a put that stored nothing. (They return
      // as most recently used; the LRU has no way to insert at the cold end.)
      for (const auto& [v, e] : victims) {
        if (index_.contains(v)) continue;  // Stored again meanwhile.
        index_[v] = e;
        lru_.OnInsert(v);
        used_bytes_ += e.size;
        --counters_.evictions;
      }
    }
  }
  if (!s.ok()) return MapWriteError(s, "writing a chunk");
  return absl::OkStatus();
}

void StringSink::Write(uint64_t offset, absl::string_view bytes) {
  std::memcpy(out_->data() + offset, bytes.data(), bytes.size());
}

uint32_t StringSink::Crc32c() const { return crc32c::Value(*out_); }

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

absl::Status SsdTier::Corrupt(const ChunkId& id, const rocksdb::Status& cause) {
  {
    absl::MutexLock lock(&mu_);
    ++counters_.checksum_failures;
  }
  LogWarning("SSD tier: chunk ", id.DebugString(), " failed its checksum and was deleted",
             cause.ok() ? "" : absl::StrCat(" (", cause.ToString(), ")"));
  if (absl::Status d = DeleteChunk(id); !d.ok()) {
    LogError("SSD tier: could not delete corrupt chunk ", id.DebugString(), ": ", d.message());
  }
  return absl::DataLossError(absl::StrCat(
      "chunk ", id.key.ToHex(), " failed its CRC32C check on the SSD tier and was "
      "deleted; recompute it"));
}

absl::StatusOr<ChunkMeta> SsdTier::ReadMeta(const ChunkId& id) {
  bool expired = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end()) {
      ++counters_.misses;
      return absl::NotFoundError("chunk not on SSD");
    }
    if (ExpiredLocked(it->second)) {
      expired = true;
      ++counters_.misses;
      ++counters_.expirations;  // DeleteChunk below forgets it (and knows its size).
    } else {
      lru_.OnAccess(id);
    }
  }
  if (expired) {
    if (absl::Status s = DeleteChunk(id); !s.ok()) return s;
    return absl::NotFoundError("chunk on SSD expired (ssd_ttl)");
  }
  std::string meta_bytes;
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  rocksdb::Status s = db_->Get(ro, meta_cf_, SsdRowKey(id), &meta_bytes);
  if (s.IsNotFound()) {
    absl::MutexLock lock(&mu_);
    ForgetLocked(id);
    ++counters_.misses;
    return absl::NotFoundError("chunk not on SSD");
  }
  if (!s.ok() && !s.IsCorruption()) return Unavailable("reading a chunk's meta", s);
  ChunkMeta meta;
  absl::Time written_at;
  if (!s.ok() || !DecodeMeta(meta_bytes, meta, written_at)) return Corrupt(id, s);
  return meta;
}

absl::Status SsdTier::ReadPayload(const ChunkId& id, const ChunkMeta& meta, ChunkSink& sink) {
  const std::string row = SsdRowKey(id);
  const uint32_t n = SegmentCount(meta.size);
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  // One segment per task; the first failure wins. A segment of the wrong size is as bad
  // as a bad byte.
  absl::Mutex mu;
  uint32_t pending = n;
  rocksdb::Status first_error;
  auto read_one = [&](uint32_t seg) {
    rocksdb::PinnableSlice value;
    rocksdb::Status st = db_->Get(ro, data_cf_, SegmentKey(row, seg), &value);
    const uint64_t offset = uint64_t{seg} * options_.segment_bytes;
    const uint64_t want = std::min<uint64_t>(options_.segment_bytes, meta.size - offset);
    if (st.ok() && value.size() != want) st = rocksdb::Status::Corruption("segment size");
    if (st.ok()) sink.Write(offset, absl::string_view(value.data(), value.size()));
    absl::MutexLock lock(&mu);
    if (!st.ok() && first_error.ok()) first_error = st;
    --pending;
  };
  if (n == 1) {
    read_one(0);
  } else {
    for (uint32_t seg = 0; seg < n; ++seg) readers_->Submit([&read_one, seg] { read_one(seg); });
    absl::MutexLock lock(&mu);
    auto all_done = [&pending]() { return pending == 0; };
    mu.Await(absl::Condition(&all_done));
  }
  if (first_error.IsNotFound()) {
    // Deleted while we read it, or a committed chunk with a segment missing.
    std::string ignored;
    if (db_->Get(ro, meta_cf_, row, &ignored).IsNotFound()) {
      absl::MutexLock lock(&mu_);
      ForgetLocked(id);
      ++counters_.misses;
      return absl::NotFoundError("chunk not on SSD");
    }
    return Corrupt(id, first_error);
  }
  if (!first_error.ok() && !first_error.IsCorruption()) {
    return Unavailable("reading a chunk", first_error);
  }
  if (!first_error.ok() || sink.Crc32c() != meta.crc32c) return Corrupt(id, first_error);
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
  const std::string row = SsdRowKey(id);
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  rocksdb::Status st;
  for (uint64_t at = offset; at < offset + len && st.ok();) {
    const uint32_t seg = static_cast<uint32_t>(at / options_.segment_bytes);
    const uint64_t seg_begin = uint64_t{seg} * options_.segment_bytes;
    const uint64_t want = std::min<uint64_t>(options_.segment_bytes, meta.size - seg_begin);
    rocksdb::PinnableSlice value;
    st = db_->Get(ro, data_cf_, SegmentKey(row, seg), &value);
    if (st.ok() && value.size() != want) st = rocksdb::Status::Corruption("segment size");
    if (!st.ok()) break;
    const uint64_t n = std::min(offset + len, seg_begin + want) - at;
    std::memcpy(out + (at - offset), value.data() + (at - seg_begin), n);
    at += n;
  }
  if (st.IsNotFound()) {
    std::string ignored;
    if (db_->Get(ro, meta_cf_, row, &ignored).IsNotFound()) {
      absl::MutexLock lock(&mu_);
      ForgetLocked(id);
      return absl::NotFoundError("chunk not on SSD (deleted while being read)");
    }
    return Corrupt(id, st);
  }
  if (!st.ok() && !st.IsCorruption()) return Unavailable("reading a chunk", st);
  if (!st.ok()) return Corrupt(id, st);
  return absl::OkStatus();
}

void SsdTier::CountRangedRead() {
  absl::MutexLock lock(&mu_);
  ++counters_.hits;
}

absl::Status SsdTier::DropCorrupt(const ChunkId& id) {
  return Corrupt(id, rocksdb::Status::OK());
}

bool SsdTier::Contains(const ChunkId& id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  return it != index_.end() && !ExpiredLocked(it->second);
}

absl::Status SsdTier::DeleteChunk(const ChunkId& id) {
  uint64_t size = 0;  // Unknown if no longer indexed: every segment goes.
  {
    absl::MutexLock lock(&mu_);
    if (auto it = index_.find(id); it != index_.end()) size = it->second.size;
    ForgetLocked(id);
  }
  rocksdb::WriteBatch batch;
  AddDeletes(batch, SsdRowKey(id), size);
  rocksdb::Status s = db_->Write(rocksdb::WriteOptions(), &batch);
  if (!s.ok()) return MapWriteError(s, "deleting a chunk");
  return absl::OkStatus();
}

absl::StatusOr<bool> SsdTier::Delete(const ChunkId& id) {
  bool present;
  {
    absl::MutexLock lock(&mu_);
    present = index_.contains(id);
  }
  if (!present) return false;
  if (absl::Status s = DeleteChunk(id); !s.ok()) return s;
  return true;
}

absl::StatusOr<uint64_t> SsdTier::DeleteNamespace(uint64_t ns) {
  std::vector<std::pair<ChunkId, uint64_t>> ids;  // With their sizes.
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, e] : index_) {
      if (id.ns == ns) ids.emplace_back(id, e.size);
    }
    for (const auto& [id, _] : ids) ForgetLocked(id);
  }
  rocksdb::WriteBatch batch;
  for (const auto& [id, size] : ids) AddDeletes(batch, SsdRowKey(id), size);
  if (batch.Count() > 0) {
    rocksdb::Status s = db_->Write(rocksdb::WriteOptions(), &batch);
    if (!s.ok()) return MapWriteError(s, "clearing a namespace");
  }
  return ids.size();
}

uint64_t SsdTier::ExpireOld() {
  if (options_.ttl <= absl::ZeroDuration()) return 0;
  std::vector<ChunkId> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, e] : index_) {
      if (ExpiredLocked(e)) ids.push_back(id);
    }
    counters_.expirations += ids.size();
  }
  for (const ChunkId& id : ids) {
    if (absl::Status s = DeleteChunk(id); !s.ok()) {
      LogWarning("SSD tier: TTL sweep: ", s.message());
      break;
    }
  }
  return ids.size();
}

absl::Status SsdTier::SaveLayout(uint64_t ns, absl::string_view encoding) {
  rocksdb::WriteOptions wo;
  wo.sync = true;  // Rare and small; a namespace must not vanish under its chunks.
  rocksdb::Status s = db_->Put(wo, layouts_cf_, Be64(ns), rocksdb::Slice(encoding.data(), encoding.size()));
  if (!s.ok()) return MapWriteError(s, "saving a layout");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<uint64_t, std::string>>> SsdTier::LoadLayouts() const {
  std::vector<std::pair<uint64_t, std::string>> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), layouts_cf_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (it->key().size() != 8) continue;
    out.emplace_back(GetBe64(absl::string_view(it->key().data(), it->key().size())), it->value().ToString());
  }
  if (!it->status().ok()) return Unavailable("loading layouts", it->status());
  return out;
}

SsdTierStats SsdTier::GetStats() const {
  absl::MutexLock lock(&mu_);
  SsdTierStats s = counters_;
  s.capacity_bytes = options_.capacity_bytes;
  s.used_bytes = used_bytes_;
  s.chunks = index_.size();
  return s;
}

absl::Status SsdTier::Flush() {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  rocksdb::Status s = db_->Flush(fo, handles_);
  if (!s.ok()) return Unavailable("flushing memtables", s);
  return absl::OkStatus();
}

}  // namespace kvtier
