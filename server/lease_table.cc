#include "server/lease_table.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status LeaseTableOptions::Validate() const {
  if (max_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("option max_lease_seconds: must be at least 1");
  }
  if (!now) return absl::InvalidArgumentError("lease table: now is empty");
  return absl::OkStatus();
}

LeaseTable::LeaseTable(LeaseTableOptions options) : options_(std::move(options)) {}

std::vector<ChunkView> LeaseTable::EraseLocked(
    absl::flat_hash_map<uint64_t, Lease>::iterator it) {
  std::vector<ChunkView> held;
  held.reserve(it->second.held.size());
  for (LeasedChunk& c : it->second.held) held.push_back(std::move(c.view));
  stats_.held_bytes -= it->second.bytes;
  if (const std::string& tenant = it->second.tenant; !tenant.empty()) {
    auto hold = by_tenant_.find(tenant);
    if (hold != by_tenant_.end()) {
      hold->second.bytes -= it->second.bytes;
      if (--hold->second.leases == 0) by_tenant_.erase(hold);
    }
  }
  leases_.erase(it);
  return held;
}

uint64_t LeaseTable::ExpireLocked(std::vector<ChunkView>& dropped) {
  const absl::Time now = options_.now();
  if (now < next_expiry_) return 0;
  uint64_t n = 0;
  absl::Time next = absl::InfiniteFuture();
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.expires <= now) {
      std::vector<ChunkView> held = EraseLocked(it++);
      std::move(held.begin(), held.end(), std::back_inserter(dropped));
      ++n;
    } else {
      next = std::min(next, it->second.expires);
      ++it;
    }
  }
  next_expiry_ = next;
  stats_.expired += n;
  return n;
}

uint64_t LeaseTable::Grant(uint64_t ns, std::vector<LeasedChunk> held, absl::Duration ttl,
                           const std::string& tenant, uint32_t tenant_max,
                           uint32_t tenants) {
  std::vector<ChunkView> dropped;  // Released after the lock.
  uint64_t bytes = 0;
  for (const LeasedChunk& c : held) bytes += c.view.meta().size;
  absl::MutexLock lock(&mu_);
  ExpireLocked(dropped);
  if (!tenant.empty()) {
    auto it = by_tenant_.find(tenant);
    const TenantHold hold = it == by_tenant_.end() ? TenantHold{} : it->second;
    const uint64_t share = options_.max_held_bytes / std::max<uint32_t>(tenants, 1);
    if ((tenant_max != 0 && hold.leases >= tenant_max) || hold.bytes + bytes > share) {
      ++stats_.refused;
      ++stats_.tenant_refused;
      return 0;
    }
  }
  if (leases_.size() >= options_.max_leases ||
      stats_.held_bytes + bytes > options_.max_held_bytes) {
    ++stats_.refused;
    return 0;
  }
  uint64_t id = 0;
  while (id == 0 || leases_.contains(id)) id = absl::Uniform<uint64_t>(rng_);
  Lease lease;
  lease.ns = ns;
  lease.tenant = tenant;
  if (!tenant.empty()) {
    TenantHold& hold = by_tenant_[tenant];
    ++hold.leases;
    hold.bytes += bytes;
  }
  lease.expires = options_.now() + std::min(ttl, options_.max_ttl);
  lease.bytes = bytes;
  lease.held = std::move(held);
  next_expiry_ = std::min(next_expiry_, lease.expires);
  leases_.emplace(id, std::move(lease));
  stats_.held_bytes += bytes;
  ++stats_.granted;
  return id;
}

absl::StatusOr<std::vector<ChunkView>> LeaseTable::Take(uint64_t ns, uint64_t id) {
  std::vector<ChunkView> dropped;
  absl::MutexLock lock(&mu_);
  ExpireLocked(dropped);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.ns != ns) {
    return absl::NotFoundError(absl::StrCat("lease ", id, " is unknown, expired or ended"));
  }
  ++stats_.taken;
  return EraseLocked(it);
}

bool LeaseTable::Release(uint64_t ns, uint64_t id) {
  std::vector<ChunkView> dropped;
  absl::MutexLock lock(&mu_);
  ExpireLocked(dropped);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.ns != ns) return false;
  // Appended: assigned, the expired leases' views would be released here, under mu_.
  std::vector<ChunkView> erased = EraseLocked(it);
  dropped.insert(dropped.end(), std::make_move_iterator(erased.begin()),
                 std::make_move_iterator(erased.end()));
  ++stats_.released;
  return true;
}

void LeaseTable::ForgetLocked(uint64_t ns, absl::FunctionRef<bool(const ChunkId&)> forget,
                              std::vector<ChunkView>& dropped) {
  for (auto& [id, lease] : leases_) {
    if (lease.ns != ns) continue;
    uint64_t bytes = 0;
    auto kept = std::remove_if(lease.held.begin(), lease.held.end(), [&](LeasedChunk& c) {
      if (!forget(c.id)) return false;
      bytes += c.view.meta().size;
      dropped.push_back(std::move(c.view));
      return true;
    });
    lease.held.erase(kept, lease.held.end());
    if (bytes == 0) continue;
    lease.bytes -= bytes;
    stats_.held_bytes -= bytes;
    if (!lease.tenant.empty()) {
      if (auto hold = by_tenant_.find(lease.tenant); hold != by_tenant_.end()) {
        hold->second.bytes -= bytes;
      }
    }
  }
}

void LeaseTable::Forget(uint64_t ns, absl::Span<const ChunkId> ids) {
  std::vector<ChunkView> dropped;  // Released after the lock.
  absl::MutexLock lock(&mu_);
  if (leases_.empty()) return;
  const absl::flat_hash_set<ChunkId> gone(ids.begin(), ids.end());
  ForgetLocked(ns, [&](const ChunkId& id) { return gone.contains(id); }, dropped);
}

void LeaseTable::ForgetNamespace(uint64_t ns) {
  std::vector<ChunkView> dropped;
  absl::MutexLock lock(&mu_);
  ForgetLocked(ns, [](const ChunkId&) { return true; }, dropped);
}

uint64_t LeaseTable::Expire() {
  std::vector<ChunkView> dropped;
  absl::MutexLock lock(&mu_);
  return ExpireLocked(dropped);
}

uint64_t LeaseTable::Clear() {
  std::vector<ChunkView> dropped;  // Dropped after the lock is released.
  absl::MutexLock lock(&mu_);
  const uint64_t n = leases_.size();
  while (!leases_.empty()) {
    std::vector<ChunkView> held = EraseLocked(leases_.begin());
    std::move(held.begin(), held.end(), std::back_inserter(dropped));
  }
  return n;
}

uint32_t LeaseTable::live(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = by_tenant_.find(tenant);
  return it == by_tenant_.end() ? 0 : it->second.leases;
}

uint64_t LeaseTable::held_bytes(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = by_tenant_.find(tenant);
  return it == by_tenant_.end() ? 0 : it->second.bytes;
}

LeaseTableStats LeaseTable::GetStats() const {
  absl::MutexLock lock(&mu_);
  LeaseTableStats s = stats_;
  s.live = leases_.size();
  return s;
}

}  // namespace kvtier
