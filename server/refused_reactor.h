// RefusedReader / RefusedWriter: reactors for streaming calls that are answered before
// they start (not authenticated, over a quota, no such feature). They finish at once
// with the status, counted under the call's method, and delete themselves when done.
//
// Thread-safety: gRPC drives them; no state of their own.
#ifndef KVTIER_SERVER_REFUSED_REACTOR_H_
#define KVTIER_SERVER_REFUSED_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <utility>

#include "server/rpc_metrics.h"

namespace kvtier {

class RefusedReader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  RefusedReader(RpcMetrics* metrics, RpcMethod method, grpc::Status status)
      : scope_(metrics, method) {
    Finish(scope_.Done(std::move(status)));
  }
  void OnDone() override { delete this; }

 private:
  RpcMetrics::Scope scope_;
};

template <typename Message>
class RefusedWriter final : public grpc::ServerWriteReactor<Message> {
 public:
  RefusedWriter(RpcMetrics* metrics, RpcMethod method, grpc::Status status)
      : scope_(metrics, method) {
    this->Finish(scope_.Done(std::move(status)));
  }
  void OnDone() override { delete this; }

 private:
  RpcMetrics::Scope scope_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_REFUSED_REACTOR_H_
