#include "server/tenant_quotas.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/registry.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

const char* QuotaTierName(Tier tier) { return tier == Tier::kRam ? "ram" : "ssd"; }

}  // namespace

TenantQuotas::TenantQuotas(prometheus::Registry* registry) {
  if (registry == nullptr) return;
  refusals_ = &prometheus::BuildCounter()
                   .Name("kvtier_tenant_quota_refusals_total")
                   .Help("Puts and pins refused because a tenant's chunks over its quota "
                         "could not be evicted, or did not fit it at all, by quota "
                         "(ram, ssd, pinned)")
                   .Register(*registry);
  evicted_ = &prometheus::BuildCounter()
                  .Name("kvtier_tenant_quota_evicted_bytes_total")
                  .Help("Bytes of a tenant's chunks evicted from a tier to keep its own "
                        "puts, and reads into RAM, within its quota, by tier (ram: the pool "
                        "slots they took; ssd: payload bytes)")
                  .Register(*registry);
}

TenantQuota TenantQuotas::QuotaOf(const TenantScope& t) const {
  if (source_ != nullptr && !t.implicit()) {
    if (std::optional<TenantQuota> now = source_(t.tenant())) return *now;
  }
  return t.quota();
}

absl::flat_hash_set<uint64_t> TenantQuotas::BindAndList(const TenantScope& t,
                                                        const TenantQuota& q, uint64_t ns) {
  absl::MutexLock lock(&mu_);
  Account& a = accounts_[t.tenant()];
  a.namespaces.insert(ns);
  a.quota = q;
  owners_[ns] = t.tenant();
  return a.namespaces;
}

void TenantQuotas::Bind(const TenantScope& t, uint64_t ns) {
  if (t.implicit() || ns == 0) return;
  BindWith(t, QuotaOf(t), ns);
}

void TenantQuotas::BindWith(const TenantScope& t, const TenantQuota& q, uint64_t ns) {
  absl::MutexLock lock(&mu_);
  Account& a = accounts_[t.tenant()];
  a.namespaces.insert(ns);
  a.quota = q;
  owners_[ns] = t.tenant();
}

absl::StatusOr<bool> TenantQuotas::AdmitLayout(
    const TenantScope& t, uint64_t ns, uint32_t max,
    absl::FunctionRef<std::vector<std::pair<uint64_t, LayoutSpec>>()> registered) {
  if (t.implicit()) return false;
  const TenantQuota q = QuotaOf(t);
  bool read;
  {
    absl::MutexLock lock(&mu_);
    read = accounts_[t.tenant()].layouts_read;
  }
  std::vector<uint64_t> owned;  // The tenant's among the store's (one hash each).
  if (!read) {
    for (const auto& [internal, spec] : registered()) {
      if (t.Internal(spec.NamespaceId()) == internal) owned.push_back(internal);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    Account& a = accounts_[t.tenant()];
    a.quota = q;
    if (!read && !a.layouts_read) {
      for (uint64_t n : owned) {
        a.namespaces.insert(n);
        owners_[n] = t.tenant();
      }
      a.layouts_read = true;
    }
    if (a.namespaces.contains(ns)) return false;
    if (a.namespaces.size() < max) {
      a.namespaces.insert(ns);
      owners_[ns] = t.tenant();
      return true;
    }
  }
  Refused(t.tenant(), "layouts");
  return absl::FailedPreconditionError(absl::StrCat(
      "layout: tenant '", t.tenant(), "' has registered ", max,
      " layouts, its share of max_layouts (or its own max_layouts in the tenants file)"));
}

void TenantQuotas::UnbindLayout(const TenantScope& t, uint64_t ns) {
  absl::MutexLock lock(&mu_);
  if (auto it = accounts_.find(t.tenant()); it != accounts_.end()) it->second.namespaces.erase(ns);
  owners_.erase(ns);
}

void TenantQuotas::Refused(const std::string& tenant, const char* quota) {
  if (refusals_ != nullptr) refusals_->Add({{"tenant", tenant}, {"quota", quota}}).Increment();
}

absl::Status TenantQuotas::Fit(TieredStore* store, const TenantScope& t,
                               const absl::flat_hash_set<uint64_t>& ns, Tier tier,
                               uint64_t quota, uint64_t bytes) {
  const char* name = QuotaTierName(tier);
  if (bytes > quota) {
    Refused(t.tenant(), name);
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk taking ", bytes, " bytes", tier == Tier::kRam ? " of pool slots" : "",
        " can never fit tenant ", t.tenant(), "'s ", name,
        "_quota (", quota, " bytes)"));
  }
  auto after = MakeRoom(store, t.tenant(), ns, tier, quota, bytes);
  if (!after.ok()) return after.status();
  if (*after + bytes <= quota) return absl::OkStatus();
  Refused(t.tenant(), name);
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", t.tenant(), "'s ", name, "_quota (", quota, " bytes) is full: ", *after,
      " bytes of its chunks are pinned, being read",
      tier == Tier::kRam ? ", or not yet written to SSD" : " or being written",
      "; back off and retry"));
}

absl::StatusOr<uint64_t> TenantQuotas::MakeRoom(TieredStore* store, const std::string& tenant,
                                                const absl::flat_hash_set<uint64_t>& ns,
                                                Tier tier, uint64_t quota, uint64_t bytes) {
  const TieredStore::NamespaceUsage before = store->Usage(ns);
  const uint64_t held = tier == Tier::kRam ? before.ram_bytes : before.ssd_bytes;
  if (held + bytes <= quota) return held;
  auto after = store->ShrinkNamespaces(ns, tier, quota - bytes);
  if (!after.ok()) return after.status();
  if (evicted_ != nullptr && *after < held) {
    evicted_->Add({{"tenant", tenant}, {"tier", QuotaTierName(tier)}}).Increment(
        static_cast<double>(held - *after));
  }
  return *after;
}

bool TenantQuotas::AdmitPromotion(TieredStore* store, uint64_t ns, uint64_t bytes) {
  std::string tenant;
  absl::flat_hash_set<uint64_t> namespaces;
  uint64_t quota = 0;
  {
    absl::MutexLock lock(&mu_);
    auto owner = owners_.find(ns);
    if (owner == owners_.end()) return true;
    const Account& a = accounts_.at(owner->second);
    if (a.quota.ram_bytes == 0) return true;
    tenant = owner->second;
    namespaces = a.namespaces;
    quota = a.quota.ram_bytes;
  }
  if (bytes > quota) return false;
  auto after = MakeRoom(store, tenant, namespaces, Tier::kRam, quota, bytes);
  return after.ok() && *after + bytes <= quota;
}

absl::Status TenantQuotas::AdmitPut(TieredStore* store, const TenantScope& t, uint64_t ns,
                                    uint64_t bytes) {
  if (t.implicit()) return absl::OkStatus();
  // The quota in force now: a Put stream outlives its admission, and the tenants file
  // may have changed the quota since.
  const TenantQuota q = QuotaOf(t);
  if (q.ram_bytes == 0 && q.ssd_bytes == 0) {  // Nothing to enforce: record use only.
    BindWith(t, q, ns);
    return absl::OkStatus();
  }
  const absl::flat_hash_set<uint64_t> namespaces = BindAndList(t, q, ns);
  // RAM counts the pool slots a chunk takes: chunks smaller than a slot would otherwise
  // take the pool far past the quota, evicting other tenants' chunks.
  const uint64_t ram_bytes = store->RamFootprint(bytes);
  // A chunk larger than the RAM quota can never be stored: refused (Fit evicts nothing
  // then) before the SSD quota makes room for it.
  if (q.ram_bytes != 0 && ram_bytes > q.ram_bytes) {
    return Fit(store, t, namespaces, Tier::kRam, q.ram_bytes, ram_bytes);
  }
  // SSD first: what RAM then evicts stays on SSD.
  if (q.ssd_bytes != 0 && store->has_ssd_tier()) {
    if (absl::Status s = Fit(store, t, namespaces, Tier::kSsd, q.ssd_bytes, bytes); !s.ok()) {
      return s;
    }
  }
  if (q.ram_bytes != 0) {
    return Fit(store, t, namespaces, Tier::kRam, q.ram_bytes, ram_bytes);
  }
  return absl::OkStatus();
}

absl::Status TenantQuotas::Pin(TieredStore* store, const TenantScope& t, const ChunkId& id,
                               absl::Duration ttl) {
  if (t.implicit()) return store->Pin(id, ttl);
  const TenantQuota q = QuotaOf(t);
  const absl::flat_hash_set<uint64_t> namespaces = BindAndList(t, q, id.ns);
  const std::optional<HostPool::PinBudget> budget = PinBudgetOf(q, namespaces);
  if (!budget.has_value()) return store->Pin(id, ttl);
  absl::Status s = store->Pin(id, ttl, &*budget);
  if ((absl::IsResourceExhausted(s) || absl::IsInvalidArgument(s)) &&
      absl::StrContains(s.message(), "pinned_quota")) {
    Refused(t.tenant(), "pinned");
  }
  return s;
}

absl::Status TenantQuotas::CheckPins(TieredStore* store, const TenantScope& t,
                                     absl::Span<const ChunkId> ids) {
  if (t.implicit() || ids.empty()) return store->CheckPinsCanFit(ids);
  const TenantQuota q = QuotaOf(t);
  const absl::flat_hash_set<uint64_t> namespaces = BindAndList(t, q, ids.front().ns);
  const std::optional<HostPool::PinBudget> budget = PinBudgetOf(q, namespaces);
  absl::Status s = store->CheckPinsCanFit(ids, budget.has_value() ? &*budget : nullptr);
  if (!s.ok() && absl::StrContains(s.message(), "pinned_quota")) Refused(t.tenant(), "pinned");
  return s;
}

std::optional<HostPool::PinBudget> TenantQuotas::PinBudgetOf(
    const TenantQuota& q, const absl::flat_hash_set<uint64_t>& namespaces) {
  // Pins stay within the RAM quota too: a pinned chunk is in RAM and cannot be evicted,
  // and a chunk is brought into RAM to be pinned only within the RAM quota
  // (AdmitPromotion). So the budget is the smaller of the two (unset, the pinned quota
  // is the RAM quota), and a chunk larger than it can never be pinned: INVALID_ARGUMENT.
  if (q.pinned_bytes == 0 && q.ram_bytes == 0) return std::nullopt;
  if (q.pinned_bytes != 0 && (q.ram_bytes == 0 || q.pinned_bytes <= q.ram_bytes)) {
    return HostPool::PinBudget{&namespaces, q.pinned_bytes, "pinned_quota"};
  }
  return HostPool::PinBudget{&namespaces, q.ram_bytes,
                             q.pinned_bytes != 0 ? "pinned_quota (held to the smaller ram_quota)"
                                                 : "pinned_quota (unset: the ram_quota)"};
}

uint64_t TenantQuotas::UnpinRevoked(TieredStore* store) {
  if (!source_) return 0;
  std::vector<std::pair<std::string, absl::flat_hash_set<uint64_t>>> tenants;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, account] : accounts_) tenants.emplace_back(name, account.namespaces);
  }
  uint64_t unpinned = 0;
  for (const auto& [name, namespaces] : tenants) {
    if (source_(name).has_value()) continue;  // Outside mu_: the source takes its own lock.
    unpinned += store->UnpinNamespaces(namespaces);
  }
  return unpinned;
}

std::vector<MetricFamily> TenantQuotas::Collect() const {
  const TieredStore* store = store_.load(std::memory_order_acquire);
  std::vector<std::pair<std::string, Account>> accounts;
  {
    absl::MutexLock lock(&mu_);
    accounts.assign(accounts_.begin(), accounts_.end());
  }
  MetricFamily used{"kvtier_tenant_bytes",
                    "Bytes of a tenant's chunks, by tier (ram, ssd) and pinned in RAM "
                    "(tier=pinned), over the namespaces it has used since start-up; ram "
                    "and pinned count the pool slots they take, ssd their payload bytes",
                    MetricType::Gauge, {}};
  MetricFamily quota{"kvtier_tenant_quota_bytes",
                     "A tenant's quota by tier (ram, ssd, pinned), where one is set",
                     MetricType::Gauge, {}};
  auto add = [](MetricFamily& f, const std::string& tenant, const char* tier, double v) {
    ClientMetric m;
    m.label = {{"tenant", tenant}, {"tier", tier}};
    m.gauge.value = v;
    f.metric.push_back(std::move(m));
  };
  for (const auto& [tenant, a] : accounts) {
    if (store != nullptr) {
      const TieredStore::NamespaceUsage u = store->Usage(a.namespaces);
      add(used, tenant, "ram", static_cast<double>(u.ram_bytes));
      if (store->has_ssd_tier()) add(used, tenant, "ssd", static_cast<double>(u.ssd_bytes));
      add(used, tenant, "pinned", static_cast<double>(u.pinned_bytes));
    }
    if (a.quota.ram_bytes != 0) add(quota, tenant, "ram", static_cast<double>(a.quota.ram_bytes));
    if (a.quota.ssd_bytes != 0) add(quota, tenant, "ssd", static_cast<double>(a.quota.ssd_bytes));
    if (a.quota.pinned_bytes != 0) {
      add(quota, tenant, "pinned", static_cast<double>(a.quota.pinned_bytes));
    }
  }
  std::vector<MetricFamily> out;
  if (!used.metric.empty()) out.push_back(std::move(used));
  if (!quota.metric.empty()) out.push_back(std::move(quota));
  return out;
}

}  // namespace kvtier
