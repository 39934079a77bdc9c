// Get calls taking turns (SendTurns) in a real in-process server: many Gets through one
// turn all arrive whole; a client that stops reading gives its turn to a waiting Get
// (once the fake clock passes yield_after), and still gets its chunks when it reads
// again; a Get cancelled while it waits for a turn leaves the line and ends CANCELLED.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/kv_cache_service.h"
#include "server/lease_table.h"
#include "server/prefill_runner.h"
#include "server/send_turns.h"
#include "storage/log.h"
#include "storage/tiered_store.h"
#include "tests/support/daemon_process.h"
#include "tests/support/fake_clock.h"
#include "tests/support/in_process_service.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::PatternBytes;

constexpr uint32_t kChunkMiB = 8;
constexpr uint64_t kChunk = uint64_t{kChunkMiB} << 20;
constexpr int kChunks = 12;

class GetTurnsTest : public ::testing::Test {
 protected:
  void Start(uint32_t turns) {
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 2 * kChunks * kChunk;
    o.max_chunk_bytes = kChunk;
    SendTurnsOptions t;
    t.turns = turns;
    t.yield_after = absl::Milliseconds(100);
    t.clock = clock_.AsFunction();
    t.run_thread = false;
    turns_ = std::make_unique<SendTurns>(t);
    auto service = testing::InProcessService::Start(o, ServiceGuards{.send_turns = turns_.get()});
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = *std::move(service);
    target_ = service_->target();

    auto client = KvTierClient::Connect(target_);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    auto reg = client_->RegisterLayout(testing::LayoutOfMiB(kChunkMiB));
    ASSERT_TRUE(reg.ok()) << reg.status();
    ns_ = reg->namespace_id;
    for (int i = 0; i < kChunks; ++i) {
      const std::string data = PatternBytes(i, kChunk);
      ChunkToPut chunk{KeyOf(i), data};
      auto put = client_->Put(ns_, {&chunk, 1});
      ASSERT_TRUE(put.ok()) << put.status();
      ASSERT_EQ(put->stored, 1u) << "chunk " << i;
    }
  }

  void TearDown() override {
    client_.reset();
    service_.reset();
  }

  // A stub on a channel of its own whose receive window stays small (no BDP probing),
  // so a Get it does not read soon has a write held back by flow control.
  std::unique_ptr<v1::KvCache::Stub> StalledStub() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt("grpc.max_receive_message_length", 64 << 20);
    args.SetString("kvtier.test.channel", "stalled");  // Not shared with the client's.
    return v1::KvCache::NewStub(
        grpc::CreateCustomChannel(target_, grpc::InsecureChannelCredentials(), args));
  }

  v1::GetRequest Request(std::vector<int> keys) {
    v1::GetRequest req;
    req.set_namespace_id(ns_);
    for (int i : keys) req.add_keys(KeyOf(i).ToByteString());
    return req;
  }

  // Reads a Get's frames to the end; returns the bytes of each key and the status.
  static grpc::Status ReadAll(grpc::ClientReader<v1::GetFrame>* reader,
                              std::vector<std::string>* bytes) {
    v1::GetFrame frame;
    while (reader->Read(&frame)) {
      if (frame.key_index() >= bytes->size()) bytes->resize(frame.key_index() + 1);
      (*bytes)[frame.key_index()] += frame.data();
    }
    return reader->Finish();
  }

  // Starts a Get of keys 0..3 that reads nothing, and returns once it holds the only
  // turn with a write its client does not take.
  void StartStalledHolder() {
    stalled_stub_ = StalledStub();
    stalled_reader_ = stalled_stub_->Get(&stalled_ctx_, Request({0, 1, 2, 3}));
    ASSERT_TRUE(testing::Eventually([&] { return turns_->holding() == 1; }));
  }

  // The stalled Get reads everything now: all four chunks arrive whole.
  void FinishStalledHolder() {
    std::vector<std::string> bytes;
    grpc::Status s = ReadAll(stalled_reader_.get(), &bytes);
    EXPECT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(bytes.size(), 4u);
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(bytes[i] == PatternBytes(i, kChunk)) << "key " << i;
  }

  testing::FakeClock clock_;
  std::unique_ptr<SendTurns> turns_;
  std::unique_ptr<testing::InProcessService> service_;
  std::string target_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
  std::unique_ptr<v1::KvCache::Stub> stalled_stub_;
  grpc::ClientContext stalled_ctx_;
  std::unique_ptr<grpc::ClientReader<v1::GetFrame>> stalled_reader_;
};

TEST_F(GetTurnsTest, ManyGetsThroughOneTurnAllArriveWhole) {
  ASSERT_NO_FATAL_FAILURE(Start(/*turns=*/1));
  // The one turn is held by a Get that reads nothing, so every other Get lines up.
  ASSERT_NO_FATAL_FAILURE(StartStalledHolder());
  constexpr int kClients = 8;
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kClients);
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = KvTierClient::Connect(target_);
      if (!client.ok()) {
        results[c] = client.status();
        return;
      }
      std::vector<ChunkKey> keys;
      for (int k = 0; k < 4; ++k) keys.push_back(KeyOf((c + k) % kChunks));
      auto got = (*client)->Get(ns_, keys);
      if (!got.ok()) {
        results[c] = got.status();
        return;
      }
      for (int k = 0; k < 4; ++k) {
        const auto& chunk = (*got)[k];
        if (!chunk.found || !chunk.crc_verified ||
            chunk.data != PatternBytes((c + k) % kChunks, kChunk)) {
          results[c] = absl::DataLossError(absl::StrCat("client ", c, " key ", k));
          return;
        }
      }
    });
  }
  const bool lined_up = testing::Eventually([&] { return turns_->waiting() == kClients; });
  EXPECT_TRUE(lined_up) << turns_->waiting() << " waiting";
  EXPECT_EQ(turns_->holding(), 1u);
  // The holder gives its turn up; the eight then pass through the one turn in order.
  const bool handed_on = testing::Eventually([&] {
    clock_.Advance(absl::Seconds(1));
    return turns_->Sweep() == 1;
  });
  if (!handed_on) stalled_ctx_.TryCancel();  // So that the clients end either way.
  for (auto& t : threads) t.join();
  ASSERT_TRUE(handed_on);
  for (int c = 0; c < kClients; ++c) EXPECT_TRUE(results[c].ok()) << results[c];
  EXPECT_EQ(turns_->waiting(), 0u);
  FinishStalledHolder();
  EXPECT_EQ(turns_->holding(), 0u);
}

// Absent keys (header-only frames, no turn) between present ones, in both orders: every
// turn taken is given back.
TEST_F(GetTurnsTest, AbsentKeysAndLayerMajorOrderGiveEveryTurnBack) {
  ASSERT_NO_FATAL_FAILURE(Start(/*turns=*/1));
  const std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(1000), KeyOf(2), KeyOf(1001), KeyOf(3)};
  for (v1::GetOrder order : {v1::GET_ORDER_CHUNK_MAJOR, v1::GET_ORDER_LAYER_MAJOR}) {
    auto got = client_->Get(ns_, keys, std::nullopt, nullptr, order);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), keys.size());
    EXPECT_TRUE((*got)[0].found && (*got)[0].data == PatternBytes(1, kChunk));
    EXPECT_FALSE((*got)[1].found);
    EXPECT_TRUE((*got)[2].found && (*got)[2].data == PatternBytes(2, kChunk));
    EXPECT_FALSE((*got)[3].found);
    EXPECT_TRUE((*got)[4].found && (*got)[4].data == PatternBytes(3, kChunk));
    EXPECT_EQ(turns_->holding(), 0u) << "order " << order;
    EXPECT_EQ(turns_->waiting(), 0u);
  }
}

TEST_F(GetTurnsTest, AClientThatStopsReadingGivesItsTurnToOneWaiting) {
  ASSERT_NO_FATAL_FAILURE(Start(/*turns=*/1));
  ASSERT_NO_FATAL_FAILURE(StartStalledHolder());
  absl::StatusOr<std::vector<GotChunk>> got;
  std::thread waiter([&] {
    auto client = KvTierClient::Connect(target_);
    ASSERT_TRUE(client.ok()) << client.status();
    const ChunkKey key = KeyOf(7);
    got = (*client)->Get(ns_, {&key, 1});
  });
  ASSERT_TRUE(testing::Eventually([&] { return turns_->waiting() == 1; }));
  // The holder's write is held back by its client: past yield_after, its turn goes to
  // the waiter (a sweep may find it between two writes; it cannot stay there), and it
  // sends the rest of its chunk without one once its client reads again.
  const bool handed_on = testing::Eventually([&] {
    clock_.Advance(absl::Seconds(1));
    return turns_->Sweep() == 1;
  });
  if (!handed_on) stalled_ctx_.TryCancel();  // So that the waiter ends either way.
  waiter.join();
  ASSERT_TRUE(handed_on) << "the stalled Get kept its turn";
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_TRUE((*got)[0].found && (*got)[0].crc_verified);
  EXPECT_TRUE((*got)[0].data == PatternBytes(7, kChunk));
  EXPECT_EQ(turns_->yielded(), 1u);
  FinishStalledHolder();
  EXPECT_EQ(turns_->holding(), 0u);
}

TEST_F(GetTurnsTest, AGetCancelledWhileWaitingForATurnLeavesTheLine) {
  ASSERT_NO_FATAL_FAILURE(Start(/*turns=*/1));
  ASSERT_NO_FATAL_FAILURE(StartStalledHolder());
  auto stub = StalledStub();
  grpc::ClientContext ctx;
  auto reader = stub->Get(&ctx, Request({5}));
  ASSERT_TRUE(testing::Eventually([&] { return turns_->waiting() == 1; }));
  ctx.TryCancel();
  std::vector<std::string> bytes;
  grpc::Status s = ReadAll(reader.get(), &bytes);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_TRUE(testing::Eventually([&] { return turns_->waiting() == 0; }));
  EXPECT_EQ(turns_->yielded(), 0u);
  FinishStalledHolder();
  EXPECT_EQ(turns_->holding(), 0u);
}

}  // namespace
}  // namespace kvtier
