// A KvCacheService over a TieredStore of its own, served by a real gRPC server on port 0
// in the test's process: for tests that need the service's collaborators at hand (a
// fake clock, send turns, an authenticator, the unary pool) rather than a kvtierd.
#ifndef KVTIER_TESTS_SUPPORT_IN_PROCESS_SERVICE_H_
#define KVTIER_TESTS_SUPPORT_IN_PROCESS_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/kv_cache_service.h"
#include "server/lease_table.h"
#include "server/prefill_runner.h"
#include "storage/log.h"
#include "storage/tiered_store.h"

namespace kvtier::testing {

class InProcessService {
 public:
  // Opens a store with `store_options` and serves it with `guards` (whose pointees must
  // outlive this); `starting_up`: not yet (a daemon recovering its index), until
  // FinishStartUp. Errors: the store's, or Unavailable when the server did not start.
  static absl::StatusOr<std::unique_ptr<InProcessService>> Start(
      const TieredStoreOptions& store_options, ServiceGuards guards = {},
      bool starting_up = false) {
    SetMinLogLevel(LogLevel::kError);
    std::unique_ptr<InProcessService> s(new InProcessService());
    auto store = TieredStore::Open(store_options);
    if (!store.ok()) return store.status();
    s->store_ = *std::move(store);
    s->prefill_ = std::make_unique<PrefillRunner>(PrefillRunnerOptions{}, nullptr);
    s->leases_ = std::make_unique<LeaseTable>(LeaseTableOptions{});
    // Events answer from the store's event log, when it keeps one.
    s->service_ = std::make_unique<KvCacheService>(ServiceLimits{}, "test", nullptr,
                                                   s->prefill_.get(), s->leases_.get(),
                                                   DataPlaneInfo{}, store_options.events, guards);
    if (!starting_up) s->service_->SetStore(s->store_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(static_cast<int>(ServiceLimits{}.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(ServiceLimits{}.max_message_bytes));
    builder.RegisterService(s->service_.get());
    s->server_ = builder.BuildAndStart();
    if (s->server_ == nullptr) return absl::UnavailableError("in-process server did not start");
    s->target_ = "127.0.0.1:" + std::to_string(port);
    return s;
  }

  // The server stops (its calls end) before the service, the leases and the store go.
  ~InProcessService() {
    if (server_) server_->Shutdown();
    server_.reset();
    service_.reset();
    leases_.reset();  // Its leases hold pool chunks: before the store.
    store_.reset();
  }
  InProcessService(const InProcessService&) = delete;
  InProcessService& operator=(const InProcessService&) = delete;

  const std::string& target() const { return target_; }
  void FinishStartUp() { service_->SetStore(store_.get()); }
  TieredStore* store() const { return store_.get(); }

 private:
  InProcessService() = default;

  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<PrefillRunner> prefill_;
  std::unique_ptr<LeaseTable> leases_;
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_IN_PROCESS_SERVICE_H_
