// ParseErrorInterceptor: turns gRPC's answer to request bytes that do not parse into
// our contract's. For a method with a typed request, gRPC's generated handler parses the
// bytes itself and, when they are not the message, answers INTERNAL with an empty
// message, which says "server bug" to a client (for a callback method such as Events,
// UNIMPLEMENTED with an empty message, which says "no such method"). The daemon's
// handlers never answer either code without a message, so that pair at PRE_SEND_STATUS
// is exactly a request that did not parse; the interceptor rewrites it to INVALID_ARGUMENT naming the method and
// the message type expected. Methods the daemon parses itself (Put, Get: raw buffers)
// get no interceptor.
//
// Thread-safety: one interceptor per call, driven by gRPC.
#ifndef KVTIER_SERVER_PARSE_ERROR_INTERCEPTOR_H_
#define KVTIER_SERVER_PARSE_ERROR_INTERCEPTOR_H_

#include <grpcpp/support/server_interceptor.h>

#include <string>

namespace kvtier {

class ParseErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_PARSE_ERROR_INTERCEPTOR_H_
