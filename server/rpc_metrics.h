// RpcMetrics: the gRPC service's Prometheus metrics, declared here and nowhere else.
//   kvtier_rpc_requests_total{method,code}   counter
//   kvtier_rpc_latency_seconds{method}       histogram
//   kvtier_rpc_inflight_streams{method}      gauge (calls in progress)
//   kvtier_lookup_keys_total, kvtier_lookup_hits_total   counters
// Every (method, code) series is created at construction, so the request path only
// touches pre-resolved counters (no registry lookup, no label hashing).
//
// Thread-safety: thread-safe; prometheus-cpp metrics are atomics.
#ifndef KVTIER_SERVER_RPC_METRICS_H_
#define KVTIER_SERVER_RPC_METRICS_H_

#include <array>
#include <atomic>
#include <chrono>

#include <grpcpp/support/status.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace kvtier {

enum class RpcMethod {
  kRegisterLayout, kLookup, kPut, kGet, kPin, kUnpin, kDelete, kClear, kStats, kPrefill,
  kReleaseLease, kDataPlane, kHint, kEvents,
};
inline constexpr int kRpcMethodCount = 14;
inline constexpr int kGrpcCodeCount = 17;
const char* RpcMethodName(RpcMethod method);
const char* GrpcCodeName(grpc::StatusCode code);

class RpcMetrics {
 public:
  // Registers the families in `registry`, which must outlive this object.
  explicit RpcMetrics(prometheus::Registry& registry);

  // Times one call: counts it in flight until Done(), then records its code and latency.
  class Scope {
   public:
    Scope(RpcMetrics* metrics, RpcMethod method);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    // Records the outcome and passes the status through.
    grpc::Status Done(grpc::Status status);

   private:
    RpcMetrics* const metrics_;  // Null: metrics off.
    const int method_;
    const std::chrono::steady_clock::time_point start_;
    bool done_ = false;
  };

  // Calls whose Scope exists now: from their start until their handler returned or
  // their reactor was destroyed (after OnDone), so a little past Done().
  int64_t open_calls() const { return open_calls_.load(std::memory_order_acquire); }

  void CountLookup(uint64_t keys, uint64_t hits) {
    lookup_keys_->Increment(static_cast<double>(keys));
    lookup_hits_->Increment(static_cast<double>(hits));
  }

 private:
  std::array<std::array<prometheus::Counter*, kGrpcCodeCount>, kRpcMethodCount> requests_{};
  std::array<prometheus::Histogram*, kRpcMethodCount> latency_{};
  std::array<prometheus::Gauge*, kRpcMethodCount> inflight_{};
  prometheus::Counter* lookup_keys_ = nullptr;
  prometheus::Counter* lookup_hits_ = nullptr;
  std::atomic<int64_t> open_calls_{0};
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_METRICS_H_
