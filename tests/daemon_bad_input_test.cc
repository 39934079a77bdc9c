// Every bad input the foundation names, against a real kvtierd: each gets a gRPC status
// that names the problem, nothing partial becomes visible, no RAM leaks, and the daemon
// keeps serving.
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;

constexpr size_t kChunk = 1 << 20;  // LayoutOfMiB(1).
constexpr size_t kFrameLimit = 256 << 10;

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = MakeTempDir("kvtierd-bad");
    Start();
  }
  void Start() {
    auto d = DaemonProcess::Start(
        data_dir_, {"--max-frame-size=256KiB", "--max-keys-per-request=8",
                    "--ram-capacity=32MiB", "--write-mode=write-through"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    ClientOptions o;
    o.max_frame_bytes = kFrameLimit;
    auto c = KvTierClient::Connect(daemon_->target(), o);
    ASSERT_TRUE(c.ok());
    client_ = *std::move(c);
    auto r = client_->RegisterLayout(LayoutOfMiB(1));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
    baseline_ram_ = RamUsed();
  }

  uint64_t RamUsed() {
    auto s = client_->Stats();
    EXPECT_TRUE(s.ok());
    return s.ok() ? s->tiers(0).used_bytes() : 0;
  }

  v1::PutFrame Frame(const ChunkKey& key, uint64_t offset, std::string data,
                     std::optional<uint32_t> crc = std::nullopt, uint64_t ns = 0) {
    v1::PutFrame f;
    f.set_namespace_id(ns ? ns : ns_);
    f.set_key(key.ToByteString());
    f.set_offset(offset);
    f.set_data(std::move(data));
    if (crc) f.set_crc32c(*crc);
    return f;
  }

  // Sends `frames` on one Put stream and returns the final status.
  grpc::Status SendPut(const std::vector<v1::PutFrame>& frames) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto w = client_->stub()->Put(&ctx, &resp);
    for (const auto& f : frames) {
      if (!w->Write(f)) break;
    }
    w->WritesDone();
    return w->Finish();
  }

  // The chunk is invisible, the RAM it took is back, and the daemon still serves.
  void ExpectNothingLeft(const ChunkKey& key) {
    std::vector<ChunkKey> keys = {key};
    auto l = client_->Lookup(ns_, keys);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->tiers[0], v1::TIER_UNSPECIFIED);
    EXPECT_EQ(RamUsed(), baseline_ram_);
    const std::string good = PatternBytes(999, kChunk);
    ChunkToPut c{KeyOf(999), good, 256};
    auto put = client_->Put(ns_, {&c, 1});
    ASSERT_TRUE(put.ok()) << put.status();
    auto d = client_->Delete(ns_, std::vector<ChunkKey>{KeyOf(999)});
    ASSERT_TRUE(d.ok());
  }

  // All frames of a whole chunk, split at the frame limit.
  std::vector<v1::PutFrame> WholeChunk(const ChunkKey& key, const std::string& data,
                                       std::optional<uint32_t> crc) {
    std::vector<v1::PutFrame> frames;
    for (size_t off = 0; off < data.size(); off += kFrameLimit) {
      const bool last = off + kFrameLimit >= data.size();
      frames.push_back(Frame(key, off, data.substr(off, kFrameLimit),
                             last ? crc : std::nullopt));
    }
    return frames;
  }

  std::string data_dir_;
  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
  uint64_t baseline_ram_ = 0;
};

TEST_F(BadInputTest, WrongPayloadSizeTooShort) {
  const std::string data = PatternBytes(1, kChunk / 2);
  auto frames = WholeChunk(KeyOf(1), data, crc32c::Value(data));
  grpc::Status s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("payload size"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, WrongPayloadSizeTooLong) {
  // 200 KiB frames: the sixth covers [1000 KiB, 1028 KiB), past the 1 MiB chunk's end.
  const std::string data = PatternBytes(1, kChunk + 4096);
  std::vector<v1::PutFrame> frames;
  for (size_t off = 0; off < data.size(); off += 200 << 10) {
    frames.push_back(Frame(KeyOf(1), off, data.substr(off, 200 << 10), crc32c::Value(data)));
  }
  grpc::Status s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("payload size"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, ClientSideSizeCheckRejectsBeforeSending) {
  const std::string data = PatternBytes(1, kChunk - 1);
  ChunkToPut c{KeyOf(1), data, 256};
  auto r = client_->Put(ns_, {&c, 1});
  EXPECT_FALSE(r.ok());
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, UnknownNamespace) {
  const std::string data = PatternBytes(1, kFrameLimit);
  grpc::Status s = SendPut({Frame(KeyOf(1), 0, data, std::nullopt, 0x1234)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("namespace_id"), std::string::npos) << s.error_message();
  auto l = client_->Lookup(0x1234, std::vector<ChunkKey>{KeyOf(1)});
  EXPECT_EQ(l.status().code(), absl::StatusCode::kNotFound);
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, MalformedKey) {
  v1::PutFrame f = Frame(KeyOf(1), 0, PatternBytes(1, 1024));
  f.set_key("short");
  grpc::Status s = SendPut({f});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("key"), std::string::npos) << s.error_message();

  grpc::ClientContext ctx;
  v1::LookupRequest req;
  req.set_namespace_id(ns_);
  req.add_keys(KeyOf(1).ToByteString());
  req.add_keys(std::string(17, 'x'));
  v1::LookupResponse resp;
  grpc::Status ls = client_->stub()->Lookup(&ctx, req, &resp);
  EXPECT_EQ(ls.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(ls.error_message().find("keys[1]"), std::string::npos) << ls.error_message();
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, FrameOutOfOrder) {
  const std::string data = PatternBytes(1, kChunk);
  auto frames = WholeChunk(KeyOf(1), data, crc32c::Value(data));
  std::swap(frames[1], frames[2]);
  grpc::Status s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("out of order"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));

  // A first frame that does not start at offset 0.
  grpc::Status s2 = SendPut({Frame(KeyOf(2), 4096, PatternBytes(2, 4096))});
  EXPECT_EQ(s2.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectNothingLeft(KeyOf(2));
}

TEST_F(BadInputTest, InterleavedChunks) {
  const std::string a = PatternBytes(1, kChunk);
  grpc::Status s = SendPut({Frame(KeyOf(1), 0, a.substr(0, kFrameLimit)),
                            Frame(KeyOf(2), 0, a.substr(0, kFrameLimit))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("interleave"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
  ExpectNothingLeft(KeyOf(2));
}

TEST_F(BadInputTest, OversizedFrame) {
  const std::string data = PatternBytes(1, kFrameLimit * 2);
  grpc::Status s = SendPut({Frame(KeyOf(1), 0, data)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("max_frame_size"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, TooManyKeys) {
  std::vector<ChunkKey> keys;
  for (int i = 0; i < 9; ++i) keys.push_back(KeyOf(i));
  auto l = client_->Lookup(ns_, keys);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("max_keys_per_request"), std::string::npos);
  auto g = client_->Get(ns_, keys);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  ExpectNothingLeft(KeyOf(0));
}

TEST_F(BadInputTest, ChecksumMismatchStoresNothing) {
  const std::string data = PatternBytes(1, kChunk);
  auto frames = WholeChunk(KeyOf(1), data, crc32c::Value(data) ^ 1);
  grpc::Status s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_NE(s.error_message().find("CRC32C"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));

  auto no_crc = WholeChunk(KeyOf(1), data, std::nullopt);
  grpc::Status s2 = SendPut(no_crc);
  EXPECT_EQ(s2.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s2.error_message().find("crc32c"), std::string::npos) << s2.error_message();
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, StreamCancelledMidChunk) {
  const std::string data = PatternBytes(1, kChunk);
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto w = client_->stub()->Put(&ctx, &resp);
  ASSERT_TRUE(w->Write(Frame(KeyOf(1), 0, data.substr(0, kFrameLimit))));
  ASSERT_TRUE(w->Write(Frame(KeyOf(1), kFrameLimit, data.substr(kFrameLimit, kFrameLimit))));
  ctx.TryCancel();
  grpc::Status s = w->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED);
  // The server notices asynchronously; wait until its RAM is back.
  for (int i = 0; i < 200 && RamUsed() != baseline_ram_; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ExpectNothingLeft(KeyOf(1));
}

TEST_F(BadInputTest, StreamEndedMidChunkAfterCompleteOnes) {
  const std::string a = PatternBytes(1, kChunk), b = PatternBytes(2, kChunk);
  auto frames = WholeChunk(KeyOf(1), a, crc32c::Value(a));
  frames.push_back(Frame(KeyOf(2), 0, b.substr(0, kFrameLimit)));
  grpc::Status s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("1 chunks stored"), std::string::npos) << s.error_message();
  // The complete first chunk is stored and intact; the cut one is not.
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(1), KeyOf(2)});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)[0].found && (*got)[0].data == a);
  EXPECT_FALSE((*got)[1].found);
}

TEST_F(BadInputTest, BadLayoutAndLayerRange) {
  LayoutSpec bad = LayoutOfMiB(1);
  bad.num_layers = 0;
  grpc::ClientContext ctx;
  v1::RegisterLayoutRequest req;
  req.mutable_layout()->set_model_id("m");
  req.mutable_layout()->set_dtype(v1::DTYPE_FLOAT16);
  v1::RegisterLayoutResponse resp;
  grpc::Status s = client_->stub()->RegisterLayout(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("layout."), std::string::npos) << s.error_message();

  LayoutSpec huge = LayoutOfMiB(64);  // 64 MiB chunks > 32 MiB RAM pool.
  auto r = client_->RegisterLayout(huge);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();

  auto g = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(1)}, LayerRange{0, 2});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("layer_range"), std::string::npos);
}

TEST_F(BadInputTest, UnknownGetOrderIsInvalidArgument) {
  const std::string data = PatternBytes(3, kChunk);
  ChunkToPut c{KeyOf(3), data, 256};
  ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  v1::GetRequest req;
  req.set_namespace_id(ns_);
  req.add_keys(KeyOf(3).ToByteString());
  req.set_order(static_cast<v1::GetOrder>(7));  // A value from a newer proto.
  auto reader = client_->stub()->Get(&ctx, req);
  v1::GetFrame frame;
  EXPECT_FALSE(reader->Read(&frame));  // Nothing is sent before the error.
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("order"), std::string::npos) << s.error_message();
  // The client refuses it before sending anything.
  auto g = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(3)}, std::nullopt, nullptr,
                        static_cast<v1::GetOrder>(7));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
  // A bad layer range is refused in layer-major order too.
  auto r = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(3)}, LayerRange{0, 2}, nullptr,
                        v1::GET_ORDER_LAYER_MAJOR);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
}

TEST_F(BadInputTest, CorruptedSsdRecordIsNeverServed) {
  const std::string data = PatternBytes(7, kChunk);
  ChunkToPut c{KeyOf(7), data, 256};
  ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  client_.reset();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok() && *code == 0);
  daemon_.reset();

  // Flip bytes in the middle of every payload file: the chunk's payload lives there.
  const int corrupted = testing::CorruptPayloadFiles(
      data_dir_ + "/ssd", [](uint64_t size) { return std::vector<uint64_t>{size / 3}; });
  ASSERT_GT(corrupted, 0) << "no payload file found";

  Start();
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7)});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_NE(got.status().message().find("recompute"), std::string::npos);
  auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(7)});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->tiers[0], v1::TIER_UNSPECIFIED);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->checksum_failures(), 1u);
  ExpectNothingLeft(KeyOf(7));
}

}  // namespace
}  // namespace kvtier
