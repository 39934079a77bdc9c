#include "server/device_get_reactor.h"
#include "server/kv_cache_service.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/events_reactor.h"
#include "server/get_reactor.h"
#include "server/put_reactor.h"
#include "server/refused_reactor.h"
#include "server/status_util.h"
#include "client/layout_convert.h"
#include "storage/log.h"

namespace kvtier {
namespace {

using google::protobuf::RepeatedPtrField;

// Bounds a request's keys and checks each is a key: what needs no store, so asked
// before the store is (while starting up a malformed request is InvalidArgument, not
// "retry shortly"). Errors: InvalidArgument naming the bad key.
absl::Status CheckKeys(const RepeatedPtrField<std::string>& keys, uint32_t max_keys) {
  if (keys.size() > static_cast<int>(max_keys)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: ", keys.size(), " keys in one request, more than max_keys_per_request (",
        max_keys, "); split the request"));
  }
  for (int i = 0; i < keys.size(); ++i) {
    if (auto key = ChunkKey::FromBytes(keys[i]); !key.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("keys[", i, "]: ", key.status().message()));
    }
  }
  return absl::OkStatus();
}

// Parses and bounds a request's keys. Errors: InvalidArgument naming the bad key.
absl::StatusOr<std::vector<ChunkId>> ParseKeys(uint64_t ns, const RepeatedPtrField<std::string>& keys,
                                               uint32_t max_keys) {
  if (absl::Status s = CheckKeys(keys, max_keys); !s.ok()) return s;
  std::vector<ChunkId> ids;
  ids.reserve(keys.size());
  for (const std::string& key : keys) ids.push_back(ChunkId{ns, *ChunkKey::FromBytes(key)});
  return ids;
}

v1::Tier ToProtoTier(Tier t) { return static_cast<v1::Tier>(static_cast<int>(t)); }

// Checks that `ns` is registered and returns its layout. Errors: NotFound.
absl::StatusOr<LayoutSpec> RequireNamespace(TieredStore* store, uint64_t ns) {
  return store->FindLayout(ns);
}

}  // namespace

KvCacheService::KvCacheService(ServiceLimits limits, std::string version, RpcMetrics* metrics,
                               PrefillRunner* prefill, LeaseTable* leases,
                               DataPlaneInfo data_plane, EventLog* events,
                               ServiceGuards guards)
    : metrics_(metrics),
      prefill_(prefill),
      leases_(leases),
      data_plane_(std::move(data_plane)),
      events_(events),
      guards_(guards),
      own_subscribers_(guards.subscribers != nullptr
                           ? nullptr
                           : std::make_unique<StreamLimiter>(kMaxEventSubscribers, nullptr,
                                                             "event_subscribers",
                                                             EventSubscriberNaming())),
      subscribers_(guards.subscribers != nullptr ? guards.subscribers : own_subscribers_.get()),
      limits_(limits),
      version_(std::move(version)),
      own_unary_(guards.unary != nullptr ? nullptr : std::make_unique<IoPool>(4)) {}

absl::StatusOr<TenantScope> KvCacheService::Admit(grpc::ServerContextBase* ctx,
                                                  StillAdmitted* watch) {
  std::optional<UnixListener::Connection> unix_peer;
  if (guards_.unix_peers != nullptr) {
    unix_peer = guards_.unix_peers->Find(ctx->peer());
    if (unix_peer.has_value() && !unix_peer->refusal.ok()) return unix_peer->refusal;
  }
  if (guards_.auth == nullptr || !guards_.auth->enabled()) return TenantScope::Implicit();
  CallerCredentials creds;
  const auto& metadata = ctx->client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    creds.authorization = std::string(it->second.data(), it->second.size());
  }
  if (std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
      auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
      for (const grpc::string_ref& v : auth->FindPropertyValues(property)) {
        creds.cert_identities.emplace_back(v.data(), v.size());
      }
    }
  }
  if (unix_peer.has_value()) creds.unix_uid = unix_peer->uid;
  // Taken first: a table loaded between it and the admission is checked at once.
  const uint64_t generation = guards_.auth->generation();
  Authenticator::Result r = guards_.auth->Authenticate(creds);
  if (r.scope.has_value()) {
    if (watch != nullptr && !r.scope->implicit()) {
      *watch = guards_.auth->Watch(std::move(creds), r.scope->tenant(), generation);
    }
    return *std::move(r.scope);
  }
  if (r.denied.retry_after > absl::ZeroDuration()) {
    ctx->AddTrailingMetadata(
        "kvtier-retry-after-ms",
        absl::StrCat(absl::ToInt64Milliseconds(absl::Ceil(r.denied.retry_after, absl::Milliseconds(1)))));
  }
  return r.denied.status;
}

absl::StatusOr<StreamLimiter::Ticket> KvCacheService::TakePlace(grpc::ServerContextBase* ctx,
                                                                 StreamLimiter* limiter,
                                                                 const TenantScope& tenant,
                                                                 uint32_t tenant_max) {
  if (limiter == nullptr) return StreamLimiter::Ticket();
  absl::StatusOr<StreamLimiter::Ticket> place = limiter->TryAcquire(tenant.tenant(), tenant_max);
  if (!place.ok()) ctx->AddTrailingMetadata("kvtier-retry-after-ms", "100");
  return place;
}

absl::StatusOr<StreamLimiter::Ticket> KvCacheService::TakeStreamPlace(
    grpc::ServerContextBase* ctx, const TenantScope& tenant) {
  return TakePlace(ctx, guards_.streams, tenant, tenant.quota().streams);
}

template <typename Impl>
grpc::Status KvCacheService::Serve(RpcMethod method, const TenantScope& tenant, Impl impl) {
  return ServeChecked(
      method, tenant, [](const TenantScope&) { return absl::OkStatus(); }, impl);
}

void KvCacheService::UnpinRevokedTenants(TieredStore* store) {
  if (guards_.auth == nullptr || guards_.quotas == nullptr || !guards_.auth->enabled()) return;
  const uint64_t generation = guards_.auth->generation();
  uint64_t seen = tenants_generation_.load(std::memory_order_acquire);
  // One caller per new tenants table does it.
  if (generation == seen ||
      !tenants_generation_.compare_exchange_strong(seen, generation, std::memory_order_acq_rel)) {
    return;
  }
  if (const uint64_t n = guards_.quotas->UnpinRevoked(store); n > 0) {
    LogInfo("unpinned ", n, " chunks of tenants the tenants file no longer lists");
  }
}

template <typename Check, typename Impl>
grpc::Status KvCacheService::ServeChecked(RpcMethod method, const TenantScope& tenant,
                                          Check check, Impl impl) {
  RpcMetrics::Scope scope(metrics_, method);
  if (absl::Status c = check(tenant); !c.ok()) return scope.Done(ToGrpcStatus(c));
  TieredStore* store = store_.load(std::memory_order_acquire);
  if (store == nullptr) {
    return scope.Done(ToGrpcStatus(absl::UnavailableError(
        "kvtierd is starting up (recovering the SSD tier's index); retry shortly")));
  }
  UnpinRevokedTenants(store);
  return scope.Done(impl(store, tenant));
}

grpc::Status KvCacheService::RegisterLayoutCall(const TenantScope& tenant, const v1::RegisterLayoutRequest* req,
                                            v1::RegisterLayoutResponse* resp) {
  return ServeChecked(
      RpcMethod::kRegisterLayout, tenant,
      [&](const TenantScope&) {
        if (!req->has_layout()) return absl::InvalidArgumentError("layout: required");
        return LayoutFromProto(req->layout()).status();
      },
      [&](TieredStore* store, const TenantScope& t) {
        return RegisterLayoutImpl(store, t, req, resp);
      });
}
grpc::Status KvCacheService::LookupCall(const TenantScope& tenant, const v1::LookupRequest* req,
                                    v1::LookupResponse* resp) {
  return ServeChecked(
      RpcMethod::kLookup, tenant,
      [&](const TenantScope&) { return CheckKeys(req->keys(), limits_.max_keys_per_request); },
      [&](TieredStore* store, const TenantScope& t) {
        return LookupImpl(store, t, t.Internal(req->namespace_id()), req, resp);
      });
}
grpc::ServerReadReactor<grpc::ByteBuffer>* KvCacheService::Put(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response) {
  StillAdmitted still_admitted;
  absl::StatusOr<TenantScope> tenant = Admit(ctx, &still_admitted);
  if (!tenant.ok()) return new RefusedReader(metrics_, RpcMethod::kPut, ToGrpcStatus(tenant.status()));
  absl::StatusOr<StreamLimiter::Ticket> place = TakeStreamPlace(ctx, *tenant);
  if (!place.ok()) return new RefusedReader(metrics_, RpcMethod::kPut, ToGrpcStatus(place.status()));
  leases_->Expire();  // Expired leases give their RAM back before this put needs it.
  auto* reactor = new PutReactor(ctx, response, store_.load(std::memory_order_acquire), metrics_,
                                 data_plane_.regions, data_plane_.copier, limits_.max_frame_bytes,
                                 *std::move(tenant));
  // gRPC calls OnDone only after this returns.
  reactor->Hold(*std::move(place));
  reactor->WatchForStalls(guards_.stalls);
  reactor->EnforceQuotas(guards_.quotas);
  reactor->WatchAdmission(std::move(still_admitted));
  // Within max_put_buffer: a place now, or in line for one (no thread waits), or
  // RESOURCE_EXHAUSTED with a retry hint.
  reactor->Begin(guards_.put_streams);
  return reactor;
}
grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheService::Get(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  StillAdmitted still_admitted;
  absl::StatusOr<TenantScope> tenant = Admit(ctx, &still_admitted);
  if (!tenant.ok()) {
    return new RefusedWriter<grpc::ByteBuffer>(metrics_, RpcMethod::kGet,
                                               ToGrpcStatus(tenant.status()));
  }
  // Parsed once here: a target in a worker's GPU memory takes the device path;
  // everything else the streamed one.
  grpc::Slice flat;
  v1::GetRequest req;
  const bool parsed = request->DumpToSingleSlice(&flat).ok() &&
                      req.ParseFromArray(flat.begin(), static_cast<int>(flat.size()));
  // From here on the request names the store's namespace (the tenant's own), which its
  // quotas count from now on (reads into RAM included).
  if (parsed) req.set_namespace_id(tenant->Internal(req.namespace_id()));
  TieredStore* const store = store_.load(std::memory_order_acquire);
  // A request that can never succeed is refused as such before it waits for a place.
  if (absl::Status s = CheckGet(store, data_plane_.regions, parsed ? &req : nullptr,
                                limits_.max_frame_bytes, limits_.max_keys_per_request);
      !s.ok()) {
    return new RefusedWriter<grpc::ByteBuffer>(metrics_, RpcMethod::kGet, ToGrpcStatus(s));
  }
  absl::StatusOr<StreamLimiter::Ticket> place = TakeStreamPlace(ctx, *tenant);
  if (!place.ok()) {
    return new RefusedWriter<grpc::ByteBuffer>(metrics_, RpcMethod::kGet,
                                               ToGrpcStatus(place.status()));
  }
  if (guards_.quotas != nullptr && !tenant->implicit() && store != nullptr) {
    guards_.quotas->Bind(*tenant, req.namespace_id());  // CheckGet found its layout.
  }
  if (parsed && req.has_target() && data_plane_.regions != nullptr &&
      data_plane_.regions->IsDevice(req.target().region_id())) {
    return new DeviceGetReactor(ctx, req, store_.load(std::memory_order_acquire), metrics_,
                                leases_, data_plane_.regions, limits_.max_frame_bytes,
                                limits_.max_keys_per_request, *std::move(place),
                                guards_.stalls, std::move(still_admitted));
  }
  return new GetReactor(ctx, parsed ? &req : nullptr, store_.load(std::memory_order_acquire),
                        metrics_, leases_, data_plane_.regions, data_plane_.copier,
                        limits_.max_frame_bytes, limits_.max_keys_per_request,
                        *std::move(place), guards_.stalls, guards_.send_turns,
                        std::move(still_admitted));
}

grpc::Status KvCacheService::DataPlaneCall(const TenantScope& tenant, const v1::DataPlaneRequest* req,
                                       v1::DataPlaneResponse* resp) {
  RpcMetrics::Scope scope(metrics_, RpcMethod::kDataPlane);
  resp->set_max_frame_bytes(static_cast<uint32_t>(limits_.max_frame_bytes));
  if (TieredStore* store = store_.load(std::memory_order_acquire);
      store != nullptr && req->namespace_id() != 0) {
    if (auto layout = store->FindLayout(tenant.Internal(req->namespace_id())); layout.ok()) {
      resp->set_chunk_bytes(layout->ChunkBytes());
      resp->set_num_layers(layout->num_layers);
    }
  }
  if (data_plane_.regions != nullptr) {
    resp->set_region_socket(data_plane_.socket);
    resp->set_instance_id(data_plane_.instance_id);
    resp->set_max_region_bytes(data_plane_.regions->options().max_region_bytes);
    resp->set_max_regions(data_plane_.regions->options().max_regions);
    TieredStore* store = store_.load(std::memory_order_acquire);
    resp->set_device_memory(store != nullptr && store->has_gpu());
  }
  return scope.Done(grpc::Status::OK);
}

grpc::Status KvCacheService::PinCall(const TenantScope& tenant, const v1::PinRequest* req,
                                 v1::PinResponse* resp) {
  return ServeChecked(
      RpcMethod::kPin, tenant,
      [&](const TenantScope&) { return CheckKeys(req->keys(), limits_.max_keys_per_request); },
      [&](TieredStore* store, const TenantScope& t) {
        return PinImpl(store, t, t.Internal(req->namespace_id()), req, resp);
      });
}
grpc::Status KvCacheService::UnpinCall(const TenantScope& tenant, const v1::UnpinRequest* req,
                                 v1::UnpinResponse* resp) {
  return ServeChecked(
      RpcMethod::kUnpin, tenant,
      [&](const TenantScope&) { return CheckKeys(req->keys(), limits_.max_keys_per_request); },
      [&](TieredStore* store, const TenantScope& t) {
        return UnpinImpl(store, t.Internal(req->namespace_id()), req, resp);
      });
}
grpc::Status KvCacheService::DeleteCall(const TenantScope& tenant, const v1::DeleteRequest* req,
                                 v1::DeleteResponse* resp) {
  return ServeChecked(
      RpcMethod::kDelete, tenant,
      [&](const TenantScope&) { return CheckKeys(req->keys(), limits_.max_keys_per_request); },
      [&](TieredStore* store, const TenantScope& t) {
        return DeleteImpl(store, t.Internal(req->namespace_id()), req, resp);
      });
}
grpc::Status KvCacheService::ClearCall(const TenantScope& tenant, const v1::ClearRequest* req,
                                 v1::ClearResponse* resp) {
  return Serve(RpcMethod::kClear, tenant, [&](TieredStore* store, const TenantScope& t) {
    return ClearImpl(store, t.Internal(req->namespace_id()), req, resp);
  });
}
grpc::Status KvCacheService::StatsCall(const TenantScope& tenant, const v1::StatsRequest*,
                                   v1::StatsResponse* resp) {
  return ServeChecked(
      RpcMethod::kStats, tenant,
      [&](const TenantScope& t) {
        if (t.admin()) return absl::OkStatus();
        // Daemon-wide figures describe every tenant's use.
        guards_.auth->CountForbidden(t);
        return absl::PermissionDeniedError(absl::StrCat(
            "Stats: tenant ", t.tenant(), " lacks the admin role (daemon-wide statistics)"));
      },
      [&](TieredStore* store, const TenantScope&) { return StatsImpl(store, resp); });
}
grpc::Status KvCacheService::ReleaseLeaseCall(const TenantScope& tenant, const v1::ReleaseLeaseRequest* req,
                                          v1::ReleaseLeaseResponse* resp) {
  return Serve(RpcMethod::kReleaseLease, tenant, [&](TieredStore* store, const TenantScope& t) {
    const uint64_t ns = t.Internal(req->namespace_id());
    if (auto l = RequireNamespace(store, ns); !l.ok()) {
      return ToGrpcStatus(l.status());
    }
    resp->set_released(leases_->Release(ns, req->lease_id()));
    return grpc::Status::OK;
  });
}
grpc::Status KvCacheService::HintCall(const TenantScope& tenant, const v1::HintRequest* req,
                                  v1::HintResponse* resp) {
  return ServeChecked(
      RpcMethod::kHint, tenant,
      [&](const TenantScope&) {
        if (req->client_id().empty() || req->client_id().size() > 128) {
          return absl::InvalidArgumentError(absl::StrCat(
              "client_id: ", req->client_id().size(), " bytes; must be 1 to 128"));
        }
        for (int i = 0; i < req->requests_size(); ++i) {
          if (absl::Status k = CheckKeys(req->requests(i).keys(), limits_.max_keys_per_request);
              !k.ok()) {
            return absl::InvalidArgumentError(absl::StrCat("requests[", i, "].", k.message()));
          }
        }
        return absl::OkStatus();
      },
      [&](TieredStore* store, const TenantScope& t) { return HintImpl(store, t, req, resp); });
}

grpc::Status KvCacheService::HintImpl(TieredStore* store, const TenantScope& tenant,
                                      const v1::HintRequest* req, v1::HintResponse* resp) {
  std::vector<TieredStore::HintedRequest> requests;  // client_id: checked in HintCall.
  requests.reserve(req->requests_size());
  for (int i = 0; i < req->requests_size(); ++i) {
    const v1::HintedRequest& r = req->requests(i);
    const uint64_t ns = tenant.Internal(r.namespace_id());
    if (auto l = RequireNamespace(store, ns); !l.ok()) {
      return ToGrpcStatus(absl::Status(
          l.status().code(), absl::StrCat("requests[", i, "]: ", l.status().message())));
    }
    if (guards_.quotas != nullptr) guards_.quotas->Bind(tenant, ns);  // Its prefetches.
    auto ids = ParseKeys(ns, r.keys(), limits_.max_keys_per_request);
    if (!ids.ok()) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("requests[", i, "].", ids.status().message())));
    }
    TieredStore::HintedRequest& out = requests.emplace_back();
    out.ns = ns;
    out.keys.reserve(ids->size());
    for (const ChunkId& id : *ids) out.keys.push_back(id.key);
  }
  // Each tenant's clients have their own hint windows, whatever names they pick, and a
  // tenant's share of max_hint_clients when they are all taken.
  auto result = store->Hint(tenant.ScopedName(req->client_id()), std::move(requests),
                            tenant.tenant());
  if (!result.ok()) return ToGrpcStatus(result.status());
  resp->set_requests_accepted(result->requests_accepted);
  resp->set_keys_accepted(result->keys_accepted);
  resp->set_truncated(result->truncated);
  resp->set_prefetching(result->prefetching);
  resp->set_cached(result->cached);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<v1::EventBatch>* KvCacheService::Events(
    grpc::CallbackServerContext* ctx, const v1::EventsRequest* req) {
  using Refused = RefusedWriter<v1::EventBatch>;
  StillAdmitted still_admitted;  // A subscription outlives its admission.
  absl::StatusOr<TenantScope> tenant = Admit(ctx, &still_admitted);
  if (!tenant.ok()) return new Refused(metrics_, RpcMethod::kEvents, ToGrpcStatus(tenant.status()));
  if (!tenant->implicit() && req->namespace_id() == 0) {
    // The log does not know which namespaces are whose; a tenant names its own.
    return new Refused(metrics_, RpcMethod::kEvents,
                       ToGrpcStatus(absl::InvalidArgumentError(
                           "namespace_id: required for a tenant (subscribe per namespace)")));
  }
  if (events_ == nullptr) {
    return new Refused(metrics_, RpcMethod::kEvents, grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                              "events: this daemon keeps no event log"));
  }
  if (req->namespace_id() != 0) {
    // A namespace nobody registered would hold a subscription open, silent, forever.
    TieredStore* store = store_.load(std::memory_order_acquire);
    if (store == nullptr) {
      return new Refused(metrics_, RpcMethod::kEvents,
                         ToGrpcStatus(absl::UnavailableError(
                             "kvtierd is starting up (recovering the SSD tier's index); "
                             "retry shortly")));
    }
    if (auto l = RequireNamespace(store, tenant->Internal(req->namespace_id())); !l.ok()) {
      return new Refused(metrics_, RpcMethod::kEvents, ToGrpcStatus(l.status()));
    }
  }
  // The implicit tenant is bounded by the daemon's places alone; a named one also by
  // its share (never 0 once the tenants file is parsed).
  absl::StatusOr<StreamLimiter::Ticket> subscription =
      TakePlace(ctx, subscribers_, *tenant, tenant->quota().subscribers);
  if (!subscription.ok()) {
    return new Refused(metrics_, RpcMethod::kEvents, ToGrpcStatus(subscription.status()));
  }
  absl::StatusOr<StreamLimiter::Ticket> place = TakeStreamPlace(ctx, *tenant);
  if (!place.ok()) {
    return new Refused(metrics_, RpcMethod::kEvents, ToGrpcStatus(place.status()));
  }
  return new EventsReactor(events_, *req, tenant->Internal(req->namespace_id()), metrics_,
                           *std::move(subscription), *std::move(place),
                           std::move(still_admitted), ctx, guards_.stalls);
}

grpc::Status KvCacheService::Refuse(RpcMethod method, const absl::Status& why) {
  RpcMetrics::Scope scope(metrics_, method);
  return scope.Done(ToGrpcStatus(why));
}

grpc::ServerUnaryReactor* KvCacheService::Unary(
    grpc::CallbackServerContext* ctx, RpcMethod method,
    std::function<grpc::Status(const TenantScope&)> call) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // Admitted before it waits for a thread: a caller with no credentials or over its
  // tenant's rate takes no place in the pool's line from those the daemon admits.
  absl::StatusOr<TenantScope> tenant = Admit(ctx);
  if (!tenant.ok()) {
    reactor->Finish(Refuse(method, tenant.status()));
    return reactor;
  }
  IoPool* pool = guards_.unary != nullptr ? guards_.unary : own_unary_.get();
  const bool queued = pool->TrySubmit(
      [this, method, ctx, reactor, call = std::move(call), tenant = *std::move(tenant)] {
        // A call its client reset or gave up on while it waited is not run (but counted,
        // as the calls the daemon could not take are).
        if (ctx->IsCancelled()) {
          RpcMetrics::Scope scope(metrics_, method);
          reactor->Finish(scope.Done(grpc::Status(grpc::StatusCode::CANCELLED,
                                                  "cancelled while waiting for a thread")));
          return;
        }
        reactor->Finish(call(tenant));
      },
      guards_.unary_waiting);
  if (!queued) {
    ctx->AddTrailingMetadata("kvtier-retry-after-ms", "100");
    reactor->Finish(Refuse(method, absl::ResourceExhaustedError(absl::StrCat(
        "kvtierd: every thread for unary calls is busy and ", guards_.unary_waiting,
        " calls already wait for one; retry after the hinted wait"))));
  }
  return reactor;
}

grpc::ServerUnaryReactor* KvCacheService::RegisterLayout(grpc::CallbackServerContext* ctx,
    const v1::RegisterLayoutRequest* req, v1::RegisterLayoutResponse* resp) {
  return Unary(ctx, RpcMethod::kRegisterLayout,
               [this, req, resp](const TenantScope& t) { return RegisterLayoutCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Lookup(grpc::CallbackServerContext* ctx,
    const v1::LookupRequest* req, v1::LookupResponse* resp) {
  return Unary(ctx, RpcMethod::kLookup,
               [this, req, resp](const TenantScope& t) { return LookupCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Pin(grpc::CallbackServerContext* ctx,
    const v1::PinRequest* req, v1::PinResponse* resp) {
  return Unary(ctx, RpcMethod::kPin,
               [this, req, resp](const TenantScope& t) { return PinCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Unpin(grpc::CallbackServerContext* ctx,
    const v1::UnpinRequest* req, v1::UnpinResponse* resp) {
  return Unary(ctx, RpcMethod::kUnpin,
               [this, req, resp](const TenantScope& t) { return UnpinCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Delete(grpc::CallbackServerContext* ctx,
    const v1::DeleteRequest* req, v1::DeleteResponse* resp) {
  return Unary(ctx, RpcMethod::kDelete,
               [this, req, resp](const TenantScope& t) { return DeleteCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Clear(grpc::CallbackServerContext* ctx,
    const v1::ClearRequest* req, v1::ClearResponse* resp) {
  return Unary(ctx, RpcMethod::kClear,
               [this, req, resp](const TenantScope& t) { return ClearCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Stats(grpc::CallbackServerContext* ctx,
    const v1::StatsRequest* req, v1::StatsResponse* resp) {
  return Unary(ctx, RpcMethod::kStats,
               [this, req, resp](const TenantScope& t) { return StatsCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::ReleaseLease(grpc::CallbackServerContext* ctx,
    const v1::ReleaseLeaseRequest* req, v1::ReleaseLeaseResponse* resp) {
  return Unary(ctx, RpcMethod::kReleaseLease,
               [this, req, resp](const TenantScope& t) { return ReleaseLeaseCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::DataPlane(grpc::CallbackServerContext* ctx,
    const v1::DataPlaneRequest* req, v1::DataPlaneResponse* resp) {
  return Unary(ctx, RpcMethod::kDataPlane,
               [this, req, resp](const TenantScope& t) { return DataPlaneCall(t, req, resp); });
}

grpc::ServerUnaryReactor* KvCacheService::Hint(grpc::CallbackServerContext* ctx,
    const v1::HintRequest* req, v1::HintResponse* resp) {
  return Unary(ctx, RpcMethod::kHint,
               [this, req, resp](const TenantScope& t) { return HintCall(t, req, resp); });
}

grpc::Status KvCacheService::Prefill(grpc::ServerContext* ctx, PrefillStream* stream) {
  StillAdmitted still_admitted;
  absl::StatusOr<TenantScope> tenant = Admit(ctx, &still_admitted);
  if (!tenant.ok()) return Refuse(RpcMethod::kPrefill, tenant.status());
  // The places first: a client that never sends its open holds one of them (its
  // tenant's max_streams, and prefill_sessions) until the stall reaper ends it, not a
  // gRPC thread beyond them. A tenant's sessions count in its max_streams.
  absl::StatusOr<StreamLimiter::Ticket> session =
      TakePlace(ctx, guards_.prefill_sessions, *tenant, /*tenant_max=*/0);
  if (!session.ok()) return Refuse(RpcMethod::kPrefill, session.status());
  absl::StatusOr<StreamLimiter::Ticket> place = TakeStreamPlace(ctx, *tenant);
  if (!place.ok()) return Refuse(RpcMethod::kPrefill, place.status());
  // Then the open, checked as far as it can be without the store: one that can never
  // succeed is told so while the daemon starts up, not to retry.
  absl::StatusOr<v1::PrefillOpen> open =
      prefill_->ReadOpen(ctx, stream, data_plane_.regions, guards_.stalls);
  if (!open.ok()) return Refuse(RpcMethod::kPrefill, open.status());
  return Serve(RpcMethod::kPrefill, *tenant, [&](TieredStore* store, const TenantScope& t) {
    if (absl::Status s = prefill_->CheckOpen(store, *open, data_plane_.regions, t); !s.ok()) {
      return ToGrpcStatus(s);
    }
    const std::function<void(uint64_t)> bind = [this, &t](uint64_t ns) {
      if (guards_.quotas != nullptr) guards_.quotas->Bind(t, ns);
    };
    return prefill_->Run(store, ctx, stream, *open, data_plane_.regions, t, guards_.stalls,
                         bind, std::move(still_admitted));
  });
}

grpc::Status KvCacheService::RegisterLayoutImpl(TieredStore* store, const TenantScope& tenant,
                                                const v1::RegisterLayoutRequest* req,
                                                v1::RegisterLayoutResponse* resp) {
  auto spec = LayoutFromProto(req->layout());  // Checked in RegisterLayoutCall.
  if (!spec.ok()) return ToGrpcStatus(spec.status());
  // The client keeps naming the namespace by the layout's hash (its keys start from
  // it); the store holds it under the tenant's id for it.
  const uint64_t public_ns = spec->NamespaceId();
  bool bound_here = false;
  // A layout registered already (in this run or an earlier one) takes no more of the
  // share: it is bound below.
  if (guards_.quotas != nullptr && !tenant.implicit() &&
      !store->FindLayout(tenant.Internal(public_ns)).ok()) {
    // A tenant's share of the layouts, so that no one tenant can use up max_layouts.
    const TenantQuota& q = tenant.quota();
    const uint32_t share =
        q.layouts != 0 ? q.layouts : std::max<uint32_t>(1, limits_.max_layouts / std::max(1u, q.tenants));
    absl::StatusOr<bool> admitted =
        guards_.quotas->AdmitLayout(tenant, tenant.Internal(public_ns), share,
                                    [store] { return store->Layouts(); });
    if (!admitted.ok()) return ToGrpcStatus(admitted.status());
    bound_here = *admitted;
  }
  auto registered = store->RegisterLayout(*spec, tenant.Internal(public_ns));
  if (!registered.ok()) {
    // A layout refused (say, chunks too large) does not count against the share.
    if (bound_here) guards_.quotas->UnbindLayout(tenant, tenant.Internal(public_ns));
    return ToGrpcStatus(registered.status());
  }
  if (guards_.quotas != nullptr) guards_.quotas->Bind(tenant, tenant.Internal(public_ns));
  resp->set_namespace_id(public_ns);
  resp->set_max_frame_bytes(static_cast<uint32_t>(limits_.max_frame_bytes));
  resp->set_max_keys_per_request(limits_.max_keys_per_request);
  resp->set_max_message_bytes(limits_.max_message_bytes);
  resp->set_chunk_bytes(registered->chunk_bytes);
  resp->set_already_registered(registered->already_registered);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::LookupImpl(TieredStore* store, const TenantScope& tenant, uint64_t ns,
                                        const v1::LookupRequest* req,
                                        v1::LookupResponse* resp) {
  if (auto l = RequireNamespace(store, ns); !l.ok()) {
    return ToGrpcStatus(l.status());
  }
  if (guards_.quotas != nullptr) guards_.quotas->Bind(tenant, ns);
  auto ids = ParseKeys(ns, req->keys(), limits_.max_keys_per_request);
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  bool prefix = true;
  uint32_t hits = 0;
  for (const Tier tier : store->LocateMany(*ids)) {
    resp->add_tiers(ToProtoTier(tier));
    prefix = prefix && tier != Tier::kNone;
    if (prefix) ++hits;
  }
  resp->set_prefix_hits(hits);
  if (req->lease_seconds() > 0 && hits > 0) {
    // Hold the hits that are in RAM now; one that moved since Locate is simply not held.
    std::vector<LeasedChunk> held;
    held.reserve(hits);
    for (uint32_t i = 0; i < hits; ++i) {
      if (auto view = store->HoldInRam((*ids)[i])) {
        held.push_back(LeasedChunk{(*ids)[i], *std::move(view)});
      }
      // A leased hit is about to be loaded: on a GPU host, stage it for the worker.
      store->StageAsync((*ids)[i]);
    }
    resp->set_lease_id(leases_->Grant(ns, std::move(held),
                                      absl::Seconds(req->lease_seconds()), tenant.tenant(),
                                      tenant.quota().leases, tenant.quota().tenants));
  }
  if (metrics_) {
    metrics_->CountLookup(ids->size(), std::count_if(resp->tiers().begin(), resp->tiers().end(),
                                                     [](int t) { return t != v1::TIER_UNSPECIFIED; }));
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::PinImpl(TieredStore* store, const TenantScope& tenant, uint64_t ns,
                                        const v1::PinRequest* req,
                                     v1::PinResponse* resp) {
  if (auto l = RequireNamespace(store, ns); !l.ok()) {
    return ToGrpcStatus(l.status());
  }
  auto ids = ParseKeys(ns, req->keys(), limits_.max_keys_per_request);
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  // Keys that could never be pinned together are refused before any is pinned.
  if (absl::Status fits = guards_.quotas != nullptr
                              ? guards_.quotas->CheckPins(store, tenant, *ids)
                              : store->CheckPinsCanFit(*ids);
      !fits.ok()) {
    return ToGrpcStatus(fits);
  }
  for (size_t i = 0; i < ids->size(); ++i) {
    const absl::Duration ttl = absl::Seconds(req->ttl_seconds());
    absl::Status s = guards_.quotas != nullptr ? guards_.quotas->Pin(store, tenant, (*ids)[i], ttl)
                                               : store->Pin((*ids)[i], ttl);
    if (absl::IsNotFound(s)) {
      resp->set_not_found(resp->not_found() + 1);
    } else if (!s.ok()) {
      return ToGrpcStatus(absl::Status(
          s.code(), absl::StrCat("keys[", i, "]: ", s.message(), " (", resp->pinned(),
                                 " keys before it were pinned)")));
    } else {
      resp->set_pinned(resp->pinned() + 1);
    }
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::UnpinImpl(TieredStore* store, uint64_t ns,
                                        const v1::UnpinRequest* req,
                                       v1::UnpinResponse* resp) {
  if (auto l = RequireNamespace(store, ns); !l.ok()) {
    return ToGrpcStatus(l.status());
  }
  auto ids = ParseKeys(ns, req->keys(), limits_.max_keys_per_request);
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  for (const ChunkId& id : *ids) {
    if (store->Unpin(id)) resp->set_unpinned(resp->unpinned() + 1);
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::DeleteImpl(TieredStore* store, uint64_t ns,
                                        const v1::DeleteRequest* req,
                                        v1::DeleteResponse* resp) {
  if (auto l = RequireNamespace(store, ns); !l.ok()) {
    return ToGrpcStatus(l.status());
  }
  auto ids = ParseKeys(ns, req->keys(), limits_.max_keys_per_request);
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  // Leases let go of the chunks too: they would keep the bytes in the pool, counted by
  // no quota, for as long as the lease lives.
  for (size_t i = 0; i < ids->size(); ++i) {
    auto deleted = store->Delete((*ids)[i]);
    if (!deleted.ok()) {
      leases_->Forget(ns, absl::MakeConstSpan(*ids).first(i));
      return ToGrpcStatus(deleted.status());
    }
    if (*deleted) resp->set_deleted(resp->deleted() + 1);
  }
  leases_->Forget(ns, *ids);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::ClearImpl(TieredStore* store, uint64_t ns,
                                        const v1::ClearRequest* req,
                                       v1::ClearResponse* resp) {
  if (auto l = RequireNamespace(store, ns); !l.ok()) {
    return ToGrpcStatus(l.status());
  }
  auto removed = store->Clear(ns);
  // As Delete; after a failed Clear too (what it left is only evictable again).
  leases_->ForgetNamespace(ns);
  if (!removed.ok()) return ToGrpcStatus(removed.status());
  resp->set_chunks_removed(*removed);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::StatsImpl(TieredStore* store, v1::StatsResponse* resp) {
  leases_->Expire();
  const TieredStoreStats s = store->GetStats();
  for (const TierStats& t : store->LocalTierStats()) {
    auto* tier = resp->add_tiers();
    tier->set_tier(ToProtoTier(t.tier));
    tier->set_capacity_bytes(t.capacity_bytes);
    tier->set_used_bytes(t.used_bytes);
    tier->set_payload_bytes(t.payload_bytes);
    tier->set_chunks(t.chunks);
    tier->set_hits(t.hits);
    tier->set_misses(t.misses);
    tier->set_evictions(t.evictions);
    tier->set_expirations(t.expirations);
    if (t.tier == Tier::kRam) {
      tier->set_pinned_bytes(t.pinned_bytes);
      tier->set_prefaulted_bytes(s.ram.prefaulted_bytes);
    }
  }
  resp->set_namespaces(s.namespaces);
  const LeaseTableStats leases = leases_->GetStats();
  resp->set_leases(leases.live);
  resp->set_lease_held_bytes(leases.held_bytes);
  if (data_plane_.regions != nullptr) {
    resp->set_regions(data_plane_.regions->regions());
    resp->set_region_bytes(data_plane_.regions->bytes());
  }
  resp->set_promotions(s.promotions);
  resp->set_demotions(s.demotions);
  resp->set_checksum_failures(s.checksum_failures);
  resp->set_writeback_queue_depth(s.writeback_queue_depth);
  resp->set_write_mode(WriteModeName(store->write_mode()));
  resp->set_uptime_seconds(static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - started_)));
  resp->set_version(version_);
  return grpc::Status::OK;
}

}  // namespace kvtier
