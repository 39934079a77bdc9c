// TenantScope: the tenant a request runs as, and the namespaces it can reach.
//
// A client names a namespace by its public id, the layout hash that the key scheme
// starts from (see the proto). The store keys chunks by an internal id:
//   - the implicit tenant (no tenants file: today's single-tenant daemon) uses the
//     public id itself, so its data directory reads the same as before tenants existed;
//   - a named tenant uses the first 8 bytes of SHA-256("kvtier-tenant-namespace-v1",
//     tenant, public id). Two tenants registering the same layout get two namespaces,
//     and since every id a tenant can name is mapped through its own name, no request
//     of one tenant can address another's chunks, layouts, leases or hints. SHA-256
//     makes it infeasible to craft a layout whose internal id lands on someone else's.
//
// Thread-safety: a value type.
#ifndef KVTIER_SERVER_TENANT_SCOPE_H_
#define KVTIER_SERVER_TENANT_SCOPE_H_

#include <cstdint>
#include <string>

#include "server/tenant_table.h"

namespace kvtier {

class TenantScope {
 public:
  // The single tenant of a daemon without a tenants file: admin, identity mapping.
  static TenantScope Implicit() { return TenantScope("", /*admin=*/true, /*implicit=*/true, {}); }
  static TenantScope Named(std::string tenant, bool admin, TenantQuota quota = {}) {
    return TenantScope(std::move(tenant), admin, /*implicit=*/false, quota);
  }

  // The store's id of this tenant's namespace `public_ns` (0 stays 0: "none").
  uint64_t Internal(uint64_t public_ns) const;

  // Scopes a free-form client name (the Hint client_id) to this tenant.
  std::string ScopedName(const std::string& name) const;

  const std::string& tenant() const { return tenant_; }  // "" for the implicit tenant.
  bool admin() const { return admin_; }
  bool implicit() const { return implicit_; }
  // The tenant's byte quotas as the tenants file said when the request arrived.
  const TenantQuota& quota() const { return quota_; }

 private:
  TenantScope(std::string tenant, bool admin, bool implicit, TenantQuota quota)
      : tenant_(std::move(tenant)), admin_(admin), implicit_(implicit), quota_(quota) {}

  std::string tenant_;
  bool admin_;
  bool implicit_;
  TenantQuota quota_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TENANT_SCOPE_H_
