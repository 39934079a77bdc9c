// Credentials revoked while a call runs, in a real in-process server: a Put, a Get and
// a Prefill session admitted under one tenants file end UNAUTHENTICATED before their
// next chunk once the file no longer admits their token, and what they finished before
// stays whole (the chunks a Put stored stay stored; the chunk a Get or Prefill was
// sending arrives complete). The Authenticator's clock is a fake one, so the reload is
// the test's doing; each call is held mid-transfer by flow control or by a send turn.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "client/kvtier_client.h"
#include "client/layout_convert.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/authenticator.h"
#include "server/kv_cache_service.h"
#include "server/send_turns.h"
#include "server/stream_limiter.h"
#include "server/tenant_quotas.h"
#include "storage/event_log.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/fake_clock.h"
#include "tests/support/in_process_service.h"
#include "tests/support/tenants_file.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::PatternBytes;
using testing::TokenLine;

constexpr uint32_t kChunkMiB = 8;
constexpr uint64_t kChunk = uint64_t{kChunkMiB} << 20;
constexpr int kChunks = 6;

class RevokedCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    tenants_ = dir_.path() + "/tenants";
    std::ofstream(tenants_) << "tenant team-a\n" << TokenLine("team-a", "token-a");
    AuthenticatorOptions a;
    a.tenants_file = tenants_;
    a.reload_check = absl::Seconds(1);
    a.clock = clock_.AsFunction();
    auto auth = Authenticator::Create(a, nullptr);
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = *std::move(auth);

    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 4 * kChunks * kChunk;
    o.max_chunk_bytes = kChunk;
    o.events = &events_;  // Events answered (InProcessService serves the store's log).
    // One send turn: a Get that reads nothing holds it, which shows it mid-chunk.
    SendTurnsOptions t;
    t.turns = 1;
    t.clock = clock_.AsFunction();
    t.run_thread = false;
    turns_ = std::make_unique<SendTurns>(t);
    quotas_.SetQuotaSource(
        [this](const std::string& tenant) { return auth_->CurrentQuota(tenant); });
    auto service = testing::InProcessService::Start(
        o, ServiceGuards{.auth = auth_.get(), .send_turns = turns_.get(), .quotas = &quotas_});
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = *std::move(service);
    target_ = service_->target();

    client_ = Connect("token-a");
    ASSERT_NE(client_, nullptr);
    auto reg = client_->RegisterLayout(testing::LayoutOfMiB(kChunkMiB));
    ASSERT_TRUE(reg.ok()) << reg.status();
    ns_ = reg->namespace_id;
    for (int i = 0; i < kChunks; ++i) {
      const std::string data = PatternBytes(i, kChunk);
      ChunkToPut chunk{KeyOf(i), data};
      auto put = client_->Put(ns_, {&chunk, 1});
      ASSERT_TRUE(put.ok()) << put.status();
    }
  }

  void TearDown() override {
    client_.reset();
    service_.reset();
  }

  std::unique_ptr<KvTierClient> Connect(const std::string& token) {
    ClientOptions o;
    o.bearer_token = token;
    auto c = KvTierClient::Connect(target_, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // A stub on a channel of its own whose receive window stays small (no BDP probing):
  // a call it does not read has its daemon's writes held back by flow control.
  std::unique_ptr<v1::KvCache::Stub> SlowStub() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt("grpc.max_receive_message_length", 64 << 20);
    args.SetString("kvtier.test.channel", "slow");  // Not shared with the client's.
    return v1::KvCache::NewStub(
        grpc::CreateCustomChannel(target_, grpc::InsecureChannelCredentials(), args));
  }

  // Chunk n's frames, 1 MiB each.
  std::vector<v1::PutFrame> PutFrames(uint64_t n) const {
    const std::string data = PatternBytes(n, kChunk);
    std::vector<v1::PutFrame> out;
    for (uint64_t off = 0; off < kChunk; off += 1 << 20) {
      v1::PutFrame& f = out.emplace_back();
      f.set_namespace_id(ns_);
      f.set_key(KeyOf(n).ToByteString());
      f.set_offset(off);
      f.set_data(data.substr(off, 1 << 20));
    }
    out.back().set_crc32c(crc32c::Value(data));
    return out;
  }

  // Sends chunk n whole on an open Put stream and waits until the daemon stored it.
  void PutAndWaitStored(grpc::ClientWriter<v1::PutFrame>& writer, uint64_t n) {
    for (const v1::PutFrame& f : PutFrames(n)) ASSERT_TRUE(writer.Write(f));
    ASSERT_TRUE(testing::Eventually([&] {
      auto l = client_->Lookup(ns_, {KeyOf(n)});
      return l.ok() && l->prefix_hits == 1;
    }));
  }

  // Token-a is replaced by token-a2, and the daemon re-reads the file (the fake clock
  // passes reload_check) on its next check.
  void Revoke() {
    std::ofstream(tenants_, std::ios::trunc)
        << "tenant team-a\n" << TokenLine("team-a", "token-a2") << "# token-a revoked\n";
    clock_.Advance(absl::Seconds(2));
  }

  testing::TempDir dir_{"kvtier-revoked"};
  EventLog events_{1024};  // Outlives the store and service: declared before them.
  std::string tenants_;
  testing::FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<SendTurns> turns_;
  TenantQuotas quotas_{nullptr};
  std::unique_ptr<testing::InProcessService> service_;
  std::string target_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(RevokedCredentialsTest, AGetEndsBeforeItsNextChunk) {
  auto stub = SlowStub();
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer token-a");
  v1::GetRequest req;
  req.set_namespace_id(ns_);
  for (int i = 0; i < kChunks; ++i) req.add_keys(KeyOf(i).ToByteString());
  auto reader = stub->Get(&ctx, req);
  // Holding the turn with a frame of chunk 0 its client has not read.
  ASSERT_TRUE(testing::Eventually([&] { return turns_->holding() == 1; }));
  Revoke();
  std::map<uint32_t, std::string> bytes;
  v1::GetFrame frame;
  while (reader->Read(&frame)) bytes[frame.key_index()] += frame.data();
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("no longer admits"), std::string::npos) << s.error_message();
  ASSERT_EQ(bytes.size(), 1u) << "only the chunk in flight when the token was revoked";
  EXPECT_TRUE(bytes[0] == PatternBytes(0, kChunk));
  // The new token reads everything.
  auto rotated = Connect("token-a2");
  auto got = rotated->Get(ns_, {KeyOf(kChunks - 1)});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)[0].found);
}

// An Events subscription whose namespace stays idle ends once credentials it was
// admitted with are revoked, at the next event anywhere (which wakes it): it once
// checked only before sending, and held its subscriber place until its own namespace
// changed.
TEST_F(RevokedCredentialsTest, AnIdleEventsSubscriptionEndsAtTheNextEventAnywhere) {
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer token-a");
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // Hang guard.
  v1::EventsRequest req;
  req.set_namespace_id(ns_);
  req.set_after_sequence(events_.last_sequence());  // Only what comes from now on.
  auto reader = stub->Events(&ctx, req);
  // Admitted and under way: an event of its namespace reaches it.
  ASSERT_TRUE(client_->Delete(ns_, {KeyOf(0)}).ok());
  v1::EventBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  ASSERT_GT(batch.events_size(), 0);
  Revoke();
  // An event of another namespace (the tenant's, under its new token).
  auto rotated = Connect("token-a2");
  auto other = rotated->RegisterLayout(testing::LayoutOfMiB(kChunkMiB, "another-model"));
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string data = PatternBytes(99, kChunk);
  ChunkToPut chunk{KeyOf(99), data};
  ASSERT_TRUE(rotated->Put(other->namespace_id, {&chunk, 1}).ok());
  while (reader->Read(&batch)) {
  }
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
}

TEST_F(RevokedCredentialsTest, APutEndsBeforeItsNextChunkKeepingTheOnesStored) {
  auto stub = SlowStub();
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer token-a");
  v1::PutResponse resp;
  auto writer = stub->Put(&ctx, &resp);
  // Chunk 100 is stored (admitted under the first file) before the token goes.
  ASSERT_NO_FATAL_FAILURE(PutAndWaitStored(*writer, 100));
  Revoke();
  for (const v1::PutFrame& f : PutFrames(101)) {
    if (!writer->Write(f)) break;  // The daemon ended the call at the chunk's first frame.
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("1 chunks stored by this stream"), std::string::npos)
      << s.error_message();
  auto rotated = Connect("token-a2");
  auto l = rotated->Lookup(ns_, {KeyOf(100), KeyOf(101)});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->tiers[0], v1::TIER_RAM);
  EXPECT_EQ(l->tiers[1], v1::TIER_UNSPECIFIED) << "stored after its token was revoked";
}

// A Put stream outlives its admission: it is held to the quota of the tenants file in
// force, not the one it was admitted under, which it once kept (and wrote back over
// the new one) for as long as it stayed open.
TEST_F(RevokedCredentialsTest, APutStreamIsHeldToAQuotaLoweredWhileItRuns) {
  auto stub = SlowStub();
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer token-a");
  v1::PutResponse resp;
  auto writer = stub->Put(&ctx, &resp);
  ASSERT_NO_FATAL_FAILURE(PutAndWaitStored(*writer, 100));
  // team-a, holding seven chunks, may now hold two.
  std::ofstream(tenants_, std::ios::trunc)
      << "tenant team-a ram_quota=" << 2 * kChunkMiB << "MiB\n" << TokenLine("team-a", "token-a");
  clock_.Advance(absl::Seconds(2));
  for (const v1::PutFrame& f : PutFrames(101)) ASSERT_TRUE(writer->Write(f));
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.chunks_stored(), 2u);
  std::vector<ChunkKey> keys;
  for (int i = 0; i < kChunks; ++i) keys.push_back(KeyOf(i));
  keys.push_back(KeyOf(100));
  keys.push_back(KeyOf(101));
  auto l = client_->Lookup(ns_, keys);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_LE(std::count(l->tiers.begin(), l->tiers.end(), v1::TIER_RAM), 2);
  EXPECT_EQ(l->tiers.back(), v1::TIER_RAM) << "the stream's last chunk was not stored";
}

TEST_F(RevokedCredentialsTest, APrefillSessionEndsBeforeItsNextChunk) {
  auto stub = SlowStub();
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer token-a");
  auto stream = stub->Prefill(&ctx);
  v1::PrefillClientMessage open;
  open.mutable_open()->set_namespace_id(ns_);
  for (int i = 0; i < kChunks; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
  ASSERT_TRUE(stream->Write(open));
  // The plan, then the first frame of the first chunk streamed (the last key): the
  // session is sending it, held back by flow control.
  v1::PrefillServerMessage msg;
  ASSERT_TRUE(stream->Read(&msg));
  ASSERT_TRUE(msg.has_plan());
  EXPECT_EQ(msg.plan().cached_prefix(), static_cast<uint32_t>(kChunks));
  ASSERT_TRUE(stream->Read(&msg));
  ASSERT_TRUE(msg.has_chunk());
  const uint32_t first = msg.chunk().index();
  EXPECT_EQ(first, static_cast<uint32_t>(kChunks - 1));
  std::map<uint32_t, std::string> bytes;
  bytes[first] += msg.chunk().data();
  Revoke();
  std::optional<v1::PrefillDone> done;
  while (stream->Read(&msg)) {
    if (msg.has_chunk()) bytes[msg.chunk().index()] += msg.chunk().data();
    if (msg.has_done()) {
      done = msg.done();
      stream->WritesDone();  // As a worker does after Done.
    }
  }
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->reason(), v1::PrefillDone::REVOKED);
  EXPECT_EQ(done->first_streamed(), first) << "compute every chunk below the one streamed";
  // The chunk in flight arrives whole; at most the one after it had begun (its first
  // frame may have been sent before the revocation, into the socket's buffers) and
  // nothing further.
  EXPECT_TRUE(bytes[first] == PatternBytes(first, kChunk));
  EXPECT_LE(bytes.size(), 2u);
  EXPECT_EQ(bytes.count(first - 2), 0u);
}

// While the daemon starts up (its store not yet served), a request that can never
// succeed is told so, not UNAVAILABLE ("retry shortly"): Stats from a tenant without the
// admin role, a RegisterLayout without a layout, a Hint without a client_id, and
// malformed keys (a 15-byte key in a Lookup, Delete or Hint; a Get of more keys than
// max_keys_per_request, or in an unknown order), whose checks once ran after the store's.
// So is a Prefill whose open can never succeed (a 15-byte key, a negative compute
// estimate, a target with no data plane, no open at all): the open is read and checked
// before the store (once the store is up, its namespace too). With every stream place
// taken a Prefill is refused its place first, whatever its open: a client that sends
// none holds a place while it waits, not a gRPC thread beyond the places.
TEST(StartingUpTest, RequestsThatCanNeverSucceedAreNotToldToRetry) {
  SetMinLogLevel(LogLevel::kError);
  testing::TempDir dir;
  const std::string tenants = dir.path() + "/tenants";
  std::ofstream(tenants) << "tenant team-a\n" << TokenLine("team-a", "token-a");
  AuthenticatorOptions a;
  a.tenants_file = tenants;
  auto auth = Authenticator::Create(a, nullptr);
  ASSERT_TRUE(auth.ok()) << auth.status();
  TieredStoreOptions o;
  o.write_mode = WriteMode::kRamOnly;
  o.ram.arena.capacity_bytes = 64ull << 20;
  StreamLimiter streams(1, nullptr);
  auto service = testing::InProcessService::Start(
      o, ServiceGuards{.auth = auth->get(), .streams = &streams}, /*starting_up=*/true);
  ASSERT_TRUE(service.ok()) << service.status();
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel((*service)->target(), grpc::InsecureChannelCredentials()));
  const auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer token-a");
    return ((*stub).*method)(&ctx, req, resp).error_code();
  };
  v1::StatsResponse stats;
  v1::RegisterLayoutResponse registered;
  v1::HintResponse hinted;
  v1::LookupResponse looked;
  uint64_t namespace_id = 0;  // Prefill's: none registered yet.
  // `prefill_free`: a Prefill that may succeed, with a place free (nullopt: not tried).
  const auto check = [&](grpc::StatusCode starting_up_lookup,
                         std::optional<grpc::StatusCode> prefill_free) {
    EXPECT_EQ(call(&v1::KvCache::Stub::Stats, v1::StatsRequest(), &stats),
              grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(call(&v1::KvCache::Stub::RegisterLayout, v1::RegisterLayoutRequest(), &registered),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(call(&v1::KvCache::Stub::Hint, v1::HintRequest(), &hinted),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::LookupRequest short_key;
    short_key.add_keys(std::string(15, 'k'));
    EXPECT_EQ(call(&v1::KvCache::Stub::Lookup, short_key, &looked),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::DeleteRequest short_delete;
    short_delete.add_keys(std::string(15, 'k'));
    v1::DeleteResponse deleted;
    EXPECT_EQ(call(&v1::KvCache::Stub::Delete, short_delete, &deleted),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::HintRequest short_hint;
    short_hint.set_client_id("worker-0");
    short_hint.add_requests()->add_keys(std::string(15, 'k'));
    EXPECT_EQ(call(&v1::KvCache::Stub::Hint, short_hint, &hinted),
              grpc::StatusCode::INVALID_ARGUMENT);
    const auto get = [&](const v1::GetRequest& req) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", "Bearer token-a");
      auto reader = stub->Get(&ctx, req);
      v1::GetFrame frame;
      while (reader->Read(&frame)) {
      }
      return reader->Finish().error_code();
    };
    v1::GetRequest too_many;
    for (uint32_t i = 0; i <= ServiceLimits{}.max_keys_per_request; ++i) {
      too_many.add_keys(KeyOf(i).ToByteString());
    }
    EXPECT_EQ(get(too_many), grpc::StatusCode::INVALID_ARGUMENT);
    v1::GetRequest unknown_order;
    unknown_order.add_keys(KeyOf(1).ToByteString());
    unknown_order.set_order(static_cast<v1::GetOrder>(7));
    EXPECT_EQ(get(unknown_order), grpc::StatusCode::INVALID_ARGUMENT);
    // Prefill sessions.
    const auto prefill = [&](const std::optional<v1::PrefillClientMessage>& first) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", "Bearer token-a");
      auto stream = stub->Prefill(&ctx);
      if (first.has_value()) stream->Write(*first);
      stream->WritesDone();
      v1::PrefillServerMessage msg;
      while (stream->Read(&msg)) {
      }
      const grpc::Status s = stream->Finish();
      EXPECT_EQ(ctx.GetServerTrailingMetadata().count("kvtier-retry-after-ms"),
                s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ? 1u : 0u);
      return s.error_code();
    };
    v1::PrefillClientMessage open;
    open.mutable_open()->set_namespace_id(namespace_id);
    open.mutable_open()->add_keys(KeyOf(1).ToByteString());
    v1::PrefillClientMessage short_open = open;
    short_open.mutable_open()->add_keys(std::string(15, 'k'));
    EXPECT_EQ(prefill(short_open), grpc::StatusCode::INVALID_ARGUMENT);
    v1::PrefillClientMessage negative = open;
    negative.mutable_open()->mutable_compute_estimate()->set_b_seconds(-1);
    EXPECT_EQ(prefill(negative), grpc::StatusCode::INVALID_ARGUMENT);
    v1::PrefillClientMessage targeted = open;
    targeted.mutable_open()->mutable_target()->add_offsets(0);
    EXPECT_EQ(prefill(targeted), grpc::StatusCode::FAILED_PRECONDITION);  // No data plane.
    v1::PrefillClientMessage progress;
    progress.mutable_progress()->set_computed(0);
    EXPECT_EQ(prefill(progress), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(prefill(std::nullopt), grpc::StatusCode::INVALID_ARGUMENT);
    // A session that may well succeed: retry once started up, or once a place is free.
    if (prefill_free.has_value()) EXPECT_EQ(prefill(open), *prefill_free);
    {
      absl::StatusOr<StreamLimiter::Ticket> held = streams.TryAcquire();
      ASSERT_TRUE(held.ok()) << held.status();
      EXPECT_EQ(prefill(open), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_EQ(prefill(short_open), grpc::StatusCode::RESOURCE_EXHAUSTED);
    }
    // A request that may well succeed once the store is up is still told to retry.
    EXPECT_EQ(call(&v1::KvCache::Stub::Lookup, v1::LookupRequest(), &looked),
              starting_up_lookup);
  };
  check(grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::UNAVAILABLE);
  (*service)->FinishStartUp();
  // The same answers once it is up; an unregistered namespace is NOT_FOUND, a session
  // for a registered one is refused its place.
  check(grpc::StatusCode::NOT_FOUND, grpc::StatusCode::NOT_FOUND);
  v1::RegisterLayoutRequest layout;
  *layout.mutable_layout() = LayoutToProto(testing::LayoutOfMiB(1));
  ASSERT_EQ(call(&v1::KvCache::Stub::RegisterLayout, layout, &registered), grpc::StatusCode::OK);
  namespace_id = registered.namespace_id();
  check(grpc::StatusCode::NOT_FOUND, std::nullopt);
}

}  // namespace
}  // namespace kvtier
