// The unary methods on the service's own bounded pool (ServiceGuards::unary), in a real
// in-process server: a call waits in the pool's line while its threads are busy and is
// answered once one frees; past the line a call is RESOURCE_EXHAUSTED with the
// kvtier-retry-after-ms hint, at once, holding no thread.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "client/layout_convert.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/kv_cache_service.h"
#include "storage/io_pool.h"
#include "tests/support/daemon_process.h"
#include "tests/support/in_process_service.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

class UnaryPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 16 << 20;
    ServiceGuards guards;
    guards.unary = &pool_;
    guards.unary_waiting = 1;
    auto service = testing::InProcessService::Start(o, guards);
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = *std::move(service);
    stub_ = v1::KvCache::NewStub(
        grpc::CreateChannel(service_->target(), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    // A test that failed early must not leave the thread held, nor a call in flight
    // whose callback writes into the fixture.
    if (!release_.HasBeenNotified()) release_.Notify();
    if (waiting_ != nullptr) waiting_->done.WaitForNotification();
    service_.reset();
  }

  // A RegisterLayout sent without waiting for its answer.
  struct AsyncCall {
    grpc::ClientContext ctx;
    v1::RegisterLayoutRequest req;
    v1::RegisterLayoutResponse resp;
    grpc::Status status;
    absl::Notification done;
  };
  AsyncCall& StartRegisterLayout(const std::string& model) {
    waiting_ = std::make_unique<AsyncCall>();
    waiting_->req = Layout(model);
    stub_->async()->RegisterLayout(&waiting_->ctx, &waiting_->req, &waiting_->resp,
                                   [call = waiting_.get()](grpc::Status s) {
                                     call->status = s;
                                     call->done.Notify();
                                   });
    return *waiting_;
  }

  // Occupies the pool's one thread until release_.
  void HoldTheThread() {
    absl::Notification running;
    pool_.Submit([&] {
      running.Notify();
      release_.WaitForNotification();
    });
    running.WaitForNotification();
  }

  static v1::RegisterLayoutRequest Layout(const std::string& model) {
    v1::RegisterLayoutRequest req;
    *req.mutable_layout() = LayoutToProto(testing::LayoutOfMiB(1, model));
    return req;
  }

  IoPool pool_{1};  // Outlives the service: declared first.
  absl::Notification release_;
  std::unique_ptr<testing::InProcessService> service_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<AsyncCall> waiting_;
};

TEST_F(UnaryPoolTest, PastTheLineACallIsRefusedWithARetryHintAndTheLineIsServed) {
  HoldTheThread();
  // One call waits in the line (of one)...
  AsyncCall& waiting = StartRegisterLayout("a");
  ASSERT_TRUE(testing::Eventually([&] { return pool_.waiting() == 1; }));
  // ... so the next one is refused at once, with the hint (the deadline: a hang guard).
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::StatsResponse stats;
  const grpc::Status refused = stub_->Stats(&ctx, v1::StatsRequest(), &stats);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  const auto& trailers = ctx.GetServerTrailingMetadata();
  EXPECT_EQ(trailers.count("kvtier-retry-after-ms"), 1u);
  EXPECT_FALSE(waiting.done.HasBeenNotified()) << "it waits for the thread";
  release_.Notify();
  waiting.done.WaitForNotification();
  EXPECT_TRUE(waiting.status.ok()) << waiting.status.error_message();
  EXPECT_NE(waiting.resp.namespace_id(), 0u);
  grpc::ClientContext again;
  EXPECT_TRUE(stub_->Stats(&again, v1::StatsRequest(), &stats).ok());
}

}  // namespace
}  // namespace kvtier
