#include "server/region_table.h"

#include <sys/random.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

// Tokens are capabilities: they come from the kernel's CSPRNG, not from a seeded PRNG.
uint64_t RandomToken() {
  uint64_t v = 0;
  while (v == 0) {
    if (getrandom(&v, sizeof(v), 0) != sizeof(v)) v = 0;
  }
  return v;
}

}  // namespace

void RegionTable::PruneRetired() {
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [](const Retired& r) { return !r.mapped(); }),
                 retired_.end());
}

absl::Status RegionTable::CheckRoom() {
  PruneRetired();
  const size_t mapped = regions_.size() + retired_.size();
  if (mapped >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "region: ", mapped, " regions are mapped (", retired_.size(),
        " of them forgotten but still in use by transfers), the daemon's limit "
        "(shm_max_regions); remove one or retry after another client exits"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionTable::Added> RegionTable::Insert(Entry entry) {
  Added added;
  added.token = RandomToken();
  added.bytes = entry.size();
  entry.token = added.token;
  absl::MutexLock lock(&mu_);
  // Checked again: others may have registered while this one was being mapped.
  if (absl::Status s = CheckRoom(); !s.ok()) return s;
  do {
    added.id = absl::Uniform<uint64_t>(rng_);
  } while (added.id == 0 || regions_.contains(added.id));
  regions_.emplace(added.id, std::move(entry));
  bytes_ += added.bytes;
  return added;
}

absl::StatusOr<RegionTable::Added> RegionTable::Add(uint64_t owner, int fd,
                                                    uint64_t expected_bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckRoom(); !s.ok()) return s;
  }
  auto region = MappedRegion::Map(fd, expected_bytes, options_.max_region_bytes);
  if (!region.ok()) return region.status();
  return Insert(Entry{owner, 0, *std::move(region), nullptr});
}

absl::StatusOr<RegionTable::Added> RegionTable::AddDevice(
    uint64_t owner, DeviceBackend* backend, absl::string_view ipc_handle,
    uint64_t expected_bytes, const std::vector<std::string>& event_handles) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckRoom(); !s.ok()) return s;
  }
  auto device =
      DeviceRegion::Open(backend, ipc_handle, expected_bytes, options_.max_region_bytes,
                         event_handles);
  if (!device.ok()) return device.status();
  return Insert(Entry{owner, 0, nullptr, *std::move(device)});
}

absl::Status RegionTable::Remove(uint64_t owner, uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.owner != owner) {
    return absl::NotFoundError(absl::StrCat("region ", id, ": not registered on this connection"));
  }
  // Transfers copy the pointer only in Find, under mu_: a count of one here means none
  // holds it, and none can start before it is gone from the table.
  const long holders = it->second.region ? it->second.region.use_count()
                                         : it->second.device.use_count();
  if (holders > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", id, ": in use by ", holders - 1,
        " call(s) in flight (a Get into it, a Put frame from it or a Prefill session "
        "writing into it); end or wait for them, then remove it"));
  }
  bytes_ -= it->second.size();
  regions_.erase(it);
  return absl::OkStatus();
}

int RegionTable::RemoveOwner(uint64_t owner) {
  absl::MutexLock lock(&mu_);
  PruneRetired();
  int removed = 0;
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second.owner == owner) {
      const Entry& e = it->second;
      bytes_ -= e.size();
      // Held by a transfer (the table's is one reference): counted until it lets go.
      if ((e.region ? e.region.use_count() : e.device.use_count()) > 1) {
        retired_.push_back(Retired{e.region, e.device, e.size()});
      }
      regions_.erase(it++);  // Drops the table's reference.
      ++removed;
    } else {
      ++it;
    }
  }
  return removed;
}

absl::StatusOr<const RegionTable::Entry*> RegionTable::FindEntry(uint64_t id,
                                                                 uint64_t token) const {
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", id, ": not registered (never, or its client's region socket closed); "
        "register the memory again"));
  }
  if (it->second.token != token) {
    return absl::PermissionDeniedError(absl::StrCat(
        "region ", id, ": wrong token; a region is usable only by the client that "
        "registered it"));
  }
  return &it->second;
}

absl::StatusOr<std::shared_ptr<const MappedRegion>> RegionTable::Find(uint64_t id,
                                                                      uint64_t token) const {
  absl::MutexLock lock(&mu_);
  auto e = FindEntry(id, token);
  if (!e.ok()) return e.status();
  if ((*e)->region == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", id, ": is GPU memory, which this transfer cannot use"));
  }
  return (*e)->region;
}

absl::StatusOr<std::shared_ptr<const DeviceRegion>> RegionTable::FindDevice(
    uint64_t id, uint64_t token) const {
  absl::MutexLock lock(&mu_);
  auto e = FindEntry(id, token);
  if (!e.ok()) return e.status();
  if ((*e)->device == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("region ", id, ": is host memory, not GPU memory"));
  }
  return (*e)->device;
}

bool RegionTable::IsDevice(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it != regions_.end() && it->second.device != nullptr;
}

uint64_t RegionTable::regions() const {
  absl::MutexLock lock(&mu_);
  uint64_t n = regions_.size();
  for (const Retired& r : retired_) n += r.mapped() ? 1 : 0;
  return n;
}

uint64_t RegionTable::bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t n = bytes_;
  for (const Retired& r : retired_) n += r.mapped() ? r.bytes : 0;
  return n;
}

}  // namespace kvtier
