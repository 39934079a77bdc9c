// The C++ client against a fake daemon that lies: sizes, layers and counts that do not
// match the namespace's layout (which the client learns from DataPlane) are a protocol
// violation (Internal) before a byte lands in the caller's memory, never a crash, a
// write past `out`, a short chunk reported found, or the caller's fault.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/call_cancellation.h"
#include "client/kvtier_client.h"
#include "client/prefill_session.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "storage/crc32c.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::PatternBytes;

constexpr uint32_t kLayers = 4;
constexpr uint64_t kLayerBytes = 256;
constexpr uint64_t kChunkBytes = kLayers * kLayerBytes;
constexpr uint64_t kNamespace = 0x42;

std::string Chunk(uint32_t key) { return PatternBytes(key + 7, kChunkBytes); }

// Answers DataPlane with the layout (stream only: no region socket), and Get and Lookup
// with whatever the test scripts.
class LyingDaemon final : public v1::KvCache::Service {
 public:
  using GetScript = std::function<void(const v1::GetRequest&,
                                       grpc::ServerWriter<v1::GetFrame>*)>;
  GetScript get;
  v1::LookupResponse lookup;
  uint64_t chunk_bytes = kChunkBytes;  // What DataPlane answers.
  uint32_t num_layers = kLayers;
  std::function<void()> on_data_plane;  // Runs first in every DataPlane call, if set.
  // Not Ok: DataPlane answers it instead (an older daemon's UNIMPLEMENTED, say), so the
  // client knows no layout.
  grpc::Status data_plane_status;
  using PrefillScript = std::function<void(
      grpc::ServerReaderWriter<v1::PrefillServerMessage, v1::PrefillClientMessage>*)>;
  PrefillScript prefill;
  // Answers each Put stream (its frames unread).
  std::function<grpc::Status(grpc::ServerContext*)> put;

  grpc::Status DataPlane(grpc::ServerContext*, const v1::DataPlaneRequest* req,
                         v1::DataPlaneResponse* resp) override {
    if (on_data_plane) on_data_plane();
    if (!data_plane_status.ok()) return data_plane_status;
    if (req->namespace_id() == kNamespace) {
      resp->set_chunk_bytes(chunk_bytes);
      resp->set_num_layers(num_layers);
    }
    return grpc::Status::OK;
  }
  grpc::Status Get(grpc::ServerContext*, const v1::GetRequest* req,
                   grpc::ServerWriter<v1::GetFrame>* writer) override {
    get(*req, writer);
    return grpc::Status::OK;
  }
  grpc::Status Prefill(grpc::ServerContext*,
                       grpc::ServerReaderWriter<v1::PrefillServerMessage,
                                                v1::PrefillClientMessage>* stream) override {
    prefill(stream);
    return grpc::Status::OK;
  }
  grpc::Status Put(grpc::ServerContext* ctx, grpc::ServerReader<v1::PutFrame>*,
                   v1::PutResponse*) override {
    return put(ctx);
  }
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*,
                      v1::LookupResponse* resp) override {
    *resp = lookup;
    return grpc::Status::OK;
  }
};

// One found frame carrying `data` whole.
v1::GetFrame Found(uint32_t key, const std::string& data, uint64_t total, uint32_t crc,
                   uint32_t layer = 0) {
  v1::GetFrame f;
  f.set_key_index(key);
  f.set_found(true);
  f.set_total_bytes(total);
  f.set_crc32c(crc);
  f.set_tier(v1::TIER_RAM);
  f.set_layer(layer);
  f.set_data(data);
  f.set_last(data.size() == total);
  return f;
}

class ClientProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&daemon_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions o;
    o.data_plane = ClientOptions::DataPlane::kStream;
    target_ = absl::StrCat("127.0.0.1:", port);
    auto c = KvTierClient::Connect(target_, o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    for (uint32_t k = 0; k < 2; ++k) keys_.push_back(KeyOf(k));
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown();
  }

  static void ExpectViolation(const absl::Status& s, absl::string_view what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("protocol violation"), std::string::npos) << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  }

  LyingDaemon daemon_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::unique_ptr<KvTierClient> client_;
  std::vector<ChunkKey> keys_;
};

TEST_F(ClientProtocolTest, GetIntoRefusesAChunkLargerThanTheLayoutsBeforeCopying) {
  // Key 1 announced as eight chunks long, its bytes and CRC consistent with that: without
  // the layout's size the copy would run far past `out`.
  const std::string big = PatternBytes(9, 8 * kChunkBytes);
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    w->Write(Found(0, Chunk(0), kChunkBytes, crc32c::Value(Chunk(0))));
    w->Write(Found(1, big, big.size(), crc32c::Value(big)));
  };
  // Guard bytes after `out` show any write past it.
  std::string memory(2 * kChunkBytes + 4096, '\x5a');
  auto r = client_->GetInto(kNamespace, keys_, absl::MakeSpan(memory.data(), 2 * kChunkBytes));
  ExpectViolation(r.status(), "total_bytes");
  EXPECT_EQ(memory.substr(2 * kChunkBytes), std::string(4096, '\x5a'));
}

// The data plane is decided (a DataPlane call, then maybe a socket connect) outside the
// client's mutex. It was decided under it: while a daemon took its time answering,
// every other user of the mutex waited as long, among them InSharedMemory, which the
// Python binding calls holding the GIL, so every Python thread stalled.
TEST_F(ClientProtocolTest, AnUnansweredDataPlaneCallHoldsUpNoOtherCaller) {
  absl::Notification entered, release;
  daemon_.on_data_plane = [&] {
    entered.Notify();
    release.WaitForNotification();
  };
  ClientOptions o;  // data_plane kAuto: the first transfer decides.
  o.rpc_deadline = absl::Hours(1);  // Past the bound below: only `release` ends the call.
  auto c = KvTierClient::Connect(client_->target(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::thread deciding([&] { EXPECT_EQ((*c)->data_path(), DataPath::kStream); });
  entered.WaitForNotification();
  absl::Notification answered;
  std::string memory(64, 'x');
  std::thread other([&] {
    EXPECT_FALSE((*c)->InSharedMemory(memory.data(), memory.size()));
    answered.Notify();
  });
  // The bound only keeps a regression from hanging the suite; the call takes no time.
  const bool answered_meanwhile = answered.WaitForNotificationWithTimeout(absl::Seconds(60));
  release.Notify();
  other.join();
  deciding.join();
  EXPECT_TRUE(answered_meanwhile) << "InSharedMemory waited for the DataPlane call";
}

// Layout sizes no daemon answers are refused before anything is sized from them: a
// chunk_bytes whose product with the key count wrapped to out's size once let frames
// far larger than `out` through, and more layers than bytes divided by zero.
TEST_F(ClientProtocolTest, ImpossibleLayoutSizesFromDataPlaneAreRefused) {
  const std::pair<uint64_t, uint32_t> answers[] = {
      {(uint64_t{1} << 63) + kChunkBytes, 1},  // x 2 keys wraps to 2 * kChunkBytes.
      {2, 3},                                   // Layers of zero bytes.
      {kChunkBytes + 1, kLayers}};              // Not whole layers.
  for (const auto& [chunk_bytes, num_layers] : answers) {
    daemon_.chunk_bytes = chunk_bytes;
    daemon_.num_layers = num_layers;
    daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
      w->Write(Found(0, Chunk(0), kChunkBytes, crc32c::Value(Chunk(0))));
    };
    ClientOptions o;
    o.data_plane = ClientOptions::DataPlane::kStream;
    auto fresh = KvTierClient::Connect(client_->target(), o);  // Nothing cached.
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    std::string memory(2 * kChunkBytes + 4096, '\x5a');
    auto r = (*fresh)->GetInto(kNamespace, keys_, absl::MakeSpan(memory.data(), 2 * kChunkBytes));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << chunk_bytes << ": " << r.status();
    EXPECT_NE(r.status().message().find("not a layout"), std::string::npos) << r.status();
    EXPECT_EQ(memory.substr(2 * kChunkBytes), std::string(4096, '\x5a'));
  }
}

TEST_F(ClientProtocolTest, GetIntoRefusesHalfChunksThatWouldLeaveZerosReportedFound) {
  const std::string half = Chunk(0).substr(0, kChunkBytes / 2);
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    w->Write(Found(0, half, half.size(), crc32c::Value(half)));
  };
  std::string out(2 * kChunkBytes, '\0');
  auto r = client_->GetInto(kNamespace, keys_, absl::MakeSpan(out));
  ExpectViolation(r.status(), "total_bytes");
}

// Key 0's second half comes in a frame that says found = false, the chunk's CRC32C
// right over both halves: GetInto skipped that frame's copy yet reported key 0 found,
// with whatever `out` held before in its second half.
TEST_F(ClientProtocolTest, GetIntoRefusesAChunkWhoseLaterFrameSaysNotFound) {
  const std::string chunk = Chunk(0);
  const uint64_t half = kChunkBytes / 2;
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    v1::GetFrame a = Found(0, chunk.substr(0, half), kChunkBytes, crc32c::Value(chunk));
    ASSERT_FALSE(a.last());
    w->Write(a);
    v1::GetFrame b;
    b.set_key_index(0);
    b.set_found(false);
    b.set_offset(half);
    b.set_data(chunk.substr(half));
    b.set_last(true);
    w->Write(b);
    v1::GetFrame absent;
    absent.set_key_index(1);
    absent.set_last(true);
    w->Write(absent);
  };
  std::string out(2 * kChunkBytes, '\x5a');
  auto r = client_->GetInto(kNamespace, keys_, absl::MakeSpan(out));
  ExpectViolation(r.status(), "found = false");
}

TEST_F(ClientProtocolTest, LayerMajorPassesOutsideTheLayoutsLayersAreRefused) {
  // Layer-major passes at layers 1000-1003 of a 4-layer layout: each would land
  // 1000 layers past its key's place in `out`.
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    const std::string c = Chunk(0);
    for (uint32_t l = 0; l < kLayers; ++l) {
      w->Write(Found(0, c.substr(l * kLayerBytes, kLayerBytes), kLayerBytes,
                     crc32c::Value(c), 1000 + l));
    }
  };
  std::string memory(kChunkBytes + 4096, '\x5a');
  auto r = client_->GetInto(kNamespace, {keys_.data(), 1},
                            absl::MakeSpan(memory.data(), kChunkBytes), std::nullopt,
                            v1::GET_ORDER_LAYER_MAJOR);
  ExpectViolation(r.status(), "layer 1000");
  EXPECT_EQ(memory.substr(kChunkBytes), std::string(4096, '\x5a'));
}

TEST_F(ClientProtocolTest, LayerMajorPiecesOfAnotherSizeThanALayerAreRefused) {
  // Half-layer pieces, eight passes, the whole chunk's CRC right: a caller waiting for
  // layer 1 would be told it landed when half of it had.
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    const std::string c = Chunk(0);
    for (uint32_t l = 0; l < 2 * kLayers; ++l) {
      w->Write(Found(0, c.substr(l * kLayerBytes / 2, kLayerBytes / 2), kLayerBytes / 2,
                     crc32c::Value(c), l));
    }
  };
  std::vector<uint32_t> layers_seen;
  std::string out(kChunkBytes, '\0');
  auto r = client_->GetInto(kNamespace, {keys_.data(), 1}, absl::MakeSpan(out), std::nullopt,
                            v1::GET_ORDER_LAYER_MAJOR, 0, [&](uint32_t, uint32_t layer) {
                              layers_seen.push_back(layer);
                              return absl::OkStatus();
                            });
  ExpectViolation(r.status(), "the layout's layers");
  EXPECT_TRUE(layers_seen.empty());
}

TEST_F(ClientProtocolTest, GetRefusesChunksOfTheWrongSize) {
  const std::string quarter = Chunk(0).substr(0, kChunkBytes / 4);
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    w->Write(Found(0, quarter, quarter.size(), crc32c::Value(quarter)));
  };
  auto r = client_->Get(kNamespace, {keys_.data(), 1});
  ExpectViolation(r.status(), "total_bytes");
  // A chunk of the right size still passes.
  daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
    w->Write(Found(0, Chunk(0), kChunkBytes, crc32c::Value(Chunk(0))));
  };
  auto ok = client_->Get(kNamespace, {keys_.data(), 1});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE((*ok)[0].crc_verified);
  EXPECT_TRUE((*ok)[0].data == Chunk(0));
}

// Without the layout (DataPlane unanswered: an older daemon, or one under load) a Get
// has only the server's word for a chunk's size. It was reserved whole before a byte
// arrived: 2^62 threw length_error out of a Status API, and 2^40 (the largest chunk the
// client accepts) bad_alloc. Now a size past that largest chunk is a violation, and
// one within it is reserved only in part: the lie is caught when the bytes run short.
TEST_F(ClientProtocolTest, GetWithoutTheLayoutReservesNoChunkSizeTheServerMakesUp) {
  daemon_.data_plane_status = grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "old daemon");
  const std::string some = Chunk(0).substr(0, kLayerBytes);
  for (const uint64_t total : {uint64_t{1} << 62, kMaxAcceptedChunkBytes}) {
    daemon_.get = [&](const v1::GetRequest&, grpc::ServerWriter<v1::GetFrame>* w) {
      w->Write(Found(0, some, total, crc32c::Value(some)));
      v1::GetFrame end;  // Ends the chunk there, far short of `total`.
      end.set_key_index(0);
      end.set_found(true);
      end.set_offset(some.size());
      end.set_data(some);
      end.set_last(true);
      w->Write(end);
    };
    for (const v1::GetOrder order : {v1::GET_ORDER_CHUNK_MAJOR, v1::GET_ORDER_LAYER_MAJOR}) {
      auto r = client_->Get(kNamespace, {keys_.data(), 1}, std::nullopt, nullptr, order);
      ExpectViolation(r.status(), total > kMaxAcceptedChunkBytes ? "total_bytes" : "last frame");
    }
  }
}

// The same for a Prefill session: its Plan's chunk_bytes was reserved on the reader
// thread, where the exception ended the process.
TEST_F(ClientProtocolTest, PrefillWithoutTheLayoutReservesNoChunkSizeTheServerMakesUp) {
  daemon_.data_plane_status = grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "old daemon");
  const std::string some = Chunk(0).substr(0, kLayerBytes);
  for (const uint64_t chunk_bytes : {uint64_t{1} << 62, kMaxAcceptedChunkBytes}) {
    daemon_.prefill = [&](grpc::ServerReaderWriter<v1::PrefillServerMessage,
                                                   v1::PrefillClientMessage>* stream) {
      v1::PrefillServerMessage plan;
      plan.mutable_plan()->set_cached_prefix(1);
      plan.mutable_plan()->add_tiers(v1::TIER_RAM);
      plan.mutable_plan()->set_chunk_bytes(chunk_bytes);
      stream->Write(plan);
      for (const bool last : {false, true}) {  // Ends chunk 0 far short of chunk_bytes.
        v1::PrefillServerMessage frame;
        frame.mutable_chunk()->set_index(0);
        frame.mutable_chunk()->set_offset(last ? some.size() : 0);
        frame.mutable_chunk()->set_data(some);
        frame.mutable_chunk()->set_last(last);
        stream->Write(frame);
      }
    };
    auto session = PrefillSession::Start(*client_, kNamespace, {keys_[0]}, PrefillOptions{});
    if (chunk_bytes > kMaxAcceptedChunkBytes) {
      ExpectViolation(session.status(), "Plan.chunk_bytes");
      continue;
    }
    ASSERT_TRUE(session.ok()) << session.status();
    ExpectViolation((*session)->Finish().status(), "last frame of chunk 0");
  }
}

// The calls that size their transfer from the layout answer as the daemon does for the
// same mistakes (kvtier.proto, "Errors"): NOT_FOUND for a namespace nobody registered,
// INVALID_ARGUMENT for a layer range outside the layout. They said FAILED_PRECONDITION,
// which asks the caller to fix server state, while Get said the contract's codes.
TEST_F(ClientProtocolTest, LayoutSizedCallsAnswerTheContractsCodes) {
  const uint64_t unknown = kNamespace + 1;  // DataPlane knows no layout of it.
  std::string out(kChunkBytes, '\0');
  const RegionChannel::Registration region{/*region_id=*/1, /*token=*/2, kChunkBytes};
  const DeviceChunkToPut chunk{keys_[0], 0, crc32c::Value(Chunk(0)), 0};
  const std::vector<ChunkKey> one = {keys_[0]};

  auto into = client_->GetInto(unknown, one, absl::MakeSpan(out));
  EXPECT_EQ(into.status().code(), absl::StatusCode::kNotFound) << into.status();
  auto device = client_->GetIntoDevice(unknown, one, region, 0);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kNotFound) << device.status();
  auto put = client_->PutFromDevice(unknown, {&chunk, 1}, region);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kNotFound) << put.status();

  const LayerRange past{0, kLayers + 1};
  into = client_->GetInto(kNamespace, one, absl::MakeSpan(out), past);
  EXPECT_EQ(into.status().code(), absl::StatusCode::kInvalidArgument) << into.status();
  device = client_->GetIntoDevice(kNamespace, one, region, 0, past);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << device.status();
}

// A call waiting for another call's data-plane resolution (a DataPlane call and a
// socket connect, up to rpc_deadline on a daemon that does not answer) ends when it is
// cancelled. It once waited out the other call, with nothing of its own for Cancel() to
// end.
TEST_F(ClientProtocolTest, ACancelledCallStopsWaitingForAnotherCallsDataPlane) {
  absl::Notification held, release;
  std::atomic<int> calls{0};
  daemon_.on_data_plane = [&] {
    if (calls.fetch_add(1) != 0) return;
    held.Notify();
    release.WaitForNotification();
  };
  auto client = KvTierClient::Connect(target_, ClientOptions());  // data_plane auto.
  ASSERT_TRUE(client.ok()) << client.status();
  std::thread resolver([&] { (*client)->data_path(); });
  held.WaitForNotification();  // Resolving now: its DataPlane call is held.
  CallCancellation cancel;
  cancel.Cancel();
  absl::Notification done;
  absl::Status result;
  std::thread waiter([&] {
    CallCancellation::Scope scope(&cancel);
    result = (*client)->AllocateShared(1 << 20).status();
    done.Notify();
  });
  // A bound far below the resolution it would otherwise wait for (released below).
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "the cancelled call waited for the other call's resolution";
  release.Notify();
  resolver.join();
  waiter.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
}

// A Put refused with a retry hint backs off before it tries again; Cancel() ends that
// wait at once, as it ends an RPC. It once slept the whole back-off (here 20-30 s) and
// only then saw the cancellation.
TEST_F(ClientProtocolTest, ACancelledPutStopsBackingOffAtOnce) {
  std::atomic<int> attempts{0};
  daemon_.put = [&](grpc::ServerContext* ctx) {
    ctx->AddTrailingMetadata("kvtier-retry-after-ms", "20000");
    attempts.fetch_add(1);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "put buffer full; retry");
  };
  absl::Notification backing_off;
  ClientOptions o;
  o.data_plane = ClientOptions::DataPlane::kStream;
  o.before_put_backoff = [&] { backing_off.Notify(); };
  auto client = KvTierClient::Connect(target_, o);
  ASSERT_TRUE(client.ok()) << client.status();
  CallCancellation cancel;
  absl::Notification done;
  absl::Status result;
  std::thread putter([&] {
    CallCancellation::Scope scope(&cancel);
    const std::string data = Chunk(0);
    ChunkToPut c{keys_[0], data, 16};
    result = (*client)->Put(kNamespace, absl::MakeConstSpan(&c, 1)).status();
    done.Notify();
  });
  backing_off.WaitForNotification();
  cancel.Cancel();
  // A bound far below the back-off, not a measure of speed.
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "the back-off did not end when the call was cancelled";
  putter.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
  EXPECT_EQ(attempts.load(), 1);
}

TEST_F(ClientProtocolTest, LookupRefusesAPrefixHitCountTheTiersDoNotBearOut) {
  daemon_.lookup.add_tiers(v1::TIER_RAM);
  daemon_.lookup.add_tiers(v1::TIER_UNSPECIFIED);
  for (uint32_t lie : {7u, 2u, 0u}) {
    daemon_.lookup.set_prefix_hits(lie);
    auto r = client_->Lookup(kNamespace, keys_);
    ExpectViolation(r.status(), "prefix_hits");
  }
  daemon_.lookup.set_prefix_hits(1);
  auto r = client_->Lookup(kNamespace, keys_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefix_hits, 1u);
}

}  // namespace
}  // namespace kvtier
