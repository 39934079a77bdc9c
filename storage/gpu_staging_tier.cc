#include "storage/gpu_staging_tier.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "storage/enqueue_gate.h"

namespace kvtier {

absl::Status GpuStagingOptions::Validate() const {
  if (slot_bytes == 0 || slot_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu staging slot_bytes must be a positive multiple of 4096, got ",
                     slot_bytes));
  }
  if (capacity_bytes < slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu staging capacity_bytes (", capacity_bytes, ") must hold at least one slot of ",
        slot_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GpuStagingTier>> GpuStagingTier::Create(
    const GpuStagingOptions& options, DeviceBackend* backend,
    std::unique_ptr<EvictionPolicy> policy) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (backend == nullptr || policy == nullptr) {
    return absl::InvalidArgumentError("gpu staging tier needs a device backend and a policy");
  }
  const uint64_t num_slots = options.capacity_bytes / options.slot_bytes;
  absl::StatusOr<DevicePtr> base = backend->Allocate(num_slots * options.slot_bytes);
  if (!base.ok()) return base.status();
  return std::unique_ptr<GpuStagingTier>(
      new GpuStagingTier(options, backend, *base, num_slots, std::move(policy)));
}

GpuStagingTier::GpuStagingTier(const GpuStagingOptions& options, DeviceBackend* backend,
                               DevicePtr base, uint64_t num_slots,
                               std::unique_ptr<EvictionPolicy> policy)
    : options_(options),
      backend_(backend),
      base_(base),
      num_slots_(num_slots),
      policy_(std::move(policy)) {
  stats_.capacity_bytes = num_slots * options.slot_bytes;
  free_.reserve(num_slots);
  // Highest first: Take pops from the back, so the first chunks get low, adjacent slots
  // and their copies coalesce.
  for (uint64_t i = num_slots; i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
}

GpuStagingTier::~GpuStagingTier() {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &in_flight_));
    index_.clear();
  }
  backend_->Free(base_);
}

template <typename Fn>
void GpuStagingTier::ForEachDeviceRange(const Entry& e, uint64_t offset, uint64_t len,
                                        Fn fn) const {
  const uint64_t slot = options_.slot_bytes;
  while (len > 0) {
    const uint64_t index = offset / slot;
    const uint64_t within = offset % slot;
    const uint64_t n = std::min(len, slot - within);
    fn(SlotAddress(e.slots[index]) + within, offset, n);
    offset += n;
    len -= n;
  }
}

bool GpuStagingTier::MakeRoomLocked(size_t n) {
  if (free_.size() >= n) return true;
  // Choose every victim before evicting any: on failure nothing is evicted.
  std::vector<ChunkId> victims;
  absl::flat_hash_set<ChunkId> chosen;
  size_t room = free_.size();
  while (room < n) {
    std::optional<ChunkId> victim = policy_->PickVictim([&](const ChunkId& id) {
      mu_.AssertHeld();
      if (chosen.contains(id)) return false;
      auto it = index_.find(id);
      return it != index_.end() && !it->second->loading && it->second->readers == 0;
    });
    if (!victim) return false;
    chosen.insert(*victim);
    victims.push_back(*victim);
    room += index_.at(*victim)->slots.size();
  }
  for (const ChunkId& id : victims) {
    auto it = index_.find(id);
    std::shared_ptr<Entry> e = it->second;
    UnindexLocked(id, *e);
    FreeIfIdleLocked(*e);  // Idle: the predicate above chose only idle chunks.
    ++stats_.evictions;
  }
  return free_.size() >= n;
}

void GpuStagingTier::UnindexLocked(const ChunkId& id, Entry& e) {
  if (!e.loading) {
    --stats_.chunks;
    stats_.chunk_bytes -= e.meta.size;
  }
  e.removed = true;
  policy_->OnRemove(id);
  index_.erase(id);
}

void GpuStagingTier::FreeIfIdleLocked(Entry& e) {
  if (!e.removed || e.loading || e.readers > 0 || e.slots.empty()) return;
  stats_.used_bytes -= e.slots.size() * options_.slot_bytes;
  free_.insert(free_.end(), e.slots.rbegin(), e.slots.rend());
  e.slots.clear();
}

void GpuStagingTier::Stage(const ChunkId& id, const ChunkMeta& meta,
                           std::vector<absl::string_view> pieces,
                           std::shared_ptr<const void> keep_alive, Done done, Verify verify) {
  uint64_t total = 0;
  for (absl::string_view p : pieces) total += p.size();
  auto refuse = [&](absl::Status s) {
    // Never on the caller's thread, as the backend promises for its own answers.
    backend_->Submit({}, [s = std::move(s), done = std::move(done)](absl::Status) {
      done(s);
    });
  };
  if (total != meta.size) {
    refuse(absl::InvalidArgumentError(absl::StrCat(
        "staging ", id.DebugString(), ": pieces hold ", total, " bytes, chunk has ",
        meta.size)));
    return;
  }
  const size_t need = (meta.size + options_.slot_bytes - 1) / options_.slot_bytes;
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    if (index_.contains(id)) {
      refuse(absl::OkStatus());
      return;
    }
    if (need > num_slots_) {
      refuse(absl::InvalidArgumentError(absl::StrCat(
          "chunk of ", meta.size, " bytes is larger than the GPU staging tier (",
          capacity_bytes(), " bytes)")));
      return;
    }
    if (!MakeRoomLocked(need)) {
      ++stats_.no_room;
      refuse(absl::ResourceExhaustedError(
          "no room in GPU staging buffers: the rest is loading or being read"));
      return;
    }
    entry = std::make_shared<Entry>();
    entry->meta = meta;
    entry->slots.assign(free_.end() - need, free_.end());
    std::reverse(entry->slots.begin(), entry->slots.end());
    free_.resize(free_.size() - need);
    stats_.used_bytes += need * options_.slot_bytes;
    ++stats_.loading;
    index_.emplace(id, entry);
    policy_->OnInsert(id, meta.lineage);
    ++in_flight_;
  }
  std::vector<DeviceCopy> copies;
  uint64_t offset = 0;
  for (absl::string_view p : pieces) {
    ForEachDeviceRange(*entry, offset, p.size(), [&](DevicePtr dst, uint64_t at, uint64_t n) {
      copies.push_back(DeviceCopy::HostToDevice(dst, p.data() + (at - offset), n));
    });
    offset += p.size();
  }
  // Published (loading false) once the copy has landed and, with `verify`, the host
  // bytes it was made from passed their check.
  auto finish = [this, id, entry, keep_alive = std::move(keep_alive),
                 done = std::move(done)](absl::Status s) mutable {
    {
      absl::MutexLock lock(&mu_);
      entry->loading = false;
      --stats_.loading;
      if (s.ok()) {
        ++stats_.staged;
        stats_.bytes_in += entry->meta.size;
        if (!entry->removed) {
          ++stats_.chunks;
          stats_.chunk_bytes += entry->meta.size;
        }
      } else {
        ++stats_.stage_failures;
        if (!entry->removed) {
          entry->removed = true;
          policy_->OnRemove(id);
          index_.erase(id);
        }
      }
      FreeIfIdleLocked(*entry);
      keep_alive.reset();  // The host bytes are no longer needed.
      --in_flight_;
    }
    done(s.ok() || absl::IsDataLoss(s)
             ? s
             : absl::Status(s.code(), absl::StrCat("copy to GPU staging failed: ", s.message())));
  };
  backend_->Submit(CoalesceCopies(std::move(copies)),
                   [id, verify = std::move(verify),
                    finish = std::move(finish)](absl::Status s) mutable {
                     if (!s.ok() || !verify) {
                       finish(std::move(s));
                       return;
                     }
                     verify([id, finish = std::move(finish)](bool ok) mutable {
                       finish(ok ? absl::OkStatus()
                                 : absl::DataLossError(absl::StrCat(
                                       "staging ", id.DebugString(),
                                       ": the host bytes failed their CRC32C; not staged")));
                     });
                   });
}

std::optional<ChunkMeta> GpuStagingTier::Find(const ChunkId& id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end() || it->second->loading) return std::nullopt;
  return it->second->meta;
}

void GpuStagingTier::CopyOut(
    const ChunkId& id,
    absl::FunctionRef<absl::StatusOr<std::vector<DeviceCopy>>(const Entry&)> build,
    Done done, std::function<void()> enqueued) {
  std::shared_ptr<Entry> entry;
  absl::StatusOr<std::vector<DeviceCopy>> copies;
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end() || it->second->loading) {
      ++stats_.misses;
      copies = absl::NotFoundError(
          absl::StrCat("chunk ", id.DebugString(), " is not in GPU staging"));
    } else {
      copies = build(*it->second);
      if (copies.ok()) {
        entry = it->second;
        ++stats_.hits;
        ++entry->readers;
        ++in_flight_;
        policy_->OnAccess(id);
      }
    }
  }
  if (!copies.ok()) {
    backend_->Submit({}, [s = copies.status(), done = std::move(done)](absl::Status) {
      done(s);
    });
    return;
  }
  uint64_t bytes = 0;
  for (const DeviceCopy& c : *copies) bytes += c.bytes;
  // `enqueued` before `done`, however fast the copies complete.
  auto gate = std::make_shared<EnqueueGate>();
  backend_->Submit(CoalesceCopies(*std::move(copies)),
                   [this, entry, bytes, gate, done = std::move(done)](absl::Status s) {
                     {
                       absl::MutexLock lock(&mu_);
                       --entry->readers;
                       if (s.ok()) {
                         stats_.bytes_out += bytes;
                       } else {
                         ++stats_.copy_failures;
                       }
                       FreeIfIdleLocked(*entry);
                       --in_flight_;
                     }
                     gate->AfterEnqueued([s, done = std::move(done)] {
                       done(s.ok() ? s
                                   : absl::Status(s.code(),
                                                  absl::StrCat("copy out of GPU staging failed: ",
                                                               s.message())));
                     });
                   });
  gate->Enqueued(enqueued);
}

void GpuStagingTier::CopyToDevice(const ChunkId& id, std::vector<Range> ranges, Done done,
                                  std::function<void()> enqueued) {
  CopyOut(
      id,
      [&](const Entry& e) -> absl::StatusOr<std::vector<DeviceCopy>> {
        std::vector<DeviceCopy> copies;
        for (const Range& r : ranges) {
          if (r.offset > e.meta.size || r.len > e.meta.size - r.offset) {
            return absl::InvalidArgumentError(absl::StrCat(
                "range [", r.offset, ", +", r.len, ") is outside chunk ", id.DebugString(),
                " of ", e.meta.size, " bytes"));
          }
          ForEachDeviceRange(e, r.offset, r.len, [&](DevicePtr src, uint64_t at, uint64_t n) {
            copies.push_back(DeviceCopy::DeviceToDevice(r.dst + (at - r.offset), src, n));
          });
          if (r.record_event != 0) copies.push_back(DeviceCopy::RecordEvent(r.record_event));
        }
        return copies;
      },
      std::move(done), std::move(enqueued));
}

void GpuStagingTier::CopyToHost(const ChunkId& id, const ChunkMeta& expected, char* dst,
                                Done done) {
  CopyOut(
      id,
      [&](const Entry& e) -> absl::StatusOr<std::vector<DeviceCopy>> {
        if (!(e.meta == expected)) {
          return absl::NotFoundError(absl::StrCat(
              id.DebugString(), " was staged again as another chunk (", e.meta.size,
              " bytes, not ", expected.size, ")"));
        }
        std::vector<DeviceCopy> copies;
        ForEachDeviceRange(e, 0, e.meta.size, [&](DevicePtr src, uint64_t at, uint64_t n) {
          copies.push_back(DeviceCopy::DeviceToHost(dst + at, src, n));
        });
        return copies;
      },
      std::move(done));
}

bool GpuStagingTier::Remove(const ChunkId& id) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) return false;
  std::shared_ptr<Entry> e = it->second;
  UnindexLocked(id, *e);
  FreeIfIdleLocked(*e);
  return true;
}

uint64_t GpuStagingTier::RemoveNamespace(uint64_t ns) {
  absl::MutexLock lock(&mu_);
  std::vector<ChunkId> ids;
  for (const auto& [id, e] : index_) {
    if (id.ns == ns) ids.push_back(id);
  }
  for (const ChunkId& id : ids) {
    std::shared_ptr<Entry> e = index_.at(id);
    UnindexLocked(id, *e);
    FreeIfIdleLocked(*e);
  }
  return ids.size();
}

GpuStagingStats GpuStagingTier::GetStats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace kvtier
