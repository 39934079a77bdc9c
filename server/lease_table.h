// LeaseTable: Lookup leases. A Lookup that asks for one holds its prefix hits that are
// in the RAM pool (each as a ChunkView, which keeps the pool from evicting it) until a
// Get names the lease, the client releases it, or it expires, whichever comes first.
// An engine asks "how many tokens can I load" before it allocates and loads; the lease
// makes that answer hold until the load.
//
// Bounded: at most max_leases live leases and max_held_bytes of chunks held by them
// all (so leases cannot starve puts the way unbounded pins could), a tenant with a
// max_leases of its own at most that many, and a named tenant at most its equal share
// of max_held_bytes among the tenants file's tenants (so that one tenant's leases
// cannot take every byte and leave the others none). A Lookup past either
// bound gets no lease (lease_id 0) rather than an error: its answer is still right, it
// is just not held. Expired leases are dropped by Expire(), which the service calls on
// every Lookup, Put and Get, and by Grant itself.
//
// Lease ids are random 64-bit values (never 0), so one client cannot guess another's.
//
// Thread-safety: thread-safe (one mutex).
#ifndef KVTIER_SERVER_LEASE_TABLE_H_
#define KVTIER_SERVER_LEASE_TABLE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/tiered_store.h"
#include "storage/steady_now.h"

namespace kvtier {

struct LeaseTableOptions {
  uint32_t max_leases = 65536;                  // Live leases at once.
  uint64_t max_held_bytes = 512ull << 20;       // Chunk bytes held by all leases.
  absl::Duration max_ttl = absl::Minutes(5);    // Longer requests are cut to this.
  std::function<absl::Time()> now = SteadyNow;  // Monotonic (see SteadyNow).

  absl::Status Validate() const;
};

struct LeaseTableStats {
  uint64_t live = 0;
  uint64_t held_bytes = 0;
  uint64_t granted = 0;   // Totals since start.
  uint64_t refused = 0;   // Past max_leases, max_held_bytes or the tenant's max_leases.
  // Of those, past the tenant's own max_leases or its share of max_held_bytes.
  uint64_t tenant_refused = 0;
  uint64_t expired = 0;
  uint64_t taken = 0;     // Ended by the Get that named them.
  uint64_t released = 0;  // Ended by ReleaseLease.
};

// A chunk a lease holds, and which chunk it is (for Forget).
struct LeasedChunk {
  ChunkId id;
  ChunkView view;
};

class LeaseTable {
 public:
  explicit LeaseTable(LeaseTableOptions options);

  // Holds `held` (chunks of namespace `ns`) for `ttl` (cut to max_ttl), for `tenant`
  // ("" for the implicit tenant), which may hold at most `tenant_max` live leases (0: no
  // bound of its own) and, named, at most max_held_bytes / `tenants` bytes of chunks
  // (`tenants`: how many share max_held_bytes; at least 1). Returns the lease id, or 0
  // when the lease would exceed a bound (counted as refused).
  uint64_t Grant(uint64_t ns, std::vector<LeasedChunk> held, absl::Duration ttl,
                 const std::string& tenant = "", uint32_t tenant_max = 0,
                 uint32_t tenants = 1);
  // Live leases of a named tenant, and the chunk bytes they hold.
  uint32_t live(const std::string& tenant) const;
  uint64_t held_bytes(const std::string& tenant) const;
  // Ends the lease and hands its chunks to the caller (a Get, which holds them until it
  // ends). Returns: Ok, NotFound (unknown, expired, ended, or of another namespace).
  absl::StatusOr<std::vector<ChunkView>> Take(uint64_t ns, uint64_t id);
  // Ends the lease. Returns false if there was none (unknown, expired, ended, or of
  // another namespace).
  bool Release(uint64_t ns, uint64_t id);
  // Lets go of the chunks `ids` (of namespace `ns`) wherever leases hold them: they
  // were deleted, and a lease must not keep their bytes in the pool (uncounted by any
  // quota) for its life. The leases stay, holding the rest.
  void Forget(uint64_t ns, absl::Span<const ChunkId> ids);
  // The same for every chunk of `ns` (it was cleared).
  void ForgetNamespace(uint64_t ns);
  // Drops expired leases; returns how many.
  uint64_t Expire();
  // Ends every lease, giving their chunks back: before the store they hold chunks of is
  // destroyed (a held chunk gives its slots back to the pool when dropped). Returns how
  // many there were.
  uint64_t Clear();

  LeaseTableStats GetStats() const;

 private:
  struct Lease {
    uint64_t ns = 0;
    std::string tenant;
    absl::Time expires;
    uint64_t bytes = 0;
    std::vector<LeasedChunk> held;
  };

  // Removes lease `it` and returns its chunks.
  std::vector<ChunkView> EraseLocked(absl::flat_hash_map<uint64_t, Lease>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t ExpireLocked(std::vector<ChunkView>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the chunks of namespace `ns` that `forget` names out of every lease into
  // `dropped`, taking their bytes off the counts.
  void ForgetLocked(uint64_t ns, absl::FunctionRef<bool(const ChunkId&)> forget,
                    std::vector<ChunkView>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LeaseTableOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  struct TenantHold {
    uint32_t leases = 0;
    uint64_t bytes = 0;
  };
  // Named tenants' live leases; a tenant leaves the map when it has none.
  absl::flat_hash_map<std::string, TenantHold> by_tenant_ ABSL_GUARDED_BY(mu_);
  absl::Time next_expiry_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
  LeaseTableStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_LEASE_TABLE_H_
