// TenantTable: who may call kvtierd and as which tenant, parsed from the tenants file
// (option tenants_file). One directive per line; '#' starts a comment:
//
//   tenant NAME [role=user|admin] [requests_per_second=N] [burst=N]
//               [ram_quota=SIZE] [ssd_quota=SIZE] [pinned_quota=SIZE]
//               [max_streams=N] [max_leases=N] [max_subscribers=N]
//   token  NAME sha256:HEX        a bearer token ("authorization: Bearer <token>") whose
//                                 SHA-256 is HEX (64 hex digits); the file never holds
//                                 the token itself
//   cert   NAME IDENTITY          a client certificate (mutual TLS) whose subject CN or
//                                 one of whose subject alternative names is IDENTITY
//   uid    NAME UID               a peer on the Unix-domain socket with this user id
//
// A tenant is declared once before its credentials; a credential names one tenant.
// NAME is 1 to 64 of [A-Za-z0-9._-]. requests_per_second 0 (the default) is unlimited;
// burst defaults to one second's worth. Quotas bound the payload bytes of the tenant's
// chunks in the RAM pool, on the SSD tier and pinned (SIZE like 512MiB, 4GiB or a byte
// count; 0, the default, is unlimited); TenantQuotas enforces them. max_streams bounds
// the tenant's streaming calls open at once (Put, Get, Prefill, Events; StreamLimiter)
// and max_leases its live Lookup leases (LeaseTable), each within the daemon-wide
// bound, so that one tenant cannot take them all (a tenant's leases also hold at most an
// equal share of max_lease_bytes); 0, the default, is no bound of its
// own. max_subscribers bounds its Events subscriptions (1 to kEventSubscribers); unset,
// each tenant gets an equal share of the daemon's kEventSubscribers.
//
// Thread-safety: immutable once parsed.
#ifndef KVTIER_SERVER_TENANT_TABLE_H_
#define KVTIER_SERVER_TENANT_TABLE_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

using Sha256Digest = std::array<uint8_t, 32>;

// SHA-256 of `data` (OpenSSL).
Sha256Digest Sha256(absl::string_view data);

// Per-tenant quotas; 0 is unlimited.
struct TenantQuota {
  uint64_t ram_bytes = 0;
  uint64_t ssd_bytes = 0;
  uint64_t pinned_bytes = 0;
  uint32_t streams = 0;  // Streaming calls open at once.
  uint32_t leases = 0;   // Live Lookup leases.
  // Events subscriptions at once, within TenantTable::kEventSubscribers. Never 0 once
  // parsed: unset, an equal share of the daemon's among the file's tenants.
  uint32_t subscribers = 0;
  // Layouts (namespaces) it may register; 0: an equal share of the daemon's max_layouts
  // among the file's `tenants`.
  uint32_t layouts = 0;
  uint32_t tenants = 1;  // Tenants the file names (for that share).
  // Whether a byte quota is set (TenantQuotas has work to do).
  bool any() const { return ram_bytes != 0 || ssd_bytes != 0 || pinned_bytes != 0; }
};

struct TenantSpec {
  std::string name;
  bool admin = false;
  double requests_per_second = 0;  // 0: unlimited.
  double burst = 0;                // Requests an idle tenant may make at once.
  TenantQuota quota;
};

class TenantTable {
 public:
  // Events subscriptions the daemon holds at once, all tenants together.
  static constexpr uint32_t kEventSubscribers = 1024;

  // Returns InvalidArgument naming the line and what is wrong with it.
  static absl::StatusOr<TenantTable> Parse(absl::string_view text);

  // Index into tenants(), or -1.
  int FindToken(absl::string_view token) const;
  int FindCertIdentity(absl::string_view identity) const;
  int FindUid(uint32_t uid) const;
  int FindTenant(absl::string_view name) const;

  const std::vector<TenantSpec>& tenants() const { return tenants_; }

 private:
  struct DigestHash {
    size_t operator()(const Sha256Digest& d) const;
  };
  std::vector<TenantSpec> tenants_;
  absl::flat_hash_map<std::string, int> by_name_;
  absl::flat_hash_map<Sha256Digest, int, DigestHash> by_token_;
  absl::flat_hash_map<std::string, int> by_cert_;
  absl::flat_hash_map<uint32_t, int> by_uid_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TENANT_TABLE_H_
