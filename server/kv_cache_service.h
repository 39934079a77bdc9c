// KvCacheService: the kvtier.v1.KvCache gRPC service on top of a TieredStore. Checks
// every request against the configured limits, maps storage errors to gRPC codes in
// one place (status_util), and never lets a partial chunk become visible.
//
// The service is registered before the store has recovered its index, so the gRPC
// server (and its health service, NOT_SERVING meanwhile) answers during start-up; until
// SetStore() every call fails with UNAVAILABLE.
//
// Thread-safety: gRPC's synchronous server calls the handlers on its thread pool, any
// number at once, and its callback API drives the Put and Get reactors; the service
// keeps no per-call state outside the handlers' stacks and the reactors, and the store
// is thread-safe. The store pointer is published once with release order and
// read with acquire order, which is all the handlers need to see a fully opened store.
#ifndef KVTIER_SERVER_KV_CACHE_SERVICE_H_
#define KVTIER_SERVER_KV_CACHE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/authenticator.h"
#include "server/lease_table.h"
#include "server/prefill_runner.h"
#include "server/region_table.h"
#include "server/rpc_metrics.h"
#include "server/send_turns.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "server/tenant_quotas.h"
#include "server/unix_listener.h"
#include "storage/io_pool.h"
#include "storage/parallel_copy.h"
#include "storage/tiered_store.h"

namespace kvtier {

struct ServiceLimits {
  uint64_t max_frame_bytes = 4ull << 20;   // Largest data field in a frame.
  uint32_t max_keys_per_request = 4096;    // Keys in one unary or Get request.
  uint64_t max_message_bytes = 5ull << 20; // gRPC's cap on one message (told to clients).
  uint32_t max_layouts = 4096;             // All tenants' layouts (a tenant's share of it).
};

// The same-host data plane, when the daemon serves one: the regions clients registered
// on the region socket, and what DataPlane() tells clients.
struct DataPlaneInfo {
  RegionTable* regions = nullptr;  // Null: no data plane (targets are FAILED_PRECONDITION).
  // Copies between the pool and regions on several threads; null: on the RPC's thread.
  ParallelCopy* copier = nullptr;
  std::string socket;              // The region socket's name.
  uint64_t instance_id = 0;
};

// Who may call, as which tenant, and how many streams at once. Without an
// authenticator every caller is the implicit tenant (admin, today's namespaces);
// without a limiter streams are not counted. Both must outlive the service.
struct ServiceGuards {
  Authenticator* auth = nullptr;
  const UnixListener* unix_peers = nullptr;  // Resolves "fd:N" peers to uids.
  StreamLimiter* streams = nullptr;
  StreamLimiter* put_streams = nullptr;  // Put streams within max_put_buffer.
  StallReaper* stalls = nullptr;  // Cancels Put, Get and Prefill calls whose client went quiet.
  SendTurns* send_turns = nullptr;  // Gets sending RAM chunks at once (get_send_turns).
  TenantQuotas* quotas = nullptr;  // Per-tenant RAM, SSD and pinned byte quotas.
  // Events subscribers, at most kMaxEventSubscribers (each tenant its quota's share);
  // null: the service counts them itself, without metrics.
  StreamLimiter* subscribers = nullptr;
  // Prefill sessions, each holding a gRPC thread (max_prefill_sessions); null: no bound
  // but max_streams.
  StreamLimiter* prefill_sessions = nullptr;
  // Runs the unary methods; null: a small pool of the service's own (tests). At most
  // `unary_waiting` calls wait for one of its threads; more are RESOURCE_EXHAUSTED.
  IoPool* unary = nullptr;
  size_t unary_waiting = 1024;
};

// Put and Get run on gRPC's callback API with raw buffers (PutReactor: one copy from
// gRPC's buffers into the pool; GetReactor: zero-copy sends). The unary methods are
// callbacks too, run on a bounded pool of the service's (ServiceGuards::unary), so that
// no thread is taken before a request has arrived whole, a call its client reset while
// it waited is not run, and past the pool's line a call is refused RESOURCE_EXHAUSTED
// with a retry hint. Prefill alone is synchronous.
namespace internal {
// Every method on gRPC's callback API but Prefill (a session holds a thread by design,
// bounded by max_prefill_sessions): Put and Get with raw buffers, the unary methods
// handed to the service's own pool (ServiceGuards::unary).
using KvCacheBase = v1::KvCache::WithCallbackMethod_RegisterLayout<
    v1::KvCache::WithCallbackMethod_Lookup<v1::KvCache::WithCallbackMethod_Pin<
        v1::KvCache::WithCallbackMethod_Unpin<v1::KvCache::WithCallbackMethod_Delete<
            v1::KvCache::WithCallbackMethod_Clear<v1::KvCache::WithCallbackMethod_Stats<
                v1::KvCache::WithCallbackMethod_ReleaseLease<
                    v1::KvCache::WithCallbackMethod_DataPlane<
                        v1::KvCache::WithCallbackMethod_Hint<
                            v1::KvCache::WithCallbackMethod_Events<
                                v1::KvCache::WithRawCallbackMethod_Put<
                                    v1::KvCache::WithRawCallbackMethod_Get<
                                        v1::KvCache::Service>>>>>>>>>>>>>;
}  // namespace internal

class KvCacheService final : public internal::KvCacheBase {
 public:
  // `metrics` (may be null) and the store given to SetStore must outlive the service.
  // `prefill` runs the Cake sessions and `leases` keeps the Lookup leases; both must
  // outlive the service.
  // `data_plane.regions`, when set, must outlive the service; so must `events` (null:
  // Events answers UNIMPLEMENTED).
  KvCacheService(ServiceLimits limits, std::string version, RpcMetrics* metrics,
                 PrefillRunner* prefill, LeaseTable* leases, DataPlaneInfo data_plane = {},
                 EventLog* events = nullptr, ServiceGuards guards = {});
  void SetStore(TieredStore* store) { store_.store(store, std::memory_order_release); }

  grpc::ServerUnaryReactor* RegisterLayout(grpc::CallbackServerContext* ctx,
      const v1::RegisterLayoutRequest* req, v1::RegisterLayoutResponse* resp) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* ctx,
      const v1::LookupRequest* req, v1::LookupResponse* resp) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* Put(grpc::CallbackServerContext* ctx,
                                                 grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Get(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Pin(grpc::CallbackServerContext* ctx,
      const v1::PinRequest* req, v1::PinResponse* resp) override;
  grpc::ServerUnaryReactor* Unpin(grpc::CallbackServerContext* ctx,
      const v1::UnpinRequest* req, v1::UnpinResponse* resp) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx,
      const v1::DeleteRequest* req, v1::DeleteResponse* resp) override;
  grpc::ServerUnaryReactor* Clear(grpc::CallbackServerContext* ctx,
      const v1::ClearRequest* req, v1::ClearResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx,
      const v1::StatsRequest* req, v1::StatsResponse* resp) override;
  grpc::Status Prefill(grpc::ServerContext* ctx, PrefillStream* stream) override;
  grpc::ServerUnaryReactor* ReleaseLease(grpc::CallbackServerContext* ctx,
      const v1::ReleaseLeaseRequest* req, v1::ReleaseLeaseResponse* resp) override;
  grpc::ServerUnaryReactor* DataPlane(grpc::CallbackServerContext* ctx,
      const v1::DataPlaneRequest* req, v1::DataPlaneResponse* resp) override;
  grpc::ServerUnaryReactor* Hint(grpc::CallbackServerContext* ctx,
      const v1::HintRequest* req, v1::HintResponse* resp) override;
  grpc::ServerWriteReactor<v1::EventBatch>* Events(grpc::CallbackServerContext* ctx,
                                                   const v1::EventsRequest* req) override;

  // Most Events subscribers at once; more are answered RESOURCE_EXHAUSTED. A named
  // tenant holds at most its quota's share of them.
  static constexpr uint32_t kMaxEventSubscribers = TenantTable::kEventSubscribers;
  // How the subscriber limiter's refusals name its bounds.
  static StreamLimiter::Naming EventSubscriberNaming() {
    return {"its maximum", "max_subscribers", "Events subscriptions"};
  }

 private:
  // The unary methods' bodies, run by Unary on the service's pool.
  grpc::Status RegisterLayoutCall(const TenantScope& tenant, const v1::RegisterLayoutRequest* req,
      v1::RegisterLayoutResponse* resp);
  grpc::Status LookupCall(const TenantScope& tenant, const v1::LookupRequest* req,
      v1::LookupResponse* resp);
  grpc::Status PinCall(const TenantScope& tenant, const v1::PinRequest* req,
      v1::PinResponse* resp);
  grpc::Status UnpinCall(const TenantScope& tenant, const v1::UnpinRequest* req,
      v1::UnpinResponse* resp);
  grpc::Status DeleteCall(const TenantScope& tenant, const v1::DeleteRequest* req,
      v1::DeleteResponse* resp);
  grpc::Status ClearCall(const TenantScope& tenant, const v1::ClearRequest* req,
      v1::ClearResponse* resp);
  grpc::Status StatsCall(const TenantScope& tenant, const v1::StatsRequest* req,
      v1::StatsResponse* resp);
  grpc::Status ReleaseLeaseCall(const TenantScope& tenant, const v1::ReleaseLeaseRequest* req,
      v1::ReleaseLeaseResponse* resp);
  grpc::Status DataPlaneCall(const TenantScope& tenant, const v1::DataPlaneRequest* req,
      v1::DataPlaneResponse* resp);
  grpc::Status HintCall(const TenantScope& tenant, const v1::HintRequest* req,
      v1::HintResponse* resp);
  // Admits the caller, then runs `call(tenant)` for a unary method on guards_.unary (the
  // service's own pool without one) and finishes the call with its status; a refused
  // admission at once, without a place in the pool's line; RESOURCE_EXHAUSTED with a
  // retry hint past that line.
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, RpcMethod method,
                                  std::function<grpc::Status(const TenantScope&)> call);
  grpc::Status RegisterLayoutImpl(TieredStore* store, const TenantScope& tenant,
                                  const v1::RegisterLayoutRequest* req,
                                  v1::RegisterLayoutResponse* resp);
  grpc::Status LookupImpl(TieredStore* store, const TenantScope& tenant, uint64_t ns,
                          const v1::LookupRequest* req,
                          v1::LookupResponse* resp);
  grpc::Status PinImpl(TieredStore* store, const TenantScope& tenant, uint64_t ns,
                       const v1::PinRequest* req, v1::PinResponse* resp);
  grpc::Status UnpinImpl(TieredStore* store, uint64_t ns, const v1::UnpinRequest* req,
                         v1::UnpinResponse* resp);
  grpc::Status DeleteImpl(TieredStore* store, uint64_t ns, const v1::DeleteRequest* req,
                          v1::DeleteResponse* resp);
  grpc::Status ClearImpl(TieredStore* store, uint64_t ns, const v1::ClearRequest* req,
                         v1::ClearResponse* resp);
  grpc::Status StatsImpl(TieredStore* store, v1::StatsResponse* resp);
  grpc::Status HintImpl(TieredStore* store, const TenantScope& tenant, const v1::HintRequest* req,
                        v1::HintResponse* resp);

  // The caller's tenant, from its credentials; on refusal the status (and, when over the
  // tenant's rate, a kvtier-retry-after-ms trailer on `ctx`). A call that stays open
  // passes `watch`: it gets the re-check of those credentials against a tenants file
  // reloaded while the call runs (empty for the implicit tenant).
  absl::StatusOr<TenantScope> Admit(grpc::ServerContextBase* ctx, StillAdmitted* watch = nullptr);
  // A place among max_streams, and among the tenant's own max_streams, for a streaming
  // call (an empty ticket without a limiter), or RESOURCE_EXHAUSTED with a
  // kvtier-retry-after-ms trailer on `ctx`.
  absl::StatusOr<StreamLimiter::Ticket> TakeStreamPlace(grpc::ServerContextBase* ctx,
                                                        const TenantScope& tenant);
  // A place on `limiter` (null: an empty ticket) for `tenant`, which may hold at most
  // `tenant_max` (0: no bound of its own), or RESOURCE_EXHAUSTED with a
  // kvtier-retry-after-ms trailer on `ctx`.
  absl::StatusOr<StreamLimiter::Ticket> TakePlace(grpc::ServerContextBase* ctx,
                                                  StreamLimiter* limiter,
                                                  const TenantScope& tenant, uint32_t tenant_max);

  // Runs `impl(store, tenant)` for an admitted caller under a metrics scope;
  // UNAVAILABLE before SetStore.
  template <typename Impl>
  grpc::Status Serve(RpcMethod method, const TenantScope& tenant, Impl impl);
  // Serve, with `check(tenant)` (an absl::Status) first, before the store is needed: a
  // request that can never succeed (a role it lacks, malformed fields) is told so while
  // the daemon is starting up too, not UNAVAILABLE ("retry").
  template <typename Check, typename Impl>
  grpc::Status ServeChecked(RpcMethod method, const TenantScope& tenant, Check check,
                            Impl impl);
  // `why` as the call's status, counted under `method`.
  grpc::Status Refuse(RpcMethod method, const absl::Status& why);

  // Once per tenants table (Authenticator::generation), at a unary call: unpins the
  // chunks of tenants it no longer lists (TenantQuotas::UnpinRevoked).
  void UnpinRevokedTenants(TieredStore* store);
  std::atomic<uint64_t> tenants_generation_{0};

  std::atomic<TieredStore*> store_{nullptr};
  RpcMetrics* const metrics_;
  PrefillRunner* const prefill_;
  LeaseTable* const leases_;
  const DataPlaneInfo data_plane_;
  EventLog* const events_;
  const ServiceGuards guards_;
  // guards_.subscribers, or one of the service's own.
  std::unique_ptr<StreamLimiter> own_subscribers_;
  StreamLimiter* const subscribers_;
  const ServiceLimits limits_;
  const std::string version_;
  const absl::Time started_ = absl::Now();
  // When guards.unary is null. Last: destroyed first, it runs (or drops) what is queued
  // while the members the calls use are still there.
  std::unique_ptr<IoPool> own_unary_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_KV_CACHE_SERVICE_H_
