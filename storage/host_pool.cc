#include "storage/host_pool.h"

#include <algorithm>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status HostPoolOptions::Validate() const {
  if (absl::Status s = arena.Validate(); !s.ok()) return s;
  if (!(max_pinned_fraction > 0.0 && max_pinned_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_pinned_fraction must be in (0, 1], got ", max_pinned_fraction));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostPool>> HostPool::Create(
    HostPoolOptions options, std::unique_ptr<EvictionPolicy> policy) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto arena = SlotArena::Create(options.arena);
  if (!arena.ok()) return arena.status();
  return std::unique_ptr<HostPool>(
      new HostPool(std::move(options), *std::move(arena), std::move(policy)));
}

HostPool::HostPool(HostPoolOptions options, std::unique_ptr<SlotArena> arena,
                   std::unique_ptr<EvictionPolicy> policy)
    : options_(std::move(options)), arena_(std::move(arena)), policy_(std::move(policy)) {}

HostPool::~HostPool() {
  absl::MutexLock lock(&mu_);
  index_.clear();
}

bool HostPool::WriteFirstCandidate(const Entry& e) const {
  return !IsPinned(e) && (e.flushing || e.data.use_count() == 1);
}

bool HostPool::Reclaimable(const Entry& e) const {
  // use_count() == 1 means only the index holds the chunk. New references are made only
  // under mu_, and readers drop theirs without it, so the count can only fall while we
  // hold the lock: a chunk seen unreferenced here stays unreferenced.
  return !e.flushing && !IsPinned(e) && e.data.use_count() == 1;
}

void HostPool::CountPinLocked(const ChunkId& id, Entry& e) {
  e.pin_counted = true;
  pin_expiry_.emplace(e.pinned_until, id);
  pinned_slot_bytes_ += e.data->slot_count() * arena_->slot_bytes();
  pinned_payload_bytes_ += e.meta.size;
  ns_pinned_bytes_[id.ns] += e.data->slot_count() * arena_->slot_bytes();
}

void HostPool::SubtractPinLocked(const ChunkId& id, const Entry& e) const {
  e.pin_counted = false;
  pinned_slot_bytes_ -= e.data->slot_count() * arena_->slot_bytes();
  pinned_payload_bytes_ -= e.meta.size;
  if (auto n = ns_pinned_bytes_.find(id.ns); n != ns_pinned_bytes_.end()) {
    n->second -= e.data->slot_count() * arena_->slot_bytes();
    if (n->second == 0) ns_pinned_bytes_.erase(n);
  }
}

void HostPool::UncountPinLocked(const ChunkId& id, Entry& e) {
  auto [first, last] = pin_expiry_.equal_range(e.pinned_until);
  for (auto it = first; it != last; ++it) {
    if (it->second == id) {
      pin_expiry_.erase(it);
      break;
    }
  }
  SubtractPinLocked(id, e);
}

void HostPool::ExpirePinsLocked(absl::Time now) const {
  while (!pin_expiry_.empty() && pin_expiry_.begin()->first <= now) {
    const ChunkId id = pin_expiry_.begin()->second;
    pin_expiry_.erase(pin_expiry_.begin());
    // The entry outlives its count: erasing a counted entry uncounts it first.
    SubtractPinLocked(id, index_.at(id));
  }
}

void HostPool::EraseLocked(const ChunkId& id) {
  auto it = index_.find(id);
  if (it == index_.end()) return;
  if (it->second.pin_counted) UncountPinLocked(id, it->second);
  if (it->second.dirty) {
    --dirty_count_;
    dirty_bytes_ -= it->second.meta.size;
  }
  chunk_bytes_ -= it->second.meta.size;
  if (auto n = ns_bytes_.find(id.ns); n != ns_bytes_.end()) {
    n->second -= it->second.data->slot_count() * arena_->slot_bytes();
    if (n->second == 0) ns_bytes_.erase(n);
  }
  policy_->OnRemove(id);
  index_.erase(it);
}

absl::StatusOr<std::shared_ptr<PoolChunk>> HostPool::Allocate(
    uint64_t size, DirtyVictim dirty, absl::FunctionRef<bool(const ChunkId&)> spare) {
  const size_t need = arena_->SlotsFor(size);
  if (need > arena_->num_slots()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk of ", size, " bytes is larger than the host pool (", capacity_bytes(), ")"));
  }
  // Evicted entries' slots return to the arena when their PoolChunk dies, which happens
  // when `victims` is destroyed after the lock is released (the arena has its own lock).
  std::vector<std::shared_ptr<PoolChunk>> victims;
  std::vector<ChunkId> evicted;
  {
    absl::MutexLock lock(&mu_);
    // The victims are chosen first and evicted only if they make enough room.
    std::vector<ChunkId> chosen;
    absl::flat_hash_set<ChunkId> chosen_set;
    uint64_t freed = 0;
    while (arena_->free_slots() + freed < need) {
      // kWriteFirst: the policy's victim among the chunks nobody else holds, dirty or
      // not, including one being flushed right now (its write holds references of its
      // own, as many as the writer makes); such a victim is not skipped for a more
      // recently used one.
      std::optional<ChunkId> victim = policy_->PickVictim([&](const ChunkId& id) {
        mu_.AssertHeld();
        auto it = index_.find(id);
        if (it == index_.end() || chosen_set.contains(id) || spare(id)) return false;
        const Entry& e = it->second;
        if (dirty == DirtyVictim::kSkip) return Reclaimable(e) && !e.dirty;
        return WriteFirstCandidate(e);
      });
      if (!victim) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "host pool full: need ", need, " slots for a ", size,
            "-byte chunk; the rest are pinned, being read, not yet written to SSD, or in "
            "puts in flight"));
      }
      const Entry& e = index_.find(*victim)->second;
      if (e.dirty || e.flushing) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "host pool full: need ", need, " slots for a ", size,
            "-byte chunk; the least recently used chunk is not yet on SSD (write-back) "
            "and must be written first"));
      }
      freed += e.data->slot_count();
      chosen.push_back(*victim);
      chosen_set.insert(*victim);
    }
    for (const ChunkId& id : chosen) {
      victims.push_back(index_.find(id)->second.data);
      EraseLocked(id);
      ++evictions_;
    }
    evicted.swap(chosen);
  }
  victims.clear();
  if (options_.on_evict) {
    for (const ChunkId& id : evicted) options_.on_evict(id);
  }
  // Between releasing the victims and taking slots another thread may have taken them;
  // Take then fails cleanly and the caller sees ResourceExhausted (it may retry).
  auto slots = arena_->Take(need);
  if (!slots.ok()) return slots.status();
  return std::make_shared<PoolChunk>(arena_, *std::move(slots), size);
}

bool HostPool::Insert(const ChunkId& id, std::shared_ptr<PoolChunk> data,
                      const ChunkMeta& meta, bool dirty) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = index_.try_emplace(id);
  if (!inserted) return false;
  it->second.data = std::move(data);
  it->second.meta = meta;
  it->second.dirty = dirty;
  it->second.serial = ++next_serial_;
  chunk_bytes_ += meta.size;
  ns_bytes_[id.ns] += it->second.data->slot_count() * arena_->slot_bytes();
  if (dirty) {
    ++dirty_count_;
    dirty_bytes_ += meta.size;
    dirty_order_.push_back(id);
  }
  policy_->OnInsert(id, meta.lineage);
  return true;
}

std::optional<HostPool::Hit> HostPool::Find(const ChunkId& id) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  policy_->OnAccess(id);
  return Hit{it->second.data, it->second.meta};
}

std::optional<HostPool::Hit> HostPool::Peek(const ChunkId& id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) return std::nullopt;
  return Hit{it->second.data, it->second.meta};
}

bool HostPool::Contains(const ChunkId& id) const {
  absl::MutexLock lock(&mu_);
  return index_.contains(id);
}

std::vector<bool> HostPool::ContainsMany(absl::Span<const ChunkId> ids) const {
  std::vector<bool> present(ids.size(), false);
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < ids.size(); ++i) present[i] = index_.contains(ids[i]);
  return present;
}

uint64_t HostPool::PinLimitBytes() const {
  return static_cast<uint64_t>(options_.max_pinned_fraction * capacity_bytes());
}

absl::Status HostPool::CheckPinCanFit(absl::Span<const uint64_t> chunk_bytes) const {
  uint64_t slot_bytes = 0;
  for (uint64_t bytes : chunk_bytes) slot_bytes += arena_->SlotsFor(bytes) * arena_->slot_bytes();
  if (slot_bytes <= PinLimitBytes()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "pinning ", chunk_bytes.size() == 1 ? "this chunk" : absl::StrCat(chunk_bytes.size(), " chunks together"),
      " (", slot_bytes, " bytes of pool slots) cannot fit max_pinned_fraction (",
      options_.max_pinned_fraction, " of the host pool, ", PinLimitBytes(),
      " bytes) even with nothing else pinned"));
}

absl::Status HostPool::Pin(const ChunkId& id, absl::Time until, const PinBudget* budget) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) return absl::NotFoundError("chunk not in the host pool");
  const absl::Time now = options_.now();
  ExpirePinsLocked(now);
  Entry& entry = it->second;
  if (!entry.pin_counted) {
    const uint64_t pinned = pinned_slot_bytes_;
    uint64_t budget_pinned = 0;
    if (budget != nullptr) {
      for (uint64_t ns : *budget->namespaces) {
        if (auto n = ns_pinned_bytes_.find(ns); n != ns_pinned_bytes_.end()) {
          budget_pinned += n->second;
        }
      }
    }
    // A tenant's pins count the slots they hold, as its ram_quota does.
    const uint64_t chunk_slot_bytes = entry.data->slot_count() * arena_->slot_bytes();
    if (budget != nullptr && chunk_slot_bytes > budget->max_bytes) {
      // Not even with nothing else pinned: a retry can never succeed.
      return absl::InvalidArgumentError(absl::StrCat(
          "pinning this ", entry.meta.size, "-byte chunk (", chunk_slot_bytes,
          " bytes of pool slots) cannot fit the tenant's ", budget->quota, " (",
          budget->max_bytes, " bytes) even with nothing else pinned"));
    }
    if (budget != nullptr && budget_pinned + chunk_slot_bytes > budget->max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pinning this ", entry.meta.size, "-byte chunk (", chunk_slot_bytes,
          " bytes of pool slots) would exceed the tenant's ", budget->quota, " (",
          budget->max_bytes, " bytes, ", budget_pinned,
          " pinned now); unpin something or wait for pins to expire"));
    }
    if (absl::Status s = CheckPinCanFit({entry.meta.size}); !s.ok()) return s;
    if (pinned + chunk_slot_bytes > PinLimitBytes()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pinning would exceed max_pinned_fraction (", options_.max_pinned_fraction,
          " of the host pool); unpin something first"));
    }
  }
  const absl::Time new_until = std::max(entry.pinned_until, until);
  if (entry.pin_counted) {
    if (new_until != entry.pinned_until) {
      UncountPinLocked(id, entry);
      entry.pinned_until = new_until;
      CountPinLocked(id, entry);
    }
  } else {
    entry.pinned_until = new_until;
    if (new_until > now) CountPinLocked(id, entry);
  }
  return absl::OkStatus();
}

HostPool::NamespaceBytes HostPool::BytesOf(const absl::flat_hash_set<uint64_t>& ns) const {
  NamespaceBytes out;
  absl::MutexLock lock(&mu_);
  for (uint64_t n : ns) {
    if (auto it = ns_bytes_.find(n); it != ns_bytes_.end()) out.bytes += it->second;
  }
  if (out.bytes == 0) return out;
  ExpirePinsLocked(options_.now());
  for (uint64_t n : ns) {
    if (auto it = ns_pinned_bytes_.find(n); it != ns_pinned_bytes_.end()) out.pinned += it->second;
  }
  return out;
}

uint64_t HostPool::ShrinkTo(const absl::flat_hash_set<uint64_t>& ns, uint64_t keep) {
  std::vector<std::shared_ptr<PoolChunk>> victims;  // Released after the lock.
  std::vector<ChunkId> evicted;
  uint64_t held = 0;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t n : ns) {
      if (auto it = ns_bytes_.find(n); it != ns_bytes_.end()) held += it->second;
    }
    while (held > keep) {
      std::optional<ChunkId> victim = policy_->PickVictim([&](const ChunkId& id) {
        mu_.AssertHeld();
        if (!ns.contains(id.ns)) return false;
        auto it = index_.find(id);
        return it != index_.end() && Reclaimable(it->second) && !it->second.dirty;
      });
      if (!victim) break;
      Entry& e = index_.find(*victim)->second;
      held -= e.data->slot_count() * arena_->slot_bytes();
      // Copied: EraseLocked reads it (a pin that expired by time is still counted).
      victims.push_back(e.data);
      EraseLocked(*victim);
      ++evictions_;
      evicted.push_back(*victim);
    }
  }
  victims.clear();
  if (options_.on_evict) {
    for (const ChunkId& id : evicted) options_.on_evict(id);
  }
  return held;
}

bool HostPool::Unpin(const ChunkId& id) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) return false;
  ExpirePinsLocked(options_.now());
  if (!it->second.pin_counted) return false;
  UncountPinLocked(id, it->second);
  it->second.pinned_until = absl::InfinitePast();
  return true;
}

uint64_t HostPool::UnpinNamespaces(const absl::flat_hash_set<uint64_t>& ns) {
  absl::MutexLock lock(&mu_);
  ExpirePinsLocked(options_.now());
  uint64_t unpinned = 0;
  for (auto& [id, e] : index_) {
    if (!ns.contains(id.ns) || !e.pin_counted) continue;
    UncountPinLocked(id, e);
    e.pinned_until = absl::InfinitePast();
    ++unpinned;
  }
  return unpinned;
}

bool HostPool::Remove(const ChunkId& id) {
  std::shared_ptr<PoolChunk> keep;  // Released after the lock.
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) return false;
  keep = it->second.data;
  EraseLocked(id);
  return true;
}

uint64_t HostPool::RemoveNamespace(uint64_t ns, std::vector<ChunkId>* removed) {
  std::vector<std::shared_ptr<PoolChunk>> keep;
  absl::MutexLock lock(&mu_);
  std::vector<ChunkId> ids;
  for (const auto& [id, e] : index_) {
    if (id.ns == ns) ids.push_back(id);
  }
  for (const ChunkId& id : ids) {
    keep.push_back(index_[id].data);
    EraseLocked(id);
  }
  const uint64_t n = ids.size();
  if (removed != nullptr) *removed = std::move(ids);
  return n;
}

std::optional<HostPool::DirtyChunk> HostPool::TakeDirtyVictim() {
  absl::MutexLock lock(&mu_);
  // The first dirty chunk among Allocate's victims (kWriteFirst), in the policy's order;
  // the clean ones before it Allocate can take as they are. Being flushed already: the
  // caller waits for that write rather than write (and so evict) a more recently used
  // chunk.
  std::optional<ChunkId> victim = policy_->PickVictim([this](const ChunkId& id) {
    mu_.AssertHeld();
    auto it = index_.find(id);
    return it != index_.end() && it->second.dirty && WriteFirstCandidate(it->second);
  });
  if (!victim) return std::nullopt;
  Entry& e = index_.find(*victim)->second;
  if (e.flushing || WriteHeldLocked(*victim)) return std::nullopt;
  e.flushing = true;
  writing_.insert(*victim);
  return DirtyChunk{*victim, e.data, e.meta, e.serial};
}

std::optional<HostPool::DirtyChunk> HostPool::TakeDirty() {
  absl::MutexLock lock(&mu_);
  while (!dirty_order_.empty()) {
    ChunkId id = dirty_order_.front();
    dirty_order_.pop_front();
    auto it = index_.find(id);
    if (it == index_.end() || !it->second.dirty || it->second.flushing) continue;
    if (WriteHeldLocked(id)) {
      deferred_.push_back(id);
      continue;
    }
    it->second.flushing = true;
    writing_.insert(id);
    return DirtyChunk{id, it->second.data, it->second.meta, it->second.serial};
  }
  return std::nullopt;
}

bool HostPool::WriteHeldLocked(const ChunkId& id) const {
  return writing_.contains(id) || fenced_.contains(id) || fenced_ns_.contains(id.ns);
}

void HostPool::RequeueDeferredLocked() {
  auto held = std::partition(deferred_.begin(), deferred_.end(), [this](const ChunkId& id) {
    mu_.AssertHeld();
    return WriteHeldLocked(id);
  });
  dirty_order_.insert(dirty_order_.end(), held, deferred_.end());
  deferred_.erase(held, deferred_.end());
}

void HostPool::EndWriteLocked(const ChunkId& id) {
  writing_.erase(id);
  RequeueDeferredLocked();
}

void HostPool::Fence(const ChunkId& id) {
  absl::MutexLock lock(&mu_);
  const auto written = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !writing_.contains(id);
  };
  if (!written() && options_.before_fence_wait) options_.before_fence_wait(id);
  mu_.Await(absl::Condition(&written));
  ++fenced_[id];
}

void HostPool::Unfence(const ChunkId& id) {
  absl::MutexLock lock(&mu_);
  if (auto it = fenced_.find(id); it != fenced_.end() && --it->second == 0) fenced_.erase(it);
  RequeueDeferredLocked();
}

void HostPool::FenceNamespace(uint64_t ns) {
  absl::MutexLock lock(&mu_);
  const auto written = [this, ns]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::c_none_of(writing_, [ns](const ChunkId& id) { return id.ns == ns; });
  };
  mu_.Await(absl::Condition(&written));
  ++fenced_ns_[ns];
}

void HostPool::UnfenceNamespace(uint64_t ns) {
  absl::MutexLock lock(&mu_);
  if (auto it = fenced_ns_.find(ns); it != fenced_ns_.end() && --it->second == 0) {
    fenced_ns_.erase(it);
  }
  RequeueDeferredLocked();
}

HostPool::FlushEnd HostPool::FinishFlush(const DirtyChunk& d, bool written) {
  absl::MutexLock lock(&mu_);
  EndWriteLocked(d.id);
  auto it = index_.find(d.id);
  if (it == index_.end()) return FlushEnd::kGone;
  Entry& e = it->second;
  if (e.serial != d.serial) return FlushEnd::kReplaced;
  e.flushing = false;
  if (written) {
    e.dirty = false;
    --dirty_count_;
    dirty_bytes_ -= e.meta.size;
  } else {
    dirty_order_.push_back(d.id);
  }
  return FlushEnd::kFinished;
}

bool HostPool::DropFlushing(const DirtyChunk& d, bool even_if_pinned) {
  std::shared_ptr<PoolChunk> keep;
  {
    absl::MutexLock lock(&mu_);
    EndWriteLocked(d.id);
    auto it = index_.find(d.id);
    if (it == index_.end() || it->second.serial != d.serial) return false;
    if (!even_if_pinned && IsPinned(it->second)) {
      // Pinned while it was being written: a pin's promise outranks the room.
      it->second.flushing = false;
      dirty_order_.push_back(d.id);
      return false;
    }
    keep = it->second.data;
    EraseLocked(d.id);
    ++evictions_;
  }
  if (options_.on_evict) options_.on_evict(d.id);
  return true;
}

uint64_t HostPool::dirty_count() const {
  absl::MutexLock lock(&mu_);
  return dirty_count_;
}

uint64_t HostPool::dirty_bytes() const {
  absl::MutexLock lock(&mu_);
  return dirty_bytes_;
}

void HostPool::Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
                     WriteDone done) {
  if (absl::Status s = CheckChunkBytes(Tier::kRam, id, meta, bytes); !s.ok()) return done(s);
  if (Contains(id)) return done(absl::OkStatus());
  absl::StatusOr<std::shared_ptr<PoolChunk>> chunk = Allocate(meta.size, DirtyVictim::kSkip);
  if (!chunk.ok()) return done(chunk.status());
  uint32_t crc = 0;
  uint64_t offset = 0;
  for (absl::string_view piece : bytes.pieces) {
    crc = (*chunk)->WriteAndExtendCrc(offset, piece, crc);
    offset += piece.size();
  }
  if (crc != meta.crc32c) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("RAM write of ", id.DebugString(), ": CRC32C mismatch")));
  }
  Insert(id, *std::move(chunk), meta, /*dirty=*/false);
  done(absl::OkStatus());
}

void HostPool::Read(const ChunkId& id, SinkFor sink_for, ReadDone done) {
  std::optional<Hit> hit = Find(id);
  if (!hit.has_value()) return done(absl::NotFoundError("chunk not in RAM"));
  ChunkSink* sink = sink_for(hit->meta);
  if (sink == nullptr) {
    return done(NoSinkError());
  }
  uint64_t offset = 0;
  hit->data->ForEachPiece(0, hit->meta.size, [&](absl::string_view piece) {
    sink->Write(offset, piece);
    offset += piece.size();
  });
  if (sink->Crc32c() != hit->meta.crc32c) {
    Remove(id);
    return done(absl::DataLossError(
        absl::StrCat("RAM copy of ", id.DebugString(), " failed its CRC32C; dropped")));
  }
  done(hit->meta);
}

TierStats HostPool::Stats() const {
  const HostPoolStats s = GetStats();
  TierStats t;
  t.tier = Tier::kRam;
  t.capacity_bytes = s.capacity_bytes;
  t.used_bytes = s.used_bytes;
  t.payload_bytes = s.chunk_bytes;
  t.chunks = s.chunks;
  t.pinned_bytes = s.pinned_bytes;
  t.hits = s.hits;
  t.misses = s.misses;
  t.evictions = s.evictions;
  return t;
}

HostPoolStats HostPool::GetStats() const {
  absl::MutexLock lock(&mu_);
  HostPoolStats s;
  s.capacity_bytes = capacity_bytes();
  s.used_bytes = (arena_->num_slots() - arena_->free_slots()) * arena_->slot_bytes();
  s.prefaulted_bytes = arena_->prefaulted_bytes();
  s.chunk_bytes = chunk_bytes_;
  s.chunks = index_.size();
  ExpirePinsLocked(options_.now());
  s.pinned_bytes = pinned_payload_bytes_;
  s.dirty_chunks = dirty_count_;
  s.dirty_bytes = dirty_bytes_;
  s.hits = hits_;
  s.misses = misses_;
  s.evictions = evictions_;
  return s;
}

}  // namespace kvtier
