// Every bad input the foundation names, against a real kvtierd: each gets a gRPC status
// that names the problem, nothing partial becomes visible, no RAM leaks, and the daemon
// keeps serving.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "client/region_channel.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/stalling_proxy.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::Eventually;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;

constexpr size_t kChunk = 1 << 20;  // LayoutOfMiB(1).
constexpr size_t kFrameLimit = 256 << 10;

// A process's peak resident set (VmHWM), KiB; -1 if unknown.
long PeakRssKib(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmHWM:")) return std::stol(line.substr(6));
  }
  return -1L;
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = MakeTempDir("kvtierd-bad");
    Start();
  }
  void Start(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--max-frame-size=256KiB", "--max-keys-per-request=8",
                                     "--ram-capacity=32MiB", "--write-mode=write-through"};
    args.insert(args.end(), extra.begin(), extra.end());
    daemon_.reset();
    auto d = DaemonProcess::Start(data_dir_, args);
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

  // A gauge from the daemon's /metrics, -1 if absent.
  double Metric(const std::string& name) {
    auto r = testing::HttpGet(daemon_->metrics_port(), "/metrics");
    return r.ok() ? testing::SeriesValue(r->body, name) : -1;
  }
  int DaemonThreads() {
    std::ifstream in(absl::StrCat("/proc/", daemon_->pid(), "/status"));
    std::string line;
    while (std::getline(in, line)) {
      if (absl::StartsWith(line, "Threads:")) return std::stoi(line.substr(8));
    }
    return -1;
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

  // A Put stream the test drives frame by frame.
  struct OpenPut {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::PutFrame>> w;
  };
  // Opens a Put stream, waits until the daemon accepts it (its headers), sends the first
  // frame of chunk KeyOf(key) and keeps the stream open: it holds its place.
  std::unique_ptr<OpenPut> HoldPutPlace(uint64_t key, const std::string& data) {
    auto s = std::make_unique<OpenPut>();
    s->w = client_->stub()->Put(&s->ctx, &s->resp);
    s->w->WaitForInitialMetadata();
    EXPECT_TRUE(s->w->Write(Frame(KeyOf(key), 0, data.substr(0, kFrameLimit))));
    return s;
  }

  // Opens a Put stream that the daemon refuses at admission: RESOURCE_EXHAUSTED with the
  // retry hint and a message naming `bound`, before any frame is sent.
  void ExpectPutRefusedAtOnce(const std::string& bound) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto w = client_->stub()->Put(&ctx, &resp);
    w->WaitForInitialMetadata();  // Returns with the refusal.
    grpc::Status refused = w->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(refused.error_message().find(bound), std::string::npos) << refused.error_message();
    EXPECT_EQ(ctx.GetServerTrailingMetadata().count("kvtier-retry-after-ms"), 1u);
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

TEST_F(BadInputTest, BadLineageIsInvalidArgumentAndStoresNothing) {
  const std::string data = PatternBytes(1, kChunk);
  auto frames = WholeChunk(KeyOf(1), data, crc32c::Value(data));
  frames[0].set_prev_key("short");
  grpc::Status s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("prev_key"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
  frames[0].set_prev_key(KeyOf(0).ToByteString());
  frames[0].set_chunk_index(0);  // Chunk 0 has no previous key.
  s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("chunk 0"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
  frames[0].set_chunk_index(UINT32_MAX);
  frames[0].clear_prev_key();
  s = SendPut(frames);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("chunk_index"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));
  // Good lineage is accepted and changes nothing about the chunk.
  frames[0].set_chunk_index(3);
  frames[0].set_prev_key(KeyOf(0).ToByteString());
  ASSERT_TRUE(SendPut(frames).ok());
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(1)});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0].data, data);
}

TEST_F(BadInputTest, BadHintsGetClearStatusesAndLeaveThePreviousHint) {
  auto hint = [&](const std::string& client, std::vector<std::pair<uint64_t, std::vector<std::string>>> reqs) {
    grpc::ClientContext ctx;
    v1::HintRequest req;
    req.set_client_id(client);
    for (auto& [ns, keys] : reqs) {
      v1::HintedRequest* r = req.add_requests();
      r->set_namespace_id(ns);
      for (auto& k : keys) r->add_keys(k);
    }
    v1::HintResponse resp;
    grpc::Status s = client_->stub()->Hint(&ctx, req, &resp);
    return std::make_pair(s, resp);
  };
  const std::string k1 = KeyOf(1).ToByteString(), k2 = KeyOf(2).ToByteString();
  auto [ok, first] = hint("sched", {{ns_, {k1}}});
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(first.keys_accepted(), 1u);
  EXPECT_EQ(first.cached(), 0u);  // Hinted chunks need not exist.

  auto [empty_id, r1] = hint("", {{ns_, {k1}}});
  EXPECT_EQ(empty_id.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(empty_id.error_message().find("client_id"), std::string::npos);
  auto [long_id, r2] = hint(std::string(129, 'x'), {{ns_, {k1}}});
  EXPECT_EQ(long_id.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto [unknown, r3] = hint("sched", {{ns_, {k2}}, {0x1234, {k1}}});
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(unknown.error_message().find("requests[1]"), std::string::npos)
      << unknown.error_message();
  auto [malformed, r4] = hint("sched", {{ns_, {k2, "short"}}});
  EXPECT_EQ(malformed.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(malformed.error_message().find("requests[0].keys[1]"), std::string::npos)
      << malformed.error_message();
  auto [too_many, r5] = hint("sched", {{ns_, std::vector<std::string>(9, k1)}});
  EXPECT_EQ(too_many.error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // max_keys_per_request 8.
  EXPECT_EQ(Metric("kvtier_hint_window_chunks"), 1);  // The first hint stands.
  EXPECT_EQ(Metric("kvtier_hint_clients"), 1);

  // Far larger than the window (half of the 32 MiB pool: 16 one-MiB chunks): cut, said so.
  std::vector<std::pair<uint64_t, std::vector<std::string>>> big;
  for (uint64_t r = 0; r < 10; ++r) {
    std::vector<std::string> keys;
    for (uint64_t i = 0; i < 8; ++i) keys.push_back(KeyOf(100 + r * 8 + i).ToByteString());
    big.emplace_back(ns_, keys);
  }
  auto [cut, resp] = hint("sched", big);
  ASSERT_TRUE(cut.ok()) << cut.error_message();
  EXPECT_TRUE(resp.truncated());
  EXPECT_EQ(resp.requests_accepted(), 2u);
  EXPECT_EQ(resp.keys_accepted(), 16u);
  // A flood from one client replaces, never accumulates.
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(hint("sched", big).first.ok());
  EXPECT_EQ(Metric("kvtier_hint_window_chunks"), 16);
  // Withdrawn.
  ASSERT_TRUE(hint("sched", {}).first.ok());
  EXPECT_EQ(Metric("kvtier_hint_clients"), 0);
}

TEST_F(BadInputTest, MoreHintingClientsThanTheBoundIsResourceExhausted) {
  Start({"--max-hint-clients=1"});
  std::vector<HintedRequest> req = {{ns_, {KeyOf(1)}}};
  ASSERT_TRUE(client_->Hint("a", req).ok());
  auto second = client_->Hint("b", req);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("max_hint_clients"), std::string::npos);
  ASSERT_TRUE(client_->Hint("a", {}).ok());  // Withdrawn: room for b.
  EXPECT_TRUE(client_->Hint("b", req).ok());
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

// A request past the daemon's max_message_bytes: gRPC cuts the message off with its
// own RESOURCE_EXHAUSTED, which the C++ client reports as the final INVALID_ARGUMENT it
// is, never as something to retry. (A Put no longer gets there: the client learns the
// daemon's frame limit, from RegisterLayout or DataPlane, and fits its frames to it; a
// Lookup of more keys than a message holds does.)
TEST_F(BadInputTest, AMessagePastGrpcsLimitIsFinalForTheClient) {
  auto one = client_->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(one.ok()) << one.status();
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 100000; ++i) keys.push_back(KeyOf(i));  // About 1.8 MB.
  auto l = client_->Lookup(one->namespace_id, keys);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << l.status();
  EXPECT_NE(l.status().message().find("do not retry"), std::string::npos) << l.status();
  EXPECT_NE(l.status().message().find("max_message_bytes"), std::string::npos) << l.status();
  // A client that never registered the layout puts a 4 MiB chunk in frames the daemon
  // takes.
  ClientOptions o;
  o.max_frame_bytes = 4 << 20;  // The daemon's messages are at most 256 KiB + 1 MiB.
  auto naive = KvTierClient::Connect(daemon_->target(), o);
  ASSERT_TRUE(naive.ok());
  auto four = client_->RegisterLayout(LayoutOfMiB(4));
  ASSERT_TRUE(four.ok()) << four.status();
  const std::string data = PatternBytes(4, 4 << 20);
  ChunkToPut chunk{KeyOf(4), data, 256};
  auto put = (*naive)->Put(four->namespace_id, {&chunk, 1});
  ASSERT_TRUE(put.ok()) << put.status();
  auto got = client_->Get(four->namespace_id, std::vector<ChunkKey>{KeyOf(4)});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)[0].data == data);
}

// A frame far past the message limit: gRPC assembles a whole message before its size
// check, so without grpc_memory (gRPC's resource quota) each such message costs the
// daemon its full size in RSS (measured: +512 MiB for a 512 MiB frame). With it, the
// stream is reset once gRPC's buffers reach the bound; nothing is stored and the daemon
// keeps serving.
TEST_F(BadInputTest, AFrameFarPastTheLimitCostsNoMoreThanGrpcMemory) {
  Start({"--max-put-buffer=16MiB", "--grpc-memory=32MiB"});
  auto peak_kib = [this] { return PeakRssKib(daemon_->pid()); };
  const long before = peak_kib();
  ASSERT_GT(before, 0);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);  // The client's own limit would stop it first.
  auto channel =
      grpc::CreateCustomChannel(daemon_->target(), grpc::InsecureChannelCredentials(), args);
  auto stub = v1::KvCache::NewStub(channel);
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto w = stub->Put(&ctx, &resp);
  w->Write(Frame(KeyOf(1), 0, std::string(size_t{256} << 20, 'x')));
  w->WritesDone();
  const grpc::Status s = w->Finish();
  EXPECT_FALSE(s.ok());
  const long grown_mib = (peak_kib() - before) >> 10;
  EXPECT_LT(grown_mib, 128) << "the daemon buffered the oversized frame (" << s.error_message()
                            << ")";
  ExpectNothingLeft(KeyOf(1));
}

// A compressed request is refused before it is inflated: gRPC 1.51 inflates a whole
// message before its size check, outside grpc_memory, so a few hundred KB of gzip
// (384 MiB of zeros) once raised the daemon's RSS by that much. UNIMPLEMENTED: final.
TEST_F(BadInputTest, ACompressedRequestIsRefusedBeforeItIsInflated) {
  Start({"--max-put-buffer=16MiB", "--grpc-memory=32MiB"});
  auto peak_kib = [this] { return PeakRssKib(daemon_->pid()); };
  const long before = peak_kib();
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto stub = v1::KvCache::NewStub(
      grpc::CreateCustomChannel(daemon_->target(), grpc::InsecureChannelCredentials(), args));
  for (grpc_compression_algorithm algorithm : {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    grpc::ClientContext ctx;
    ctx.set_compression_algorithm(algorithm);
    v1::LookupRequest req;
    req.set_namespace_id(ns_);
    req.add_keys(std::string(size_t{256} << 20, '\0'));  // ~256 KB on the wire.
    v1::LookupResponse resp;
    const grpc::Status s = stub->Lookup(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
  }
  const long grown_mib = (peak_kib() - before) >> 10;
  EXPECT_LT(grown_mib, 128) << "the daemon inflated the compressed request";
  // Uncompressed requests are served as before.
  grpc::ClientContext ctx;
  v1::LookupRequest req;
  req.set_namespace_id(ns_);
  req.add_keys(KeyOf(1).ToByteString());
  v1::LookupResponse resp;
  EXPECT_TRUE(stub->Lookup(&ctx, req, &resp).ok());
}

// Request headers past 8 KiB (a huge authorization header, say) are refused by gRPC with
// RESOURCE_EXHAUSTED naming the metadata limit: the one final use of that code the
// proto's contract lists besides an oversized message.
TEST_F(BadInputTest, RequestHeadersPastTheLimitAreRefusedNamingIt) {
  Start();
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + std::string(16 << 10, 'a'));
  v1::StatsRequest req;
  v1::StatsResponse resp;
  const grpc::Status s = stub->Stats(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("metadata"), std::string::npos) << s.error_message();
  // The daemon goes on serving. gRPC refuses the headers on either side: the client once
  // it has the daemon's SETTINGS, otherwise the daemon, whose gRPC then closes that
  // connection ("Socket closed" for a call sent on it next, about one run in eight).
  // That is the offending client's own connection; a new one is served. (A channel of
  // its own: gRPC's channels share connections to the same target by default.)
  grpc::ChannelArguments own_connection;
  own_connection.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto fresh = v1::KvCache::NewStub(grpc::CreateCustomChannel(
      daemon_->target(), grpc::InsecureChannelCredentials(), own_connection));
  grpc::ClientContext plain;
  plain.set_wait_for_ready(true);
  plain.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const grpc::Status after = fresh->Stats(&plain, req, &resp);
  EXPECT_TRUE(after.ok()) << after.error_code() << ": " << after.error_message();
}

// A Get asking for frames of a few bytes gets frames of 4 KiB: 1-byte frames once made
// a 1 MiB chunk a million messages (and, from SSD, a million read jobs).
TEST_F(BadInputTest, TinyFramesAreRaisedToFourKiB) {
  const std::string data = PatternBytes(1, kChunk);
  ASSERT_TRUE(client_->Put(ns_, {ChunkToPut{KeyOf(1), data, 256}}).ok());
  grpc::ClientContext ctx;
  v1::GetRequest req;
  req.set_namespace_id(ns_);
  req.add_keys(KeyOf(1).ToByteString());
  req.set_max_frame_bytes(1);
  auto reader = client_->stub()->Get(&ctx, req);
  v1::GetFrame frame;
  std::string got;
  int frames = 0;
  while (reader->Read(&frame)) {
    ++frames;
    EXPECT_LE(frame.data().size(), 4096u);
    got += frame.data();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(frames, static_cast<int>(kChunk / 4096));
  EXPECT_TRUE(got == data);
}

// kvtier's client reports headers past the limit as INVALID_ARGUMENT (final), not
// gRPC's RESOURCE_EXHAUSTED, which its callers would read as "retry" for ever.
TEST_F(BadInputTest, TheClientReportsAnOversizedTokenAsFinal) {
  ClientOptions o;
  o.bearer_token = std::string(16 << 10, 't');
  auto c = KvTierClient::Connect(daemon_->target(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto stats = (*c)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument) << stats.status();
  EXPECT_NE(stats.status().message().find("do not retry"), std::string::npos) << stats.status();
}

// The daemon parses Put frames itself (one copy from gRPC's buffers into the pool): bytes
// that are not a PutFrame at all are INVALID_ARGUMENT, not a crash or a stuck stream.
TEST_F(BadInputTest, NotAPutFrameIsInvalidArgument) {
  const grpc::internal::RpcMethod method("/kvtier.v1.KvCache/Put",
                                         grpc::internal::RpcMethod::CLIENT_STREAMING);
  for (const std::string& junk : {std::string("\xff\xff\xff", 3),   // A varint cut short.
                                  std::string("\x22\x80\x80\x01x", 5),  // data longer than sent
                                  std::string("\x00\x01", 2)}) {       // Field number 0.
    grpc::ClientContext ctx;
    grpc::ByteBuffer response;
    auto channel = grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials());
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> w(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method,
                                                                      &ctx, &response));
    grpc::Slice slice(junk);
    w->Write(grpc::ByteBuffer(&slice, 1));
    w->WritesDone();
    grpc::Status s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("not a PutFrame"), std::string::npos) << s.error_message();
  }
  ExpectNothingLeft(KeyOf(1));
}

// Every method with a typed request answers bytes that are not that message with
// INVALID_ARGUMENT naming it (gRPC alone would answer INTERNAL with no message), and the
// Prefill session and an Events subscription the same for a request that does not parse.
TEST_F(BadInputTest, UnparseableRequestsAreInvalidArgumentNamingTheMessage) {
  auto channel = grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials());
  const std::string junk("\xff\xff\xff", 3);  // A varint cut short: no message parses.
  const std::pair<const char*, const char*> unary[] = {
      {"RegisterLayout", "RegisterLayoutRequest"}, {"Lookup", "LookupRequest"},
      {"Pin", "PinRequest"}, {"Unpin", "UnpinRequest"}, {"Delete", "DeleteRequest"},
      {"Clear", "ClearRequest"}, {"Stats", "StatsRequest"},
      {"ReleaseLease", "ReleaseLeaseRequest"}, {"DataPlane", "DataPlaneRequest"},
      {"Hint", "HintRequest"}};
  for (const auto& [name, type] : unary) {
    const std::string path = absl::StrCat("/kvtier.v1.KvCache/", name);
    const grpc::internal::RpcMethod method(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::ClientContext ctx;
    grpc::Slice slice(junk);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(), method, &ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat("kvtier.v1.", type)), std::string::npos)
        << name << ": " << s.error_message();
  }
  const grpc::internal::RpcMethod prefill("/kvtier.v1.KvCache/Prefill",
                                          grpc::internal::RpcMethod::BIDI_STREAMING);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), prefill, &ctx));
  grpc::Slice slice(junk);
  stream->Write(grpc::ByteBuffer(&slice, 1));
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("PrefillClientMessage"), std::string::npos) << s.error_message();
  // Events runs on the callback API, whose stock answer to a request that does not parse
  // is UNIMPLEMENTED ("no such method").
  const grpc::internal::RpcMethod events("/kvtier.v1.KvCache/Events",
                                         grpc::internal::RpcMethod::SERVER_STREAMING);
  grpc::ClientContext events_ctx;
  grpc::Slice events_slice(junk);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel.get(), events, &events_ctx, grpc::ByteBuffer(&events_slice, 1)));
  grpc::ByteBuffer batch;
  EXPECT_FALSE(reader->Read(&batch));
  s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("kvtier.v1.EventsRequest"), std::string::npos)
      << s.error_message();
}

// Past max_streams a new streaming call is answered RESOURCE_EXHAUSTED at once with a
// retry hint, while unary calls keep answering; a place freed is usable again.
// gRPC server reflection answers any peer on a synchronous stream that holds one of the
// threads Prefill sessions need while it is open; grpc_reflection = false takes it away.
TEST(AdmissionTest, ReflectionIsServedUnlessTurnedOff) {
  for (const bool on : {true, false}) {
    auto d = DaemonProcess::Start(MakeTempDir("kvtierd-reflection"),
                                  {absl::StrCat("--grpc-reflection=", on ? "true" : "false")});
    ASSERT_TRUE(d.ok()) << d.status();
    auto channel = grpc::CreateChannel(d->target(), grpc::InsecureChannelCredentials());
    const grpc::internal::RpcMethod method(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        grpc::internal::RpcMethod::BIDI_STREAMING);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel.get(), method, &ctx));
    const std::string list_services("\x3a\x00", 2);  // ServerReflectionRequest{list_services: ""}
    grpc::Slice slice(list_services);
    stream->Write(grpc::ByteBuffer(&slice, 1));
    stream->WritesDone();
    grpc::ByteBuffer reply;
    std::string services;
    while (stream->Read(&reply)) {
      grpc::Slice flat;
      ASSERT_TRUE(reply.DumpToSingleSlice(&flat).ok());
      services.append(reinterpret_cast<const char*>(flat.begin()), flat.size());
    }
    const grpc::Status s = stream->Finish();
    if (on) {
      EXPECT_TRUE(s.ok()) << s.error_code() << ": " << s.error_message();
      EXPECT_NE(services.find("kvtier.v1.KvCache"), std::string::npos);
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
    }
  }
}

TEST(AdmissionTest, StreamsPastMaxStreamsAreRefusedAndUnaryCallsStillAnswer) {
  // With a data plane, for Gets naming registered memory.
  auto d = DaemonProcess::Start(MakeTempDir("kvtierd-admission"),
                                {"--max-streams=2", "--shm-socket=auto"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = KvTierClient::Connect(d->target());
  ASSERT_TRUE(client.ok());
  auto ns = (*client)->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(ns.ok());
  // Two Events subscriptions hold both places; their initial metadata says the daemon
  // has accepted them.
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::EventBatch>>> subs;
  for (int i = 0; i < 2; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    v1::EventsRequest req;
    subs.push_back((*client)->stub()->Events(ctxs.back().get(), req));
    subs.back()->WaitForInitialMetadata();
  }
  const std::string data = PatternBytes(1, 1 << 20);
  // A client that does not retry sees the refusal itself. (One that retries would keep
  // trying until its deadline and then report whichever came last: the refusal, or
  // DEADLINE_EXCEEDED from an attempt cut off by it.)
  ClientOptions no_retry;
  no_retry.retry_refused_puts = false;
  auto once = KvTierClient::Connect(d->target(), no_retry);
  ASSERT_TRUE(once.ok());
  auto refused = (*once)->Put(ns->namespace_id, {ChunkToPut{KeyOf(1), data, 256}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("max_streams"), std::string::npos);
  // The refusal is at once and carries the hint.
  grpc::ClientContext get_ctx;
  v1::GetRequest get;
  get.set_namespace_id(ns->namespace_id);
  get.add_keys(KeyOf(1).ToByteString());
  auto reader = (*client)->stub()->Get(&get_ctx, get);
  v1::GetFrame frame;
  EXPECT_FALSE(reader->Read(&frame));
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(get_ctx.GetServerTrailingMetadata().count("kvtier-retry-after-ms"), 1u);
  // A Get that can never succeed is told so even with no place free, not "retry".
  for (const bool unknown_namespace : {false, true}) {
    grpc::ClientContext bad_ctx;
    v1::GetRequest bad = get;
    if (unknown_namespace) {
      bad.set_namespace_id(ns->namespace_id + 1);
    } else {
      bad.add_keys("short");
    }
    auto bad_reader = (*client)->stub()->Get(&bad_ctx, bad);
    EXPECT_FALSE(bad_reader->Read(&frame));
    const grpc::Status final_status = bad_reader->Finish();
    EXPECT_EQ(final_status.error_code(), unknown_namespace ? grpc::StatusCode::NOT_FOUND
                                                           : grpc::StatusCode::INVALID_ARGUMENT)
        << final_status.error_message();
  }
  // Nor is a Get whose target can never work: events recorded into host memory, a
  // destination outside the region, a region the daemon does not know. Their checks once
  // ran only after the Get had a place.
  v1::DataPlaneResponse plane;
  {
    grpc::ClientContext plane_ctx;
    ASSERT_TRUE((*client)->stub()->DataPlane(&plane_ctx, v1::DataPlaneRequest(), &plane).ok());
  }
  auto channel = RegionChannel::Connect(plane.region_socket(), plane.instance_id());
  ASSERT_TRUE(channel.ok()) << channel.status();
  const int memfd = memfd_create("admission-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(ftruncate(memfd, 1 << 20), 0);  // One chunk.
  ASSERT_EQ(fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  auto region = (*channel)->Add(memfd, 1 << 20);
  close(memfd);
  ASSERT_TRUE(region.ok()) << region.status();
  enum class Target { kRecordEvents, kOutsideTheRegion, kUnknownRegion };
  for (const Target t :
       {Target::kRecordEvents, Target::kOutsideTheRegion, Target::kUnknownRegion}) {
    grpc::ClientContext bad_ctx;
    v1::GetRequest bad = get;
    v1::RegionTarget* target = bad.mutable_target();
    target->set_region_id(region->region_id + (t == Target::kUnknownRegion ? 1000 : 0));
    target->set_token(region->token);
    target->add_offsets(t == Target::kOutsideTheRegion ? 4096 : 0);
    if (t == Target::kRecordEvents) target->set_record_events(true);
    auto bad_reader = (*client)->stub()->Get(&bad_ctx, bad);
    EXPECT_FALSE(bad_reader->Read(&frame));
    const grpc::Status final_status = bad_reader->Finish();
    EXPECT_EQ(final_status.error_code(), t == Target::kUnknownRegion
                                             ? grpc::StatusCode::FAILED_PRECONDITION
                                             : grpc::StatusCode::INVALID_ARGUMENT)
        << static_cast<int>(t) << ": " << final_status.error_message();
  }
  // Unary calls are not streams.
  auto lookup = (*client)->Lookup(ns->namespace_id, {KeyOf(1)});
  EXPECT_TRUE(lookup.ok()) << lookup.status();
  // One subscription ends; its place comes back (after the call's OnDone, so a put may
  // still be refused for a moment: retry as the contract says).
  ctxs[0]->TryCancel();
  subs[0]->Finish().IgnoreError();
  absl::StatusOr<PutResult> put = absl::UnknownError("not tried");
  for (int attempt = 0; attempt < 100; ++attempt) {
    put = (*client)->Put(ns->namespace_id, {ChunkToPut{KeyOf(1), data, 256}});
    if (put.status().code() != absl::StatusCode::kResourceExhausted) break;
  }
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 1u);
  ctxs[1]->TryCancel();
  subs[1]->Finish().IgnoreError();
}

// A client that stops sending mid-chunk does not hold its pool slots until its
// deadline: after client_idle_timeout the daemon cancels the stream, gives the slots back,
// and the chunk can be put again. Finish returns once the daemon's cancel reaches the
// client, which can be before the daemon's own pending read completes and releases the
// slots, so the test polls Stats (bounded) for the slots rather than reading it once.
TEST(AdmissionTest, AStalledPutIsCancelledAndItsSlotsComeBack) {
  auto d = DaemonProcess::Start(MakeTempDir("kvtierd-stall"), {"--client-idle-timeout=1s"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = KvTierClient::Connect(d->target());
  ASSERT_TRUE(client.ok());
  auto ns = (*client)->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(ns.ok());
  const std::string data = PatternBytes(1, 1 << 20);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
  v1::PutResponse resp;
  auto writer = (*client)->stub()->Put(&ctx, &resp);
  v1::PutFrame f;
  f.set_namespace_id(ns->namespace_id);
  f.set_key(KeyOf(1).ToByteString());
  f.set_data(data.substr(0, 512 << 10));
  ASSERT_TRUE(writer->Write(f));
  // The client says nothing more (and does not close): the daemon ends it.
  grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  uint64_t ram_used = ~uint64_t{0};
  const auto ram_free = [&] {
    auto stats = (*client)->Stats();
    if (!stats.ok()) return false;
    for (const auto& t : stats->tiers()) {
      if (t.tier() == v1::TIER_RAM) ram_used = t.used_bytes();
    }
    return ram_used == 0;
  };
  EXPECT_TRUE(Eventually(ram_free)) << "the half chunk's slots are still held: " << ram_used
                                    << " RAM bytes in use";
  auto put = (*client)->Put(ns->namespace_id, {ChunkToPut{KeyOf(1), data, 256}});
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 1u);
}

// A Get whose client stops reading holds the chunks it is sending and a place among
// max_streams; after client_idle_timeout with a frame held back the daemon cancels it
// and its place comes back. The client reaches the daemon through a proxy that stops
// forwarding the daemon's bytes, as a frozen worker's socket would (an in-process gRPC
// client buffers whatever arrives, read or not); 32 MiB cannot all fit in the sockets.
TEST(AdmissionTest, AGetWhoseClientStopsReadingIsCancelled) {
  auto d = DaemonProcess::Start(MakeTempDir("kvtierd-stall-get"),
                                {"--client-idle-timeout=1s", "--ram-capacity=64MiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = KvTierClient::Connect(d->target());
  ASSERT_TRUE(client.ok());
  auto ns = (*client)->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(ns.ok());
  std::vector<std::string> data;
  std::vector<ChunkToPut> chunks;
  std::vector<ChunkKey> keys;
  for (int i = 0; i < 32; ++i) data.push_back(PatternBytes(i, 1 << 20));
  for (int i = 0; i < 32; ++i) {
    chunks.push_back(ChunkToPut{KeyOf(i), data[i], 256});
    keys.push_back(KeyOf(i));
  }
  auto put = (*client)->Put(ns->namespace_id, chunks);
  ASSERT_TRUE(put.ok()) << put.status();
  auto metric = [&](const std::string& name) {
    auto r = testing::HttpGet(d->metrics_port(), "/metrics");
    return r.ok() ? testing::SeriesValue(r->body, name) : -1;
  };
  EXPECT_EQ(metric("kvtier_client_stalls_cancelled_total"), 0);

  auto proxy = testing::StallingProxy::Start(d->port());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  auto stalled = KvTierClient::Connect((*proxy)->target());
  ASSERT_TRUE(stalled.ok());
  ASSERT_TRUE((*stalled)->Stats().ok());  // The connection is up, through the proxy.
  (*proxy)->PauseDownstream();
  v1::GetRequest req;
  req.set_namespace_id(ns->namespace_id);
  for (const ChunkKey& k : keys) req.add_keys(k.ToByteString());
  grpc::ClientContext ctx;
  auto reader = (*stalled)->stub()->Get(&ctx, req);
  // The daemon gives up on the call (the client cannot hear it: its bytes are stuck).
  EXPECT_TRUE(Eventually([&] { return metric("kvtier_client_stalls_cancelled_total") == 1; }))
      << metric("kvtier_client_stalls_cancelled_total");
  EXPECT_TRUE(Eventually([&] { return metric("kvtier_streams_open") == 0; }))
      << metric("kvtier_streams_open");
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The daemon goes on serving the same chunks to everyone else.
  auto got = (*client)->Get(ns->namespace_id, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), keys.size());
  EXPECT_EQ((*got)[31].data, data[31]);
}

// An Events subscriber that stops reading holds its subscriber place (and its tenant's
// share of them) for as long as its connection lasts; after client_idle_timeout with a
// batch held back the daemon cancels it. Through the stalling proxy, as above.
TEST(AdmissionTest, AnEventsSubscriberThatStopsReadingIsCancelled) {
  auto d = DaemonProcess::Start(MakeTempDir("kvtierd-stall-events"),
                                {"--client-idle-timeout=1s", "--ram-capacity=64MiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = KvTierClient::Connect(d->target());
  ASSERT_TRUE(client.ok());
  LayoutSpec tiny = LayoutOfMiB(1, "events-stall-model");  // 4 KiB chunks.
  tiny.num_layers = 1;
  tiny.num_kv_heads = 1;
  tiny.head_dim = 64;
  tiny.tokens_per_chunk = 16;
  auto ns = (*client)->RegisterLayout(tiny);
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto metric = [&](const std::string& name) {
    auto r = testing::HttpGet(d->metrics_port(), "/metrics");
    return r.ok() ? testing::SeriesValue(r->body, name) : -1;
  };
  auto proxy = testing::StallingProxy::Start(d->port());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  auto stalled = KvTierClient::Connect((*proxy)->target());
  ASSERT_TRUE(stalled.ok());
  ASSERT_TRUE((*stalled)->Stats().ok());
  v1::EventsRequest req;
  req.set_namespace_id(ns->namespace_id);
  grpc::ClientContext ctx;
  auto reader = (*stalled)->stub()->Events(&ctx, req);
  ASSERT_TRUE(Eventually([&] { return metric("kvtier_streams_open") == 1; }));
  (*proxy)->PauseDownstream();
  // Far more events than the subscription's HTTP/2 window holds: its writes stall.
  const std::string data = PatternBytes(1, tiny.ChunkBytes());
  std::vector<ChunkToPut> chunks;
  std::vector<ChunkKey> keys;
  for (int i = 0; i < 16; ++i) {
    chunks.push_back(ChunkToPut{KeyOf(i), data, 16});
    keys.push_back(KeyOf(i));
  }
  for (int round = 0; round < 300 && metric("kvtier_client_stalls_cancelled_total") == 0;
       ++round) {
    ASSERT_TRUE((*client)->Put(ns->namespace_id, chunks).ok());
    ASSERT_TRUE((*client)->Delete(ns->namespace_id, keys).ok());
  }
  EXPECT_TRUE(Eventually([&] { return metric("kvtier_client_stalls_cancelled_total") == 1; }))
      << metric("kvtier_client_stalls_cancelled_total");
  EXPECT_TRUE(Eventually([&] { return metric("kvtier_streams_open") == 0; }))
      << "the subscriber's place came back";
  ctx.TryCancel();
  reader->Finish().IgnoreError();
}

// A Prefill whose worker opens the stream and never sends its PrefillOpen holds a
// handler thread; after client_idle_timeout the daemon cancels it.
TEST(AdmissionTest, APrefillThatNeverOpensIsCancelled) {
  auto d = DaemonProcess::Start(MakeTempDir("kvtierd-stall-prefill"),
                                {"--client-idle-timeout=1s"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = KvTierClient::Connect(d->target());
  ASSERT_TRUE(client.ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  auto stream = (*client)->stub()->Prefill(&ctx);
  // Nothing is sent, and the stream is not half-closed.
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  auto lookup = (*client)->Lookup(1, std::vector<ChunkKey>{KeyOf(1)});
  EXPECT_EQ(lookup.status().code(), absl::StatusCode::kNotFound) << lookup.status();
}

// Open Put streams are bounded by max_put_buffer (each counts stream_window +
// max_frame_size, what gRPC may buffer for it outside the pool): past it, with no line
// to wait in, a Put is refused RESOURCE_EXHAUSTED with a retry hint, before the client
// sends any payload (accepted streams get headers at once; the client waits for them).
// A place comes back when a stream ends.
TEST_F(BadInputTest, PutStreamsPastMaxPutBufferAreRefusedBeforeTheirPayload) {
  // 2 streams of 2 MiB window + 256 KiB frame; none may wait.
  Start({"--max-put-buffer=5MiB", "--max-put-waiters=0"});
  const std::string data = PatternBytes(3, kChunk);
  std::vector<std::unique_ptr<OpenPut>> holders;
  for (int i = 0; i < 2; ++i) holders.push_back(HoldPutPlace(10 + i, data));
  EXPECT_EQ(Metric("kvtier_put_streams_open"), 2);
  ExpectPutRefusedAtOnce("max_put_buffer");
  EXPECT_EQ(Metric("kvtier_put_streams_refused_total"), 1);
  // A C++ client that does not retry sees the same refusal as a status; nothing is stored.
  ClientOptions no_retry;
  no_retry.max_frame_bytes = kFrameLimit;
  no_retry.retry_refused_puts = false;
  auto once = KvTierClient::Connect(daemon_->target(), no_retry);
  ASSERT_TRUE(once.ok());
  ChunkToPut c{KeyOf(20), data, 256};
  auto put = (*once)->Put(ns_, {&c, 1});
  EXPECT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted) << put.status();
  EXPECT_EQ(Metric("kvtier_put_streams_refused_total"), 2);
  // One that retries (the default) backs off as the hint says and tries again: its Put
  // gets in once a holder ends and its place comes back.
  absl::StatusOr<PutResult> retried;
  std::thread putter([&] { retried = client_->Put(ns_, {&c, 1}); });
  for (int i = 0; i < 1000 && Metric("kvtier_put_streams_refused_total") < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(Metric("kvtier_put_streams_refused_total"), 4) << "refused, and refused again";
  holders.back()->ctx.TryCancel();
  holders.back()->w->Finish().IgnoreError();
  holders.pop_back();
  putter.join();
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->stored, 1u);
  holders.back()->ctx.TryCancel();
  holders.back()->w->Finish().IgnoreError();
}

// Past max_put_buffer a Put waits in line (max_put_waiters) with no headers, so the
// client sends nothing; a place given back goes to the first in line, which gets its
// headers and goes on. Past the line, RESOURCE_EXHAUSTED at once; a waiter the client
// cancels leaves the line and takes no place.
TEST_F(BadInputTest, PutStreamsPastMaxPutBufferWaitInLineForAPlace) {
  // 2 streams within max_put_buffer, 1 in line; no wait ends while the test looks.
  // Quiet holders keep their places (put_place_idle off: the next test covers it).
  Start({"--max-put-buffer=5MiB", "--max-put-waiters=1", "--put-wait=120s",
         "--put-place-idle=0"});
  const std::string data = PatternBytes(5, kChunk);
  std::vector<std::unique_ptr<OpenPut>> holders;
  for (int i = 0; i < 2; ++i) holders.push_back(HoldPutPlace(10 + i, data));
  ASSERT_EQ(Metric("kvtier_put_streams_open"), 2);
  // The C++ client's Put waits in line (its thread blocks on the headers, the daemon's
  // none) and is stored once a holder ends; nothing of it is refused.
  absl::StatusOr<PutResult> waited;
  ChunkToPut c{KeyOf(20), data, 256};
  std::thread putter([&] { waited = client_->Put(ns_, {&c, 1}); });
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_waiting") == 1; }))
      << Metric("kvtier_put_streams_waiting");
  // The line is full: the next Put is refused at once, with the retry hint.
  ExpectPutRefusedAtOnce("max_put_waiters");
  EXPECT_EQ(Metric("kvtier_put_streams_refused_total"), 1);
  EXPECT_EQ(RamUsed(), baseline_ram_ + 2 * kChunk) << "the waiter took no room";
  holders.back()->ctx.TryCancel();
  holders.back()->w->Finish().IgnoreError();
  holders.pop_back();
  putter.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->stored, 1u);
  EXPECT_EQ(Metric("kvtier_put_streams_waited_total"), 1);
  EXPECT_EQ(Metric("kvtier_put_streams_refused_total"), 1) << "the waiter was not refused";
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(20)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_TRUE((*got)[0].found);
  EXPECT_EQ((*got)[0].data, data);

  // Both places taken again; a raw waiter gets no headers, and cancelled, leaves the line.
  holders.push_back(HoldPutPlace(12, data));
  ASSERT_EQ(Metric("kvtier_put_streams_open"), 2);
  {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto w = client_->stub()->Put(&ctx, &resp);
    ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_waiting") == 1; }));
    ctx.TryCancel();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_waiting") == 0; }));
  // Its place was never taken: the holders' two end, and both places are free.
  for (auto& h : holders) {
    h->ctx.TryCancel();
    h->w->Finish().IgnoreError();
  }
  holders.clear();
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_open") == 0; }))
      << Metric("kvtier_put_streams_open");
  EXPECT_EQ(Metric("kvtier_put_streams_waited_total"), 1);
  // The cancelled holders stored nothing; the waiter's chunk is all the pool holds.
  ASSERT_TRUE(Eventually([&] { return RamUsed() == baseline_ram_ + kChunk; })) << RamUsed();
  auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(10), KeyOf(11), KeyOf(20)});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->tiers[0], v1::TIER_UNSPECIFIED);
  EXPECT_EQ(l->tiers[1], v1::TIER_UNSPECIFIED);
  EXPECT_NE(l->tiers[2], v1::TIER_UNSPECIFIED);
}

// Each Put the daemon reads to its end says on its trailers whether its Put places are
// plentiful (kvtier-put-places: free / scarce). The C++ client sends its next Put's
// frames without waiting for the headers only after "free": such a Put, meeting a full
// daemon, has its frames in gRPC's window while it waits in line; one after "scarce"
// (or from a client that always waits) sends nothing until it gets a place. Both are
// stored once places come back.
TEST_F(BadInputTest, PutsSkipTheHeaderWaitOnlyAfterTheDaemonSaidPlacesAreFree) {
  // 2 places (2 MiB window + 256 KiB frame each), a line of 2 that does not expire.
  Start({"--max-put-buffer=5MiB", "--max-put-waiters=2", "--put-wait=120s",
         "--put-place-idle=0"});
  const std::string data = PatternBytes(7, kChunk);
  const uint32_t crc = crc32c::Value(data);
  // A whole chunk on a raw stream; returns the trailer.
  auto raw_put = [&](uint64_t key) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto w = client_->stub()->Put(&ctx, &resp);
    for (uint64_t off = 0; off < kChunk; off += kFrameLimit) {
      const bool last = off + kFrameLimit == kChunk;
      EXPECT_TRUE(w->Write(Frame(KeyOf(key), off, data.substr(off, kFrameLimit),
                                 last ? std::optional<uint32_t>(crc) : std::nullopt)));
    }
    w->WritesDone();
    EXPECT_TRUE(w->Finish().ok());
    auto it = ctx.GetServerTrailingMetadata().find("kvtier-put-places");
    return it == ctx.GetServerTrailingMetadata().end()
               ? std::string("(none)")
               : std::string(it->second.data(), it->second.size());
  };
  EXPECT_EQ(raw_put(1), "free") << "both places free";
  std::vector<std::unique_ptr<OpenPut>> holders;
  auto release_all = [&] {
    for (auto& h : holders) {
      h->ctx.TryCancel();
      h->w->Finish().IgnoreError();
    }
    holders.clear();
  };
  holders.push_back(HoldPutPlace(10, data));
  EXPECT_EQ(raw_put(2), "scarce") << "one of two places free";
  release_all();
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_open") == 0; }));

  ClientOptions adaptive;  // The default.
  adaptive.max_frame_bytes = kFrameLimit;
  ClientOptions always = adaptive;
  always.put_header_wait = ClientOptions::PutHeaderWait::kAlways;
  auto skipper = KvTierClient::Connect(daemon_->target(), adaptive);
  auto waiter = KvTierClient::Connect(daemon_->target(), always);
  ASSERT_TRUE(skipper.ok() && waiter.ok());
  // Each says "free" to a client alone on the daemon.
  for (auto* c : {skipper->get(), waiter->get()}) {
    ChunkToPut chunk{KeyOf(c == skipper->get() ? 3 : 4), data, 256};
    ASSERT_TRUE(c->Put(ns_, {&chunk, 1}).ok());
  }
  for (int i = 0; i < 2; ++i) holders.push_back(HoldPutPlace(10 + i, data));
  ASSERT_EQ(Metric("kvtier_put_streams_open"), 2);
  std::atomic<uint64_t> skipper_sent{0}, waiter_sent{0};
  absl::StatusOr<PutResult> skipped, waited;
  ChunkToPut c5{KeyOf(5), data, 256}, c6{KeyOf(6), data, 256};
  std::thread t5([&] {
    skipped = (*skipper)->Put(ns_, {&c5, 1}, [&](uint64_t sent, uint64_t) { skipper_sent = sent; });
  });
  // In line, and every byte of it already sent: it did not wait for headers.
  ASSERT_TRUE(Eventually([&] {
    return Metric("kvtier_put_streams_waiting") == 1 && skipper_sent.load() == kChunk;
  })) << skipper_sent.load();
  std::thread t6([&] {
    waited = (*waiter)->Put(ns_, {&c6, 1}, [&](uint64_t sent, uint64_t) { waiter_sent = sent; });
  });
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_waiting") == 2; }));
  EXPECT_EQ(waiter_sent.load(), 0u) << "a client that always waits sends nothing in line";
  release_all();
  t5.join();
  t6.join();
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(skipped->stored, 1u);
  EXPECT_EQ(waited->stored, 1u);
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_open") == 0; }));

  // After "scarce" the adaptive client waits again.
  holders.push_back(HoldPutPlace(10, data));
  ChunkToPut c7{KeyOf(7), data, 256}, c8{KeyOf(8), data, 256};
  ASSERT_TRUE((*skipper)->Put(ns_, {&c7, 1}).ok());  // Told "scarce": one place held.
  holders.push_back(HoldPutPlace(11, data));
  std::atomic<uint64_t> sent8{0};
  absl::StatusOr<PutResult> put8;
  std::thread t8([&] {
    put8 = (*skipper)->Put(ns_, {&c8, 1}, [&](uint64_t sent, uint64_t) { sent8 = sent; });
  });
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_waiting") == 1; }));
  EXPECT_EQ(sent8.load(), 0u) << "after scarce, the client waits for its headers";
  release_all();
  t8.join();
  ASSERT_TRUE(put8.ok()) << put8.status();
  auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(5), KeyOf(6), KeyOf(7), KeyOf(8)});
  ASSERT_TRUE(l.ok()) << l.status();
  for (int i = 0; i < 4; ++i) EXPECT_NE(l->tiers[i], v1::TIER_UNSPECIFIED) << i;
}

// A Put that holds a place and sends nothing for put_place_idle while another waits in
// line is cancelled, and its place goes to the line: one holder per waiter, and none
// while nobody waits (client_idle_timeout, far off here, is the only bound then).
TEST_F(BadInputTest, AQuietPutGivesItsPlaceToTheLineAfterPutPlaceIdle) {
  Start({"--max-put-buffer=5MiB", "--max-put-waiters=4", "--put-wait=10m",
         "--put-place-idle=100ms", "--client-idle-timeout=10m"});
  const std::string data = PatternBytes(6, kChunk);
  std::vector<std::unique_ptr<OpenPut>> holders;
  for (int i = 0; i < 2; ++i) holders.push_back(HoldPutPlace(10 + i, data));
  ASSERT_EQ(Metric("kvtier_put_streams_open"), 2);
  // The C++ client's Put waits in line. Neither holder ends, yet it is stored: one of
  // them gave its place up.
  ChunkToPut c{KeyOf(20), data, 256};
  absl::StatusOr<PutResult> waited = client_->Put(ns_, {&c, 1});
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->stored, 1u);
  EXPECT_EQ(Metric("kvtier_put_streams_waited_total"), 1);
  // Both holders have been quiet for longer than put_place_idle by now, but nobody waits:
  // exactly one was cancelled, the other keeps its place and finishes its chunk.
  int cancelled = 0, stored = 0;
  for (auto& h : holders) {
    bool open = true;
    for (size_t off = kFrameLimit; open && off < kChunk; off += kFrameLimit) {
      const bool last = off + kFrameLimit == kChunk;
      open = h->w->Write(Frame(h == holders[0] ? KeyOf(10) : KeyOf(11), off,
                               data.substr(off, kFrameLimit),
                               last ? std::optional<uint32_t>(crc32c::Value(data))
                                    : std::nullopt));
    }
    if (open) h->w->WritesDone();
    grpc::Status st = h->w->Finish();
    if (st.error_code() == grpc::StatusCode::CANCELLED) {
      ++cancelled;  // TryCancel: the client sees gRPC's "Cancelled on the server side".
    } else {
      EXPECT_TRUE(st.ok()) << st.error_message();
      EXPECT_EQ(h->resp.chunks_stored(), 1u);
      ++stored;
    }
  }
  EXPECT_EQ(cancelled, 1);
  EXPECT_EQ(stored, 1);
  EXPECT_EQ(Metric("kvtier_put_places_reclaimed_total"), 1);
  EXPECT_EQ(Metric("kvtier_client_stalls_cancelled_total"), 1);
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_put_streams_open") == 0; }));
  // The reclaimed holder's chunk was not stored; the other two were, byte for byte.
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(10), KeyOf(11), KeyOf(20)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 3u);
  int found = 0;
  for (const auto& g : *got) {
    if (!g.found) continue;
    ++found;
    EXPECT_EQ(g.data, data);
  }
  EXPECT_EQ(found, 2);
  EXPECT_TRUE((*got)[2].found);
}

// Puts that find RAM full wait for room (put_wait) in arrival order without a daemon
// thread each; a waiting stream the client cancels leaves the queue and takes no room.
TEST_F(BadInputTest, WaitingPutsHoldNoThreadAndCancelCleanly) {
  // No waiter may time out while the test looks; max_put_buffer admits all 48 streams
  // (the default's 64 MiB floor admits 28 on this pool, and refuses the rest).
  Start({"--put-wait=120s", "--max-put-buffer=128MiB"});
  struct Stream {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::PutFrame>> w;
  };
  const std::string data = PatternBytes(7, kChunk);
  auto open = [&](uint64_t key) {
    auto s = std::make_unique<Stream>();
    s->w = client_->stub()->Put(&s->ctx, &s->resp);
    EXPECT_TRUE(s->w->Write(Frame(KeyOf(key), 0, data.substr(0, kFrameLimit))));
    return s;
  };
  // Puts in flight fill the pool: each stream sent its chunk's first frame and stops.
  constexpr int kHolders = 32, kWaiters = 16;  // 32 MiB of 1 MiB chunks.
  std::vector<std::unique_ptr<Stream>> holders, waiters;
  for (int i = 0; i < kHolders; ++i) holders.push_back(open(100 + i));
  ASSERT_TRUE(Eventually([&] { return RamUsed() == kHolders * kChunk; })) << RamUsed();
  const int threads_before = DaemonThreads();
  for (int i = 0; i < kWaiters; ++i) waiters.push_back(open(200 + i));
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_puts_waiting") == kWaiters; }))
      << Metric("kvtier_puts_waiting");
  EXPECT_LT(DaemonThreads() - threads_before, kWaiters / 2)
      << "waiting puts must not each hold a thread (" << threads_before << " threads before)";
  // Cancelled waiters leave the queue; nothing of theirs is held.
  for (auto& s : waiters) {
    s->ctx.TryCancel();
    EXPECT_EQ(s->w->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(Eventually([&] { return Metric("kvtier_puts_waiting") == 0; }));
  EXPECT_EQ(RamUsed(), kHolders * kChunk);
  // With the pool still full, a first frame that can never be stored (larger than its
  // 64 KiB chunk, or completing it without crc32c) is refused INVALID_ARGUMENT at once:
  // it does not queue for room and then get the retryable RESOURCE_EXHAUSTED.
  LayoutSpec small = LayoutOfMiB(1);
  small.tokens_per_chunk = 16;  // 64 KiB chunks.
  auto small_ns = client_->RegisterLayout(small);
  ASSERT_TRUE(small_ns.ok()) << small_ns.status();
  const double queued = Metric("kvtier_puts_queued_total");
  grpc::Status too_big =
      SendPut({Frame(KeyOf(400), 0, data.substr(0, 128 << 10), 1, small_ns->namespace_id)});
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << too_big.error_message();
  EXPECT_NE(too_big.error_message().find("payload size wrong"), std::string::npos);
  grpc::Status no_crc =
      SendPut({Frame(KeyOf(401), 0, data.substr(0, 64 << 10), std::nullopt, small_ns->namespace_id)});
  EXPECT_EQ(no_crc.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << no_crc.error_message();
  EXPECT_EQ(Metric("kvtier_puts_queued_total"), queued) << "they must not have waited";
  // Room appears when a holder gives up: a new put gets it and completes.
  holders.back()->ctx.TryCancel();
  holders.back()->w->Finish();
  holders.pop_back();
  std::vector<v1::PutFrame> whole = WholeChunk(KeyOf(300), data, crc32c::Value(data));
  grpc::Status put = SendPut(whole);
  EXPECT_TRUE(put.ok()) << put.error_message();
  for (auto& s : holders) {
    s->ctx.TryCancel();
    s->w->Finish();
  }
  ASSERT_TRUE(Eventually([&] { return RamUsed() == kChunk; })) << RamUsed();
  EXPECT_GE(Metric("kvtier_puts_queued_total"), kWaiters);  // The last put may have waited.
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
  // The client's bytes disagree with its checksum: a bad request (DATA_LOSS is for
  // stored chunks found corrupt).
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("CRC32C"), std::string::npos) << s.error_message();
  ExpectNothingLeft(KeyOf(1));

  auto no_crc = WholeChunk(KeyOf(1), data, std::nullopt);
  grpc::Status s2 = SendPut(no_crc);
  EXPECT_EQ(s2.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s2.error_message().find("crc32c"), std::string::npos) << s2.error_message();
  ExpectNothingLeft(KeyOf(1));

  // Counted as the client's mismatch, not as a stored chunk gone bad (what Stats'
  // checksum_failures and the KvtierChecksumFailures alert are about).
  EXPECT_EQ(Metric("kvtier_put_checksum_mismatches_total"), 1);
  EXPECT_EQ(Metric("kvtier_checksum_failures_total{source=\"ssd\"}"), 0);
  EXPECT_EQ(Metric("kvtier_checksum_failures_total{source=\"ram\"}"), 0);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->checksum_failures(), 0u);
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
