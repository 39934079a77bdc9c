#include "server/rpc_metrics.h"

#include <prometheus/family.h>

namespace kvtier {

const char* RpcMethodName(RpcMethod method) {
  static constexpr const char* kNames[kRpcMethodCount] = {
      "RegisterLayout", "Lookup", "Put", "Get", "Pin", "Unpin", "Delete", "Clear", "Stats",
      "Prefill", "ReleaseLease", "DataPlane", "Hint", "Events"};
  return kNames[static_cast<int>(method)];
}

const char* GrpcCodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[kGrpcCodeCount] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < kGrpcCodeCount ? kNames[i] : "UNKNOWN";
}

RpcMetrics::RpcMetrics(prometheus::Registry& registry) {
  auto& requests = prometheus::BuildCounter()
                       .Name("kvtier_rpc_requests_total")
                       .Help("gRPC calls finished, by method and status code")
                       .Register(registry);
  auto& latency = prometheus::BuildHistogram()
                      .Name("kvtier_rpc_latency_seconds")
                      .Help("gRPC call duration, from the handler's start to its status")
                      .Register(registry);
  auto& inflight = prometheus::BuildGauge()
                       .Name("kvtier_rpc_inflight_streams")
                       .Help("gRPC calls in progress, by method")
                       .Register(registry);
  // 100 us to 60 s: Lookup sits at the low end, multi-GiB Put and Get streams at the top.
  const prometheus::Histogram::BucketBoundaries buckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
      0.25,   0.5,     1,      2.5,   5,      10,    30,   60};
  for (int m = 0; m < kRpcMethodCount; ++m) {
    const std::string name = RpcMethodName(static_cast<RpcMethod>(m));
    for (int c = 0; c < kGrpcCodeCount; ++c) {
      requests_[m][c] = &requests.Add(
          {{"method", name}, {"code", GrpcCodeName(static_cast<grpc::StatusCode>(c))}});
    }
    latency_[m] = &latency.Add({{"method", name}}, buckets);
    inflight_[m] = &inflight.Add({{"method", name}});
  }
  lookup_keys_ = &prometheus::BuildCounter()
                      .Name("kvtier_lookup_keys_total")
                      .Help("Keys asked about in Lookup calls")
                      .Register(registry)
                      .Add({});
  lookup_hits_ = &prometheus::BuildCounter()
                      .Name("kvtier_lookup_hits_total")
                      .Help("Keys found by Lookup calls (hit ratio = hits / keys)")
                      .Register(registry)
                      .Add({});
}

RpcMetrics::Scope::Scope(RpcMetrics* metrics, RpcMethod method)
    : metrics_(metrics), method_(static_cast<int>(method)), start_(std::chrono::steady_clock::now()) {
  if (metrics_) {
    metrics_->inflight_[method_]->Increment();
    metrics_->open_calls_.fetch_add(1, std::memory_order_acq_rel);
  }
}

RpcMetrics::Scope::~Scope() {
  // A handler that returned without Done() (it cannot, by construction) still leaves
  // the in-flight gauge right.
  if (!done_ && metrics_) metrics_->inflight_[method_]->Decrement();
  if (metrics_) metrics_->open_calls_.fetch_sub(1, std::memory_order_acq_rel);
}

grpc::Status RpcMetrics::Scope::Done(grpc::Status status) {
  if (metrics_ && !done_) {
    done_ = true;
    metrics_->inflight_[method_]->Decrement();
    int code = static_cast<int>(status.error_code());
    if (code < 0 || code >= kGrpcCodeCount) code = static_cast<int>(grpc::StatusCode::UNKNOWN);
    metrics_->requests_[method_][code]->Increment();
    metrics_->latency_[method_]->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  return status;
}

}  // namespace kvtier
