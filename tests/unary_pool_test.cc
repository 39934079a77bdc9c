// The unary methods on the service's own bounded pool (ServiceGuards::unary), in a real
// in-process server: a call waits in the pool's line while its threads are busy and is
// answered once one frees; past the line a call is RESOURCE_EXHAUSTED with the
// kvtier-retry-after-ms hint, at once, holding no thread. A caller the daemon does not
// admit (no credentials, over its tenant's rate) is refused before the line.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "client/layout_convert.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/authenticator.h"
#include "server/kv_cache_service.h"
#include "storage/io_pool.h"
#include "tests/support/daemon_process.h"
#include "tests/support/fake_clock.h"
#include "tests/support/in_process_service.h"
#include "tests/support/tenants_file.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

class UnaryPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { Serve(nullptr); }

  // Serves with the pool's one thread and a line of one; `auth` (may be null) admits.
  void Serve(Authenticator* auth) {
    service_.reset();
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 16 << 20;
    ServiceGuards guards;
    guards.unary = &pool_;
    guards.unary_waiting = 1;
    guards.auth = auth;
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
  AsyncCall& StartRegisterLayout(const std::string& model, const std::string& token = "") {
    waiting_ = std::make_unique<AsyncCall>();
    if (!token.empty()) waiting_->ctx.AddMetadata("authorization", "Bearer " + token);
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

  IoPool pool_{1};  // These outlive the service: declared first.
  testing::FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
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

TEST_F(UnaryPoolTest, CallersNotAdmittedAreRefusedWithoutTakingAPlaceInTheLine) {
  testing::TempDir dir;
  const std::string tenants = dir.path() + "/tenants";
  std::ofstream(tenants) << "tenant team-a\n"
                         << "tenant slow requests_per_second=1 burst=1\n"
                         << testing::TokenLine("team-a", "token-a")
                         << testing::TokenLine("slow", "token-slow");
  AuthenticatorOptions a;
  a.tenants_file = tenants;
  a.clock = clock_.AsFunction();  // Stands still: the slow tenant's bucket does not refill.
  auto auth = Authenticator::Create(a, nullptr);
  ASSERT_TRUE(auth.ok()) << auth.status();
  auth_ = *std::move(auth);
  Serve(auth_.get());
  const auto data_plane = [&](const std::string& token, grpc::ClientContext* ctx) {
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
    // A hang guard: a refusal that waited for the held thread would reach it.
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::DataPlaneResponse resp;
    return stub_->DataPlane(ctx, v1::DataPlaneRequest(), &resp);
  };
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(data_plane("token-slow", &ctx).ok()) << "its burst of one";
  }
  HoldTheThread();
  {
    grpc::ClientContext ctx;
    const grpc::Status s = data_plane("token-slow", &ctx);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("over its request rate"), std::string::npos)
        << s.error_message();
    EXPECT_EQ(ctx.GetServerTrailingMetadata().count("kvtier-retry-after-ms"), 1u);
  }
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(data_plane("", &ctx).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(pool_.waiting(), 0u);
  // The line's one place is still there for a caller the daemon admits.
  AsyncCall& waiting = StartRegisterLayout("a", "token-a");
  ASSERT_TRUE(testing::Eventually([&] { return pool_.waiting() == 1; }));
  release_.Notify();
  waiting.done.WaitForNotification();
  EXPECT_TRUE(waiting.status.ok()) << waiting.status.error_message();
}

}  // namespace
}  // namespace kvtier
