// PrefillRunner: the daemon side of the Cake session (rpc Prefill; the contract is in
// kvtier.proto). One runner serves every session and owns what they share: the
// estimators, the daemon-wide streaming limit and the gate on concurrent SSD reads.
//
// A session runs on three threads: the gRPC handler thread streams chunks backward
// from h-1; a reader thread takes the worker's Progress messages (and fits its compute
// cost a + b*i from their timing); a prefetcher reads chunks in streaming order up to
// `prefetch_window` ahead, so a chunk on SSD is read into RAM while the one before it is
// being sent.
//
// Fairness: sessions share bandwidth per frame, round robin. Each session holds at most
// one reservation on the daemon-wide token bucket and one ticket at the SSD gate, both
// granted in arrival order, so N active sessions each get 1/N and a short request's
// stream takes about N times its solo time however long the others are. We chose this
// over shortest-remaining-first, which minimises mean time to first token but starves
// long prompts under steady load; the planner already shortens every session's streamed
// tail to what computation cannot cover.
//
// Thread-safety: Run() is called concurrently, once per session.
#ifndef KVTIER_SERVER_PREFILL_RUNNER_H_
#define KVTIER_SERVER_PREFILL_RUNNER_H_

#include <atomic>
#include <cstdint>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "scheduler/prefill_estimators.h"
#include "scheduler/token_bucket.h"
#include "server/authenticator.h"
#include "server/prefill_metrics.h"
#include "server/region_table.h"
#include "server/stall_reaper.h"
#include "server/tenant_scope.h"
#include "storage/tiered_store.h"

namespace kvtier {

struct PrefillRunnerOptions {
  uint64_t max_frame_bytes = 4ull << 20;
  uint32_t max_keys = 4096;
  double bandwidth_limit = 0;  // Daemon-wide streaming cap, bytes/s; 0: none.
  int ssd_read_concurrency = 2;  // SSD reads in flight across all sessions.
  uint32_t prefetch_window = 2;  // Chunks read ahead of the one being sent.
  // After Done, how long the worker has to half-close before the call is cancelled.
  absl::Duration linger = absl::Seconds(5);
  PrefillEstimatorOptions estimators;
};

using PrefillStream =
    grpc::ServerReaderWriter<v1::PrefillServerMessage, v1::PrefillClientMessage>;

class PrefillRunner {
 public:
  // `metrics` may be null.
  PrefillRunner(PrefillRunnerOptions options, PrefillMetrics* metrics);

  // The session's first message, read (`stalls`, may be null, cancels the call when
  // its worker sends none) and checked for all that needs no store: the keys, the
  // compute estimate, and the target's region in `regions` (may be null: no data plane)
  // but for its offsets. Asked before the session waits for the store or takes a place,
  // so that an open that can never succeed is told so, not to retry (UNAVAILABLE while
  // starting up, RESOURCE_EXHAUSTED past max_streams). Returns: Ok, InvalidArgument
  // (naming the field; a stream that ends before its open), FailedPrecondition (no
  // data plane, unknown region), PermissionDenied (the region's token), Cancelled.
  absl::StatusOr<v1::PrefillOpen> ReadOpen(grpc::ServerContext* ctx, PrefillStream* stream,
                                           RegionTable* regions = nullptr,
                                           StallReaper* stalls = nullptr) const;

  // What of `open` (as ReadOpen returned it) needs `store` (not null) but no side
  // effect: its namespace (`scope`'s), and its target's offsets in its region (and, for
  // a worker's GPU memory, a GPU). Asked before the session takes a place, for the same
  // reason. Returns: Ok, NotFound (namespace), InvalidArgument (offsets),
  // FailedPrecondition (no GPU, no data plane, unknown region), PermissionDenied.
  absl::Status CheckOpen(TieredStore* store, const v1::PrefillOpen& open, RegionTable* regions,
                         const TenantScope& scope) const;

  // Serves the session `open` (as ReadOpen returned it) began. `regions` (may be null:
  // no data plane) serves PrefillOpen.target; `scope` maps the session's namespace to
  // the caller's tenant; `stalls` (may be null) cancels the session when its worker
  // stops reading. `on_namespace` (may be empty) is told the store's namespace once the
  // Open names it (the tenant's quotas count it from then on). `still_admitted` (may be
  // empty) is asked before each chunk is streamed; an error ends the session with it.
  grpc::Status Run(TieredStore* store, grpc::ServerContext* ctx, PrefillStream* stream,
                   const v1::PrefillOpen& open, RegionTable* regions = nullptr,
                   const TenantScope& scope = TenantScope::Implicit(),
                   StallReaper* stalls = nullptr,
                   const std::function<void(uint64_t)>& on_namespace = nullptr,
                   StillAdmitted still_admitted = nullptr);

  // From now on sessions stop streaming and end with Done{SHUTTING_DOWN}.
  void BeginShutdown() { shutting_down_.store(true, std::memory_order_relaxed); }
  bool shutting_down() const { return shutting_down_.load(std::memory_order_relaxed); }

  PrefillEstimators& estimators() { return estimators_; }
  const PrefillRunnerOptions& options() const { return options_; }
  TokenBucket& bandwidth_limit() { return limit_; }
  FairGate& ssd_gate() { return ssd_gate_; }
  PrefillMetrics* metrics() { return metrics_; }

 private:
  const PrefillRunnerOptions options_;
  PrefillMetrics* const metrics_;
  PrefillEstimators estimators_;
  TokenBucket limit_;
  FairGate ssd_gate_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_PREFILL_RUNNER_H_
