// TenantQuotas: each named tenant's byte quotas (TenantQuota, from the tenants file) on
// the store, and the use and refusals that the metrics show per tenant.
//
// A tenant's usage is the payload bytes of the chunks in the namespaces it has named
// since the daemon started (its internal namespaces, TenantScope::Internal), per tier:
// held in the RAM pool, on the SSD tier, and pinned in RAM now. The quotas act like a
// partition of the cache, not a wall: a put that would take the tenant past its RAM or
// SSD quota first evicts the tenant's own chunks from that tier, in the tier's policy
// order, so other tenants never lose a chunk to it; only when what the tenant holds
// there cannot be evicted yet (pinned, being read, or in write-back not yet on SSD) is
// the put refused RESOURCE_EXHAUSTED (it may retry: pins expire, reads end, the flusher
// catches up). A chunk larger than a quota can never fit: INVALID_ARGUMENT. A pin past
// the pinned quota is RESOURCE_EXHAUSTED, checked under the pool's lock with the pin.
//
// The RAM quota also holds for reads that bring a tenant's chunks into RAM from a tier
// below (Get, Pin, a Hint's prefetch, the shared tier): AdmitPromotion, the store's
// admit_promotion, makes room among the tenant's own chunks the same way, and where
// there is none the chunk is served without being kept in RAM.
//
// RAM and SSD checks happen when a put is admitted, so puts in flight at the same time
// can take a tenant past its quota by at most one chunk each (bounded by max_streams);
// the next put evicts the excess. A namespace the tenant last used before a restart
// counts from the tenant's first request naming it.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_SERVER_TENANT_QUOTAS_H_
#define KVTIER_SERVER_TENANT_QUOTAS_H_

#include <prometheus/collectable.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/tenant_scope.h"
#include "storage/chunk_id.h"
#include "storage/tiered_store.h"

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Counter;
}  // namespace prometheus

namespace kvtier {

class TenantQuotas final : public prometheus::Collectable {
 public:
  // `registry` (may be null) gets kvtier_tenant_quota_refusals_total and
  // kvtier_tenant_quota_evicted_bytes_total; register this object itself as a
  // collectable for kvtier_tenant_bytes and kvtier_tenant_quota_bytes.
  explicit TenantQuotas(prometheus::Registry* registry);

  // The store the collector reads; set once it is open.
  void SetStore(const TieredStore* store) { store_.store(store, std::memory_order_release); }

  // Where a tenant's quota in force now comes from (the Authenticator's table, which a
  // reload changes), by tenant name; nullopt, or unset: the quota its scope was admitted
  // with. A call that stays open (a Put stream) is then held to the quota of the file
  // in force, not the one it was admitted under. Set before the first request.
  using QuotaSource = std::function<std::optional<TenantQuota>(const std::string& tenant)>;
  void SetQuotaSource(QuotaSource source) { source_ = std::move(source); }

  // Records that tenant `t` uses internal namespace `ns` (idempotent; nothing for the
  // implicit tenant).
  void Bind(const TenantScope& t, uint64_t ns) ABSL_LOCKS_EXCLUDED(mu_);

  // Before tenant `t` registers namespace `ns`: binds it if the tenant holds fewer than
  // `max` namespaces (or this one already). The first time in this process, the
  // tenant's namespaces are first read from `registered` (the layouts the store holds,
  // kept from earlier runs: layouts are never unregistered, so a restart must not reset
  // the count). Returns whether this call bound it (for UnbindLayout if the registration
  // then fails), or FailedPrecondition (at its share: retrying cannot help).
  absl::StatusOr<bool> AdmitLayout(
      const TenantScope& t, uint64_t ns, uint32_t max,
      absl::FunctionRef<std::vector<std::pair<uint64_t, LayoutSpec>>()> registered);
  // Undoes an AdmitLayout that bound `ns` for a registration that failed, so that
  // refused layouts do not use up the tenant's share.
  void UnbindLayout(const TenantScope& t, uint64_t ns);

  // Before a put of a `bytes`-byte chunk into `ns`: makes room within the tenant's RAM
  // and SSD quotas. Returns: Ok, InvalidArgument (larger than a quota),
  // ResourceExhausted (the tenant's chunks over quota cannot be evicted yet),
  // Unavailable (SSD rows could not be deleted).
  absl::Status AdmitPut(TieredStore* store, const TenantScope& t, uint64_t ns, uint64_t bytes);

  // TieredStoreOptions::admit_promotion: before a read brings a `bytes`-byte chunk of
  // internal namespace `ns` into RAM, makes room within its tenant's RAM quota by
  // evicting the tenant's own chunks; false if there is none (the chunk is larger than
  // the quota, or what the tenant holds cannot be evicted yet). True for a namespace no
  // tenant with a RAM quota has named.
  bool AdmitPromotion(TieredStore* store, uint64_t ns, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // TieredStore::Pin within the tenant's pinned quota.
  absl::Status Pin(TieredStore* store, const TenantScope& t, const ChunkId& id,
                   absl::Duration ttl);
  // TieredStore::CheckPinsCanFit within the tenant's pinned quota.
  absl::Status CheckPins(TieredStore* store, const TenantScope& t,
                         absl::Span<const ChunkId> ids);

  // Unpins the chunks of tenants the quota source no longer knows (removed from the
  // tenants file): no RPC can reach their namespaces any more, and pins without an
  // expiry would hold their share of the pool until a restart. Returns how many.
  uint64_t UnpinRevoked(TieredStore* store) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct Account {
    absl::flat_hash_set<uint64_t> namespaces;
    bool layouts_read = false;  // The store's layouts of this tenant are in `namespaces`.
    TenantQuota quota;  // As of the tenant's latest request.
  };
  // The quota in force for `t` (source_, else its scope's). Takes no lock of this object.
  TenantQuota QuotaOf(const TenantScope& t) const;
  // Binds `ns` to the tenant, recording `q` as its quota.
  void BindWith(const TenantScope& t, const TenantQuota& q, uint64_t ns)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Binds (recording `q` as the tenant's quota) and returns a copy of its namespaces.
  absl::flat_hash_set<uint64_t> BindAndList(const TenantScope& t, const TenantQuota& q,
                                            uint64_t ns);
  // The pin budget of a tenant with quota `q` (a pinned or RAM one), over `namespaces`;
  // nullopt when neither is set.
  static std::optional<HostPool::PinBudget> PinBudgetOf(
      const TenantQuota& q, const absl::flat_hash_set<uint64_t>& namespaces);
  absl::Status Fit(TieredStore* store, const TenantScope& t,
                   const absl::flat_hash_set<uint64_t>& ns, Tier tier, uint64_t quota,
                   uint64_t bytes);
  // Evicts tenant `tenant`'s chunks (namespaces `ns`) from `tier` until `bytes` more fit
  // its `quota` (at most `quota`); returns what it holds there afterwards.
  absl::StatusOr<uint64_t> MakeRoom(TieredStore* store, const std::string& tenant,
                                    const absl::flat_hash_set<uint64_t>& ns, Tier tier,
                                    uint64_t quota, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Refused(const std::string& tenant, const char* quota);

  QuotaSource source_;  // Set before serving; read-only after.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Account> accounts_ ABSL_GUARDED_BY(mu_);
  // Each bound namespace's tenant (a key of accounts_).
  absl::flat_hash_map<uint64_t, std::string> owners_ ABSL_GUARDED_BY(mu_);
  std::atomic<const TieredStore*> store_{nullptr};
  prometheus::Family<prometheus::Counter>* refusals_ = nullptr;
  prometheus::Family<prometheus::Counter>* evicted_ = nullptr;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TENANT_QUOTAS_H_
