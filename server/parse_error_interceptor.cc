#include "server/parse_error_interceptor.h"

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {
namespace {

// The request message of "/kvtier.v1.KvCache/<Method>", found in the proto's own
// descriptor; "" for a method the daemon parses itself or does not know.
std::string RequestType(absl::string_view path) {
  constexpr absl::string_view kPrefix = "/kvtier.v1.KvCache/";
  if (!absl::ConsumePrefix(&path, kPrefix)) return "";
  if (path == "Put" || path == "Get") return "";
  const google::protobuf::ServiceDescriptor* service =
      v1::RegisterLayoutRequest::descriptor()->file()->FindServiceByName("KvCache");
  const google::protobuf::MethodDescriptor* method =
      service == nullptr ? nullptr : service->FindMethodByName(std::string(path));
  return method == nullptr ? "" : method->input_type()->full_name();
}

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  ParseErrorInterceptor(std::string method, std::string request_type)
      : method_(std::move(method)), request_type_(std::move(request_type)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      // INTERNAL from a synchronous method's generated handler; UNIMPLEMENTED from a
      // callback method's (Events), which gRPC answers with a stock reactor when the
      // request does not parse. The daemon itself never answers either without a message.
      const grpc::StatusCode code = status.error_code();
      if ((code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNIMPLEMENTED) &&
          status.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat(method_, ": the request is not a ", request_type_,
                         " (its bytes do not parse)")));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  const std::string request_type_;
};

}  // namespace

grpc::experimental::Interceptor* ParseErrorInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  std::string type = RequestType(info->method());
  if (type.empty()) return nullptr;
  absl::string_view method = info->method();
  method.remove_prefix(method.rfind('/') + 1);
  return new ParseErrorInterceptor(std::string(method), std::move(type));
}

}  // namespace kvtier
