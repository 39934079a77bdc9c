// Authenticator: maps each request's credentials to a tenant (TenantScope) and enforces
// the tenant's request rate.
//
// Without a tenants file every caller that got through the transport is the implicit
// tenant: admin, no rate limit, namespaces as before tenants existed. With one, a
// request must carry a credential the file lists, tried in this order:
//   1. a bearer token ("authorization: Bearer <token>" metadata); a request that sends
//      one is judged by it alone, so a wrong token is never rescued by a certificate;
//   2. a verified client certificate (mutual TLS) whose CN or a SAN is listed;
//   3. the peer uid of a Unix-domain socket connection (SO_PEERCRED).
// Anything else is UNAUTHENTICATED. Over the tenant's request rate is
// RESOURCE_EXHAUSTED with the time to wait (retry_after).
//
// The file is re-read when its modification time or size changes, checked at most once
// per `reload_check`; a file that no longer parses is logged and counted, and the last
// good table stays in force.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_SERVER_AUTHENTICATOR_H_
#define KVTIER_SERVER_AUTHENTICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/tenant_scope.h"
#include "server/tenant_table.h"
#include "storage/steady_now.h"

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Counter;
class Gauge;
}  // namespace prometheus

namespace kvtier {

// What a request presented, taken from its gRPC context by the service.
struct CallerCredentials {
  std::optional<std::string> authorization;  // The "authorization" metadata, if sent.
  std::vector<std::string> cert_identities;  // Verified client certificate CN and SANs.
  std::optional<uint32_t> unix_uid;          // Peer uid of a Unix-domain socket.
};

// For a call that stays open (a Put, Get or Prefill stream, an Events subscription):
// asked before each unit of work it starts (a chunk, a batch of events) whether the
// caller's credentials still admit it. Ok, or the error to end the call with. Empty:
// nothing to re-check (the implicit tenant).
using StillAdmitted = std::function<absl::Status()>;

struct AuthenticatorOptions {
  std::string tenants_file;  // Empty: the implicit tenant for everyone.
  absl::Duration reload_check = absl::Seconds(1);
  // Times request rates and reload checks. Monotonic: a wall clock stepped back (NTP)
  // would empty rate buckets and postpone reloads (revocations) by the step. A clock
  // that steps back anyway is tolerated: no negative refill, and a check comes due.
  std::function<absl::Time()> clock = SteadyNow;
};

class Authenticator {
 public:
  struct Denied {
    absl::Status status;
    absl::Duration retry_after = absl::ZeroDuration();  // Set with RESOURCE_EXHAUSTED.
  };
  // The scope, or why not.
  struct Result {
    std::optional<TenantScope> scope;
    Denied denied;
  };

  // Reads the tenants file, if any. Returns InvalidArgument naming the bad line.
  // `registry` (may be null) gets kvtier_tenant_requests_total.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(AuthenticatorOptions options,
                                                              prometheus::Registry* registry);

  Result Authenticate(const CallerCredentials& creds);

  // For a call that stays open (an Events subscription): whether `creds`, admitted as
  // tenant `tenant`, still are under the tenants file in force now (re-read if due).
  // Neither counted nor rate-limited. `generation` (in/out): the table the call was last
  // checked against (generation() when it was admitted); credentials are looked up
  // again only once the table has changed. Returns: Ok, Unauthenticated.
  absl::Status StillAdmits(const CallerCredentials& creds, const std::string& tenant,
                           uint64_t* generation) ABSL_LOCKS_EXCLUDED(mu_);
  // StillAdmits as a StillAdmitted for one call, admitted as `tenant` with `creds`;
  // `generation` is generation() taken before the call was admitted. Must not outlive
  // this Authenticator.
  StillAdmitted Watch(CallerCredentials creds, std::string tenant, uint64_t generation);
  // Bumped each time a tenants table is loaded.
  uint64_t generation() const ABSL_LOCKS_EXCLUDED(mu_);

  // Tenant `tenant`'s quota under the tenants file in force now (re-read if due);
  // nullopt for a tenant the file no longer lists, or without a file.
  std::optional<TenantQuota> CurrentQuota(const std::string& tenant) ABSL_LOCKS_EXCLUDED(mu_);

  // Counts a request an authenticated tenant may not make (an admin operation).
  void CountForbidden(const TenantScope& scope);

  bool enabled() const { return !options_.tenants_file.empty(); }
  // Table reloads that failed (bad file); the previous table stayed.
  uint64_t reload_failures() const;

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time last = absl::InfinitePast();
  };

  Authenticator(AuthenticatorOptions options, prometheus::Registry* registry);
  void MaybeReload(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loads the file; on success replaces the table. Returns: Ok; InvalidArgument (cannot
  // be read, does not parse, lists no tenant); Unavailable (it changed while being read:
  // a writer is at work, read it at the next check).
  absl::Status Load(bool initial) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Count(const std::string& tenant, const char* outcome);
  // The index in table_ of the tenant `creds` name, or -1 with `why` (Unauthenticated).
  int FindLocked(const CallerCredentials& creds, absl::Status* why) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const AuthenticatorOptions options_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Counter* reload_failures_metric_ = nullptr;

  mutable absl::Mutex mu_;
  std::shared_ptr<const TenantTable> table_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The file as last read (its identity, size, and change and modification times):
  // read again once any of them differs.
  std::string file_signature_ ABSL_GUARDED_BY(mu_);
  uint64_t reload_failures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_AUTHENTICATOR_H_
