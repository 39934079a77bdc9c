// A real kvtierd with a tenants file: every RPC x (own tenant, other tenant, no
// credentials, wrong credentials), the admin role, the Unix socket's uid identity, and
// a tenant's request rate.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "client/layout_convert.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/tenant_table.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/tenants_file.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;
using testing::TokenLine;

// Who calls: a token (empty: none).
enum class Who { kOwn, kOther, kNone, kWrong };
const char* Name(Who w) {
  switch (w) {
    case Who::kOwn: return "own";
    case Who::kOther: return "other";
    case Who::kNone: return "none";
    case Who::kWrong: return "wrong";
  }
  return "?";
}

class TenantIsolationTest : public ::testing::Test {
 public:  // The probes below are free functions of the fixture.
  static constexpr uint32_t kChunk = 1 << 20;

  void SetUp() override {
    dir_ = MakeTempDir("kvtierd-tenants");
    const std::string tenants = dir_ + ".tenants";
    std::ofstream(tenants) << "tenant team-a\ntenant team-b\ntenant ops role=admin\n"
                           << "tenant slow requests_per_second=1 burst=2\n"
                           << TokenLine("team-a", "token-a") << TokenLine("team-b", "token-b")
                           << TokenLine("ops", "token-ops") << TokenLine("slow", "token-slow")
                           << "uid team-b " << getuid() << "\n";
    socket_ = dir_ + ".sock";
    auto d = DaemonProcess::Start(dir_, {"--tenants-file=" + tenants, "--listen-unix=" + socket_});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    channel_ = grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials());
    stub_ = v1::KvCache::NewStub(channel_);
    layout_ = LayoutToProto(LayoutOfMiB(1));
    // team-a stores chunk 1 and 2; team-b registers the same layout (its own namespace).
    for (Who w : {Who::kOwn, Who::kOther}) {
      v1::RegisterLayoutRequest req;
      *req.mutable_layout() = layout_;
      v1::RegisterLayoutResponse resp;
      auto ctx = Context(w);
      ASSERT_TRUE(stub_->RegisterLayout(ctx.get(), req, &resp).ok());
      ns_ = resp.namespace_id();
    }
    ASSERT_EQ(PutChunk(Who::kOwn, 1).error_code(), grpc::StatusCode::OK);
    ASSERT_EQ(PutChunk(Who::kOwn, 2).error_code(), grpc::StatusCode::OK);
  }

  std::unique_ptr<grpc::ClientContext> Context(Who w, const std::string& token = "") {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const std::string t = !token.empty()      ? token
                          : w == Who::kOwn   ? "token-a"
                          : w == Who::kOther ? "token-b"
                          : w == Who::kWrong ? "token-forged"
                                             : "";
    if (!t.empty()) ctx->AddMetadata("authorization", "Bearer " + t);
    return ctx;
  }

  grpc::Status PutChunk(Who w, uint64_t n, v1::PutResponse* out = nullptr) {
    const std::string data = PatternBytes(n, kChunk);
    v1::PutFrame f;
    f.set_namespace_id(ns_);
    f.set_key(KeyOf(n).ToByteString());
    f.set_data(data);
    f.set_crc32c(crc32c::Value(data));
    f.set_token_count(256);
    v1::PutResponse resp;
    auto ctx = Context(w);
    auto writer = stub_->Put(ctx.get(), &resp);
    writer->Write(f);
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    if (out) *out = resp;
    return s;
  }

  // Get of chunk n: the status, and whether it was found with team-a's bytes.
  grpc::Status GetChunk(Who w, uint64_t n, bool* found) {
    v1::GetRequest req;
    req.set_namespace_id(ns_);
    req.add_keys(KeyOf(n).ToByteString());
    auto ctx = Context(w);
    auto reader = stub_->Get(ctx.get(), req);
    v1::GetFrame f;
    std::string bytes;
    *found = false;
    while (reader->Read(&f)) {
      *found = f.found();
      bytes += f.data();
    }
    grpc::Status s = reader->Finish();
    if (*found) { EXPECT_EQ(bytes, PatternBytes(n, kChunk)); }
    return s;
  }

  v1::Tier Where(Who w, uint64_t n) {
    v1::LookupRequest req;
    req.set_namespace_id(ns_);
    req.add_keys(KeyOf(n).ToByteString());
    v1::LookupResponse resp;
    auto ctx = Context(w);
    EXPECT_TRUE(stub_->Lookup(ctx.get(), req, &resp).ok());
    return resp.tiers_size() == 1 ? resp.tiers(0) : v1::TIER_UNSPECIFIED;
  }

  std::string dir_;
  std::string socket_;
  std::optional<DaemonProcess> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  v1::Layout layout_;
  uint64_t ns_ = 0;
};

// One RPC against team-a's namespace. Returns the status and, on OK, a short account of
// what the caller saw (compared per cell below).
using Probe = std::function<grpc::Status(TenantIsolationTest*, Who, std::string*)>;

TEST_F(TenantIsolationTest, EveryRpcByEveryKindOfCaller) {
  const std::map<std::string, Probe> probes = {
      {"RegisterLayout",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::RegisterLayoutRequest req;
         *req.mutable_layout() = t->layout_;
         v1::RegisterLayoutResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->RegisterLayout(ctx.get(), req, &resp);
         *seen = resp.already_registered() ? "known" : "new";
         return s;
       }},
      {"Lookup",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::LookupRequest req;
         req.set_namespace_id(t->ns_);
         req.add_keys(KeyOf(1).ToByteString());
         req.set_lease_seconds(10);
         v1::LookupResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Lookup(ctx.get(), req, &resp);
         *seen = absl::StrCat("hits=", resp.prefix_hits());
         return s;
       }},
      {"Put",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::PutResponse resp;
         grpc::Status s = t->PutChunk(w, 1, &resp);  // team-a has chunk 1 already.
         *seen = absl::StrCat("stored=", resp.chunks_stored(), " present=",
                              resp.chunks_already_present());
         return s;
       }},
      {"Get",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         bool found = false;
         grpc::Status s = t->GetChunk(w, 2, &found);
         *seen = found ? "found" : "absent";
         return s;
       }},
      {"Pin",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::PinRequest req;
         req.set_namespace_id(t->ns_);
         req.add_keys(KeyOf(2).ToByteString());
         req.set_ttl_seconds(60);
         v1::PinResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Pin(ctx.get(), req, &resp);
         *seen = absl::StrCat("pinned=", resp.pinned());
         return s;
       }},
      {"Unpin",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::UnpinRequest req;
         req.set_namespace_id(t->ns_);
         req.add_keys(KeyOf(2).ToByteString());
         v1::UnpinResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Unpin(ctx.get(), req, &resp);
         *seen = absl::StrCat("unpinned=", resp.unpinned());
         return s;
       }},
      {"Delete",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::DeleteRequest req;
         req.set_namespace_id(t->ns_);
         req.add_keys(KeyOf(2).ToByteString());
         v1::DeleteResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Delete(ctx.get(), req, &resp);
         *seen = absl::StrCat("deleted=", resp.deleted());
         if (w == Who::kOwn && s.ok()) { EXPECT_EQ(t->PutChunk(w, 2).error_code(), grpc::StatusCode::OK); }
         return s;
       }},
      {"Clear",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::ClearRequest req;
         req.set_namespace_id(t->ns_);
         v1::ClearResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Clear(ctx.get(), req, &resp);
         *seen = absl::StrCat("removed=", resp.chunks_removed());
         if (w == Who::kOwn && s.ok()) {  // Put back what the other cells look at.
           EXPECT_TRUE(t->PutChunk(w, 1).ok());
           EXPECT_TRUE(t->PutChunk(w, 2).ok());
         }
         return s;
       }},
      {"Stats",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::StatsResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Stats(ctx.get(), v1::StatsRequest(), &resp);
         *seen = "";
         return s;
       }},
      {"ReleaseLease",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         // team-a's lease, named by whoever calls.
         v1::LookupRequest lookup;
         lookup.set_namespace_id(t->ns_);
         lookup.add_keys(KeyOf(1).ToByteString());
         lookup.set_lease_seconds(60);
         v1::LookupResponse leased;
         auto own = t->Context(Who::kOwn);
         EXPECT_TRUE(t->stub_->Lookup(own.get(), lookup, &leased).ok());
         EXPECT_NE(leased.lease_id(), 0u);
         v1::ReleaseLeaseRequest req;
         req.set_namespace_id(t->ns_);
         req.set_lease_id(leased.lease_id());
         v1::ReleaseLeaseResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->ReleaseLease(ctx.get(), req, &resp);
         *seen = absl::StrCat("released=", resp.released());
         return s;
       }},
      {"DataPlane",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::DataPlaneRequest req;
         req.set_namespace_id(t->ns_);
         v1::DataPlaneResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->DataPlane(ctx.get(), req, &resp);
         *seen = absl::StrCat("chunk_bytes=", resp.chunk_bytes());
         return s;
       }},
      {"Hint",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         v1::HintRequest req;
         req.set_client_id("router");
         auto* r = req.add_requests();
         r->set_namespace_id(t->ns_);
         r->add_keys(KeyOf(1).ToByteString());
         v1::HintResponse resp;
         auto ctx = t->Context(w);
         grpc::Status s = t->stub_->Hint(ctx.get(), req, &resp);
         *seen = absl::StrCat("cached=", resp.cached());
         return s;
       }},
      {"Prefill",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         auto ctx = t->Context(w);
         auto stream = t->stub_->Prefill(ctx.get());
         v1::PrefillClientMessage open;
         open.mutable_open()->set_namespace_id(t->ns_);
         open.mutable_open()->add_keys(KeyOf(1).ToByteString());
         open.mutable_open()->add_keys(KeyOf(2).ToByteString());
         stream->Write(open);
         v1::PrefillServerMessage m;
         *seen = "";
         if (stream->Read(&m) && m.has_plan()) {
           *seen = absl::StrCat("cached=", m.plan().cached_prefix());
         }
         if (!seen->empty()) ctx->TryCancel();  // Else: the refusal is the status.
         grpc::Status s = stream->Finish();
         return seen->empty() ? s : grpc::Status::OK;
       }},
      {"Events",
       [](TenantIsolationTest* t, Who w, std::string* seen) {
         // From the oldest kept event: team-a's puts are in the log.
         v1::EventsRequest req;
         req.set_namespace_id(t->ns_);
         req.set_after_sequence(0);
         auto ctx = t->Context(w);
         ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
         auto reader = t->stub_->Events(ctx.get(), req);
         // Generate one event in the caller's own namespace, then one in team-a's, so
         // that a subscriber always has something to read and order tells whose it saw.
         if (w == Who::kOther) { EXPECT_TRUE(t->PutChunk(Who::kOther, 77).ok()); }
         EXPECT_TRUE(t->PutChunk(Who::kOwn, 78).ok());
         v1::EventBatch batch;
         *seen = "";
         if (reader->Read(&batch) && batch.events_size() > 0) {
           *seen = batch.events(0).key() == KeyOf(78).ToByteString() ? "team-a's" : "its own";
         }
         if (!seen->empty()) ctx->TryCancel();
         grpc::Status s = reader->Finish();
         return seen->empty() ? s : grpc::Status::OK;
       }},
  };
  using Code = grpc::StatusCode;
  struct Expect {
    Code code;
    std::string seen;  // Checked when code is OK.
  };
  const Expect kUnauth{Code::UNAUTHENTICATED, ""};
  const std::map<std::string, std::map<Who, Expect>> expected = {
      {"RegisterLayout", {{Who::kOwn, {Code::OK, "known"}}, {Who::kOther, {Code::OK, "known"}}}},
      {"Lookup", {{Who::kOwn, {Code::OK, "hits=1"}}, {Who::kOther, {Code::OK, "hits=0"}}}},
      {"Put", {{Who::kOwn, {Code::OK, "stored=0 present=1"}}, {Who::kOther, {Code::OK, "stored=1 present=0"}}}},
      {"Get", {{Who::kOwn, {Code::OK, "found"}}, {Who::kOther, {Code::OK, "absent"}}}},
      {"Pin", {{Who::kOwn, {Code::OK, "pinned=1"}}, {Who::kOther, {Code::OK, "pinned=0"}}}},
      {"Unpin", {{Who::kOwn, {Code::OK, "unpinned=1"}}, {Who::kOther, {Code::OK, "unpinned=0"}}}},
      {"Delete", {{Who::kOwn, {Code::OK, "deleted=1"}}, {Who::kOther, {Code::OK, "deleted=0"}}}},
      {"Clear", {{Who::kOwn, {Code::OK, "removed=2"}}, {Who::kOther, {Code::OK, "removed=0"}}}},
      {"Stats", {{Who::kOwn, {Code::PERMISSION_DENIED, ""}}, {Who::kOther, {Code::PERMISSION_DENIED, ""}}}},
      {"ReleaseLease", {{Who::kOwn, {Code::OK, "released=1"}}, {Who::kOther, {Code::OK, "released=0"}}}},
      {"DataPlane", {{Who::kOwn, {Code::OK, "chunk_bytes=1048576"}}, {Who::kOther, {Code::OK, "chunk_bytes=1048576"}}}},
      {"Hint", {{Who::kOwn, {Code::OK, "cached=1"}}, {Who::kOther, {Code::OK, "cached=0"}}}},
      {"Prefill", {{Who::kOwn, {Code::OK, "cached=2"}}, {Who::kOther, {Code::OK, "cached=0"}}}},
      {"Events", {{Who::kOwn, {Code::OK, "team-a's"}}, {Who::kOther, {Code::OK, "its own"}}}},
  };
  ASSERT_EQ(probes.size(), expected.size());
  // The order within a row matters: "other" runs after "own" so that team-a's state
  // (restored by the own cells that change it) is what the other tenant probes.
  for (const auto& [rpc, probe] : probes) {
    for (Who w : {Who::kOwn, Who::kOther, Who::kNone, Who::kWrong}) {
      const auto row = expected.at(rpc);
      const Expect want = row.count(w) ? row.at(w) : kUnauth;
      std::string seen;
      grpc::Status s = probe(this, w, &seen);
      EXPECT_EQ(s.error_code(), want.code) << rpc << " by " << Name(w) << ": " << s.error_message();
      if (want.code == Code::OK && s.ok()) {
        EXPECT_EQ(seen, want.seen) << rpc << " by " << Name(w);
      }
    }
  }
  // Nothing team-b did reached team-a's chunks: both are intact.
  bool found = false;
  EXPECT_TRUE(GetChunk(Who::kOwn, 1, &found).ok());
  EXPECT_TRUE(found);
  EXPECT_TRUE(GetChunk(Who::kOwn, 2, &found).ok());
  EXPECT_TRUE(found);
}

TEST_F(TenantIsolationTest, AnUnregisteredTenantGetsNotFoundAndAdminsSeeStats) {
  v1::LookupRequest req;
  req.set_namespace_id(ns_);
  req.add_keys(KeyOf(1).ToByteString());
  v1::LookupResponse resp;
  auto ctx = Context(Who::kOwn, "token-ops");  // ops never registered this layout.
  const grpc::Status missing = stub_->Lookup(ctx.get(), req, &resp);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  // The message names no id: the store's is ops' own hash of the one it sent.
  EXPECT_NE(missing.error_message().find("namespace_id is not registered"), std::string::npos)
      << missing.error_message();
  v1::StatsResponse stats;
  auto admin = Context(Who::kOwn, "token-ops");
  ASSERT_TRUE(stub_->Stats(admin.get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.namespaces(), 2u);  // team-a's and team-b's copies of one layout.
}

TEST_F(TenantIsolationTest, TheUnixSocketPeerUidIsAnIdentity) {
  // Our uid is team-b's: over the socket, with no token, we act as team-b.
  auto client = KvTierClient::Connect("unix:" + socket_);
  ASSERT_TRUE(client.ok()) << client.status();
  auto registered = (*client)->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_TRUE(registered->already_registered);  // team-b registered it in SetUp.
  EXPECT_EQ(Where(Who::kOther, 1), v1::TIER_UNSPECIFIED);
  const std::string data = PatternBytes(9, kChunk);
  auto put = (*client)->Put(ns_, {ChunkToPut{KeyOf(9), data, 256}});
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_NE(Where(Who::kOther, 9), v1::TIER_UNSPECIFIED);  // team-b's, by token.
  EXPECT_EQ(Where(Who::kOwn, 9), v1::TIER_UNSPECIFIED);    // Not team-a's.
  auto stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kPermissionDenied);
  // The same socket with a bearer token is that token's tenant.
  ClientOptions as_a;
  as_a.bearer_token = "token-a";
  auto a = KvTierClient::Connect("unix:" + socket_, as_a);
  ASSERT_TRUE(a.ok());
  auto l = (*a)->Lookup(ns_, {KeyOf(1)});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->prefix_hits, 1u);
}

TEST_F(TenantIsolationTest, OverItsRateATenantGetsResourceExhaustedWithARetryHint) {
  // "slow": 1 request/s, burst 2. The first two pass; then RESOURCE_EXHAUSTED, never
  // UNAUTHENTICATED, with the time to wait in a trailer. (A loaded machine could let
  // the bucket refill between calls, so more calls are made than the burst.)
  int refused = 0;
  for (int i = 0; i < 6 && refused == 0; ++i) {
    v1::DataPlaneResponse resp;
    auto ctx = Context(Who::kOwn, "token-slow");
    grpc::Status s = stub_->DataPlane(ctx.get(), v1::DataPlaneRequest(), &resp);
    if (s.ok()) continue;
    ++refused;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("tenant slow"), std::string::npos);
    auto trailer = ctx->GetServerTrailingMetadata().find("kvtier-retry-after-ms");
    ASSERT_NE(trailer, ctx->GetServerTrailingMetadata().end());
    const int ms = std::stoi(std::string(trailer->second.data(), trailer->second.size()));
    EXPECT_GT(ms, 0);
    EXPECT_LE(ms, 1000);
  }
  EXPECT_EQ(refused, 1);
}

// Without a tenants file, the Unix socket admits the daemon's user, root and
// shm_allowed_group. Anyone else gets a final answer on every call, PERMISSION_DENIED
// naming the uid, not a dropped connection (UNAVAILABLE, which a client retries
// forever). The refused caller runs as `nobody`: the test needs root to switch users.
TEST(UnixSocketAdmissionTest, ARefusedPeerGetsPermissionDeniedNotAClosedConnection) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  const std::string dir = MakeTempDir("kvtierd-unix-refused");
  const std::string socket_dir = MakeTempDir("kvtierd-unix-sock");
  ASSERT_EQ(chmod(socket_dir.c_str(), 0755), 0);  // `nobody` must reach the socket.
  const std::string socket = socket_dir + "/kvtierd.sock";
  auto d = DaemonProcess::Start(dir, {"--listen-unix=" + socket, "--shm-allowed-group=4242"});
  ASSERT_TRUE(d.ok()) << d.status();
  // The daemon's own user (root here) is admitted.
  auto own = KvTierClient::Connect("unix:" + socket);
  ASSERT_TRUE(own.ok());
  ASSERT_TRUE((*own)->RegisterLayout(LayoutOfMiB(1)).ok());
  const std::string out = dir + ".cli.out";
  const std::string cmd = absl::StrCat(
      "setpriv --reuid=65534 --regid=65534 --clear-groups ", KVTIER_CLI_PATH,
      " --target unix:", socket, " --timeout 10 stats > ", out, " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  const std::string said((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(rc, 0) << said;
  EXPECT_NE(said.find("PERMISSION_DENIED"), std::string::npos) << said;
  EXPECT_NE(said.find("uid 65534"), std::string::npos) << said;
  EXPECT_EQ(said.find("UNAVAILABLE"), std::string::npos) << said;
  EXPECT_NE(d->ReadLog().find("listen_unix: refused uid 65534"), std::string::npos);
  // shm_allowed_group admits its members, those who have it as a supplementary group
  // (usermod -aG) as well as those whose primary group it is.
  for (const char* groups : {"--regid=4242 --clear-groups", "--regid=65534 --groups=4242"}) {
    const std::string member = absl::StrCat(
        "setpriv --reuid=65534 ", groups, " ", KVTIER_CLI_PATH, " --target unix:", socket,
        " --timeout 10 stats > ", out, " 2>&1");
    const int member_rc = std::system(member.c_str());
    std::ifstream member_in(out);
    const std::string member_said((std::istreambuf_iterator<char>(member_in)),
                                  std::istreambuf_iterator<char>());
    EXPECT_EQ(member_rc, 0) << groups << ": " << member_said;
  }
}

}  // namespace
}  // namespace kvtier
