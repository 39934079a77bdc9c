// PrefillSession (client/prefill_session.h), the worker's side of a Cake prefill.
//
// Two halves:
//  - FakePrefillTest: an in-process gRPC server whose Prefill handler is a script, so
//    each test can send exactly what a correct or a broken daemon would (frames cut
//    short, a bad CRC32C, chunks out of order, a Done that contradicts the stream) and
//    check that the session accepts the first and refuses the others.
//  - DaemonPrefillTest: a real kvtierd on port 0. Workers that compute fast, never
//    compute, or race the stream; each checks that computed and streamed chunks cover
//    [0, h) exactly once and that every streamed chunk is byte-identical to what was Put.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/kvtier_client.h"
#include "client/prefill_session.h"
#include "gtest/gtest.h"
#include "storage/chunk_key.h"
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

using PrefillStream =
    grpc::ServerReaderWriter<v1::PrefillServerMessage, v1::PrefillClientMessage>;

// Collects what a session hands to on_chunk: every delivery, so a chunk delivered twice
// is caught, not overwritten.
class ChunkSink {
 public:
  std::function<void(uint32_t, std::string, v1::Tier)> Callback() {
    return [this](uint32_t index, std::string data, v1::Tier tier) {
      absl::MutexLock l(&mu_);
      deliveries_.push_back(index);
      chunks_[index] = std::move(data);
      tiers_[index] = tier;
    };
  }
  std::vector<uint32_t> deliveries() const {
    absl::MutexLock l(&mu_);
    return deliveries_;
  }
  std::map<uint32_t, std::string> chunks() const {
    absl::MutexLock l(&mu_);
    return chunks_;
  }
  std::map<uint32_t, v1::Tier> tiers() const {
    absl::MutexLock l(&mu_);
    return tiers_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<uint32_t> deliveries_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, std::string> chunks_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, v1::Tier> tiers_ ABSL_GUARDED_BY(mu_);
};

// The exactly-once contract, checked from the worker's side: on_chunk delivered exactly
// [s, h), each once, in decreasing order; the result's sources say the same; and the
// worker's computation (what it reported plus what the result leaves it to compute)
// covers [0, s).
void ExpectExactlyOnce(const PrefillResult& r, const ChunkSink& sink) {
  const uint32_t s = r.first_streamed, h = r.cached_prefix;
  ASSERT_LE(s, h);
  std::vector<uint32_t> want;
  for (uint32_t i = h; i > s; --i) want.push_back(i - 1);
  EXPECT_EQ(sink.deliveries(), want) << "on_chunk must deliver [s, h) once, downward";
  ASSERT_EQ(r.sources.size(), h);
  for (uint32_t i = 0; i < h; ++i) {
    EXPECT_EQ(r.sources[i], i < s ? ChunkSource::kComputed : ChunkSource::kStreamed) << i;
  }
  EXPECT_EQ(r.chunks_streamed, h - s);
  EXPECT_EQ(r.compute_end, s);
  EXPECT_EQ(r.compute_begin, std::min(r.computed_reported, s));
  // Computed: [0, computed_reported) by the worker so far, then [compute_begin, s).
  std::vector<int> covered(h, 0);
  for (uint32_t i = 0; i < std::min(r.computed_reported, s); ++i) ++covered[i];
  for (uint32_t i = r.compute_begin; i < r.compute_end; ++i) ++covered[i];
  for (uint32_t i = s; i < h; ++i) ++covered[i];  // Streamed (the copy used).
  for (uint32_t i = 0; i < h; ++i) EXPECT_EQ(covered[i], 1) << "chunk " << i;
}

// ------------------------------------------------------------------------------------
// Against a scripted fake daemon.

class FakePrefillService final : public v1::KvCache::Service {
 public:
  using Script = std::function<grpc::Status(grpc::ServerContext*, PrefillStream*)>;
  void set_script(Script script) { script_ = std::move(script); }
  grpc::Status Prefill(grpc::ServerContext* ctx, PrefillStream* stream) override {
    return script_(ctx, stream);
  }
  // Names the layout's chunk size once set (0: DataPlane says nothing of namespaces, as a
  // daemon that does not know the namespace).
  void set_layout_chunk_bytes(uint64_t bytes) { layout_chunk_bytes_ = bytes; }
  grpc::Status DataPlane(grpc::ServerContext*, const v1::DataPlaneRequest*,
                         v1::DataPlaneResponse* resp) override {
    if (layout_chunk_bytes_ != 0) {
      resp->set_chunk_bytes(layout_chunk_bytes_);
      resp->set_num_layers(1);
    }
    return grpc::Status::OK;
  }

 private:
  Script script_;
  std::atomic<uint64_t> layout_chunk_bytes_{0};
};

constexpr uint64_t kFakeChunkBytes = 1000;

std::string FakeChunk(uint32_t index) { return PatternBytes(100 + index, kFakeChunkBytes); }

v1::PrefillServerMessage PlanMessage(uint32_t h, uint64_t chunk_bytes = kFakeChunkBytes) {
  v1::PrefillServerMessage m;
  v1::PrefillPlan& plan = *m.mutable_plan();
  plan.set_cached_prefix(h);
  for (uint32_t i = 0; i < h; ++i) plan.add_tiers(v1::TIER_RAM);
  plan.set_predicted_meeting(h / 2);
  plan.set_chunk_bytes(chunk_bytes);
  return m;
}

v1::PrefillServerMessage FrameMessage(uint32_t index, uint64_t offset, std::string data,
                                      bool last, uint32_t crc) {
  v1::PrefillServerMessage m;
  v1::PrefillChunkFrame& f = *m.mutable_chunk();
  f.set_index(index);
  f.set_offset(offset);
  f.set_data(std::move(data));
  f.set_last(last);
  if (offset == 0) {
    f.set_crc32c(crc);
    f.set_tier(v1::TIER_RAM);
  }
  return m;
}

// Streams FakeChunk(index) in two frames (the first `split` bytes, then the rest).
void SendChunk(PrefillStream* stream, uint32_t index, uint64_t split = 400) {
  const std::string data = FakeChunk(index);
  const uint32_t crc = crc32c::Value(data);
  stream->Write(FrameMessage(index, 0, data.substr(0, split), false, crc));
  stream->Write(FrameMessage(index, split, data.substr(split), true, crc));
}

// Sends bytes [offset, offset + bytes) of FakeChunk(index) as one frame.
void SendRaw(PrefillStream* stream, uint32_t index, uint64_t offset, uint64_t bytes,
             bool last) {
  const std::string data = FakeChunk(index);
  stream->Write(FrameMessage(index, offset, data.substr(offset, bytes), last,
                             crc32c::Value(data)));
}

v1::PrefillServerMessage DoneMessage(uint32_t s, v1::PrefillDone::Reason reason) {
  v1::PrefillServerMessage m;
  m.mutable_done()->set_first_streamed(s);
  m.mutable_done()->set_reason(reason);
  return m;
}

// Reads the Open; returns the number of keys it carries (-1 if the first message was not
// an Open).
int ReadOpen(PrefillStream* stream, v1::PrefillOpen* open_out = nullptr) {
  v1::PrefillClientMessage m;
  if (!stream->Read(&m) || !m.has_open()) return -1;
  if (open_out != nullptr) *open_out = m.open();
  return m.open().keys_size();
}

// Reads client messages until Progress.computed >= k; false if the client half-closed
// or the call ended first.
bool AwaitProgress(PrefillStream* stream, uint32_t k) {
  v1::PrefillClientMessage m;
  while (stream->Read(&m)) {
    if (m.has_progress() && m.progress().computed() >= k) return true;
  }
  return false;
}

class FakePrefillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.rpc_deadline = absl::Seconds(20);
    auto c = KvTierClient::Connect(absl::StrCat("127.0.0.1:", port_), options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  absl::StatusOr<std::unique_ptr<PrefillSession>> Start(uint32_t n, ChunkSink* sink) {
    std::vector<ChunkKey> keys;
    for (uint32_t i = 0; i < n; ++i) keys.push_back(KeyOf(i));
    PrefillOptions options;
    if (sink != nullptr) options.on_chunk = sink->Callback();
    return PrefillSession::Start(*client_, /*namespace_id=*/42, std::move(keys),
                                 std::move(options));
  }

  FakePrefillService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<KvTierClient> client_;
};

// Waits (up to 10 s) until pred() holds.
bool Eventually(const std::function<bool()>& pred) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!pred()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST_F(FakePrefillTest, MeetsInTheMiddle) {
  v1::PrefillOpen open;
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    EXPECT_EQ(ReadOpen(stream, &open), 6);
    stream->Write(PlanMessage(4));
    SendChunk(stream, 3);
    SendChunk(stream, 2);
    EXPECT_TRUE(AwaitProgress(stream, 2));
    stream->Write(DoneMessage(2, v1::PrefillDone::MET));
    AwaitProgress(stream, 100);  // Until the client half-closes.
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(6, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  PrefillSession& s = **session;
  EXPECT_EQ(s.plan().cached_prefix(), 4u);
  EXPECT_TRUE(s.ShouldCompute(4));  // Uncached chunks are always the worker's.
  EXPECT_TRUE(s.ShouldCompute(5));
  ASSERT_TRUE(Eventually([&] { return !s.ShouldCompute(2); }));
  EXPECT_FALSE(s.ShouldCompute(3));
  EXPECT_TRUE(s.ShouldCompute(1));
  ASSERT_TRUE(s.ReportComputed(0).ok());
  ASSERT_TRUE(s.ReportComputed(1).ok());
  auto r = s.Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 2u);
  EXPECT_EQ(r->reason, v1::PrefillDone::MET);
  EXPECT_EQ(r->computed_reported, 2u);
  EXPECT_EQ(r->compute_begin, 2u);
  EXPECT_EQ(r->bytes_streamed, 2 * kFakeChunkBytes);
  ExpectExactlyOnce(*r, sink);
  auto chunks = sink.chunks();
  EXPECT_TRUE(chunks[3] == FakeChunk(3));
  EXPECT_TRUE(chunks[2] == FakeChunk(2));
  EXPECT_EQ(sink.tiers()[3], v1::TIER_RAM);
  EXPECT_EQ(open.namespace_id(), 42u);
  EXPECT_FALSE(open.has_compute_estimate());
  EXPECT_EQ(open.keys(5), KeyOf(5).ToByteString());
}

TEST_F(FakePrefillTest, SendsOptionsInOpen) {
  v1::PrefillOpen open;
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream, &open);
    stream->Write(PlanMessage(0));
    stream->Write(DoneMessage(0, v1::PrefillDone::NOTHING_CACHED));
    return grpc::Status::OK;
  });
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{0.25, 0.5};
  options.max_bytes_per_second = 12345;
  options.max_frame_bytes = 4096;
  auto session = PrefillSession::Start(*client_, 7, {KeyOf(1)}, options);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE((*session)->ShouldCompute(0));
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::NOTHING_CACHED);
  EXPECT_TRUE(r->sources.empty());
  EXPECT_EQ(open.compute_estimate().a_seconds(), 0.25);
  EXPECT_EQ(open.compute_estimate().b_seconds(), 0.5);
  EXPECT_EQ(open.max_bytes_per_second(), 12345u);
  EXPECT_EQ(open.max_frame_bytes(), 4096u);
}

TEST_F(FakePrefillTest, ShouldComputeTurnsFalseAtTheFirstFrameAndFinishWaitsForTheChunk) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(4));
    const std::string data = FakeChunk(3);
    const uint32_t crc = crc32c::Value(data);
    stream->Write(FrameMessage(3, 0, data.substr(0, 10), false, crc));
    // The client reports chunk 0 once it saw chunk 3 start; only then finish chunk 3.
    EXPECT_TRUE(AwaitProgress(stream, 1));
    stream->Write(FrameMessage(3, 10, data.substr(10), true, crc));
    stream->Write(DoneMessage(3, v1::PrefillDone::MET));
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(6, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  PrefillSession& s = **session;
  ASSERT_TRUE(Eventually([&] { return !s.ShouldCompute(3); }));
  EXPECT_TRUE(sink.deliveries().empty());  // Started, not complete.
  EXPECT_TRUE(s.ShouldCompute(2));
  ASSERT_TRUE(s.ReportComputed(0).ok());
  auto r = s.Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 3u);
  EXPECT_EQ(r->compute_begin, 1u);  // The worker still computes 1 and 2.
  EXPECT_EQ(r->compute_end, 3u);
  ExpectExactlyOnce(*r, sink);
}

TEST_F(FakePrefillTest, PartialChunkBelowFirstStreamedIsDiscarded) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(4));
    SendChunk(stream, 3);
    const std::string data = FakeChunk(2);
    stream->Write(FrameMessage(2, 0, data.substr(0, 300), false, crc32c::Value(data)));
    EXPECT_TRUE(AwaitProgress(stream, 3));  // The worker computed chunk 2 meanwhile.
    stream->Write(DoneMessage(3, v1::PrefillDone::MET));
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(4, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  PrefillSession& s = **session;
  ASSERT_TRUE(Eventually([&] { return !s.ShouldCompute(2); }));
  // A worker that had already begun chunk 2 finishes and reports it.
  ASSERT_TRUE(s.ReportComputed(2).ok());
  ASSERT_TRUE(Eventually([&] { return s.ShouldCompute(2); }));  // Done: s = 3.
  EXPECT_FALSE(s.ShouldCompute(3));
  auto r = s.Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 3u);
  EXPECT_EQ(r->bytes_discarded, 300u);
  EXPECT_EQ(r->compute_begin, 3u);
  EXPECT_EQ(r->compute_end, 3u);
  ExpectExactlyOnce(*r, sink);
}

TEST_F(FakePrefillTest, RaceOnTheMeetingChunkIsCountedOnce) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(4));
    EXPECT_TRUE(AwaitProgress(stream, 3));
    SendChunk(stream, 3);  // Both sides did chunk 3.
    stream->Write(DoneMessage(3, v1::PrefillDone::MET));
    AwaitProgress(stream, 100);
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(4, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  PrefillSession& s = **session;
  for (uint32_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(s.ShouldCompute(i));
    ASSERT_TRUE(s.ReportComputed(i).ok());
  }
  ASSERT_TRUE(Eventually([&] { return !sink.deliveries().empty(); }));
  // The worker computed chunk 3 too before it looked.
  ASSERT_TRUE(s.ReportComputed(3).ok());
  auto r = s.Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 3u);
  EXPECT_EQ(r->raced, 1u);
  EXPECT_EQ(r->computed_reported, 4u);
  ExpectExactlyOnce(*r, sink);
}

TEST_F(FakePrefillTest, WorkerWithEverythingComputedHalfClosesWithoutWaiting) {
  std::atomic<bool> half_closed{false};
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3));
    // Sends nothing until the client half-closes: a session that waited for Done
    // before half-closing would hang here until its deadline.
    AwaitProgress(stream, 100);
    half_closed = true;
    stream->Write(DoneMessage(3, v1::PrefillDone::CLIENT_DONE));
    return grpc::Status::OK;
  });
  auto session = Start(5, nullptr);
  ASSERT_TRUE(session.ok()) << session.status();
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE((*session)->ReportComputed(i).ok());
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(half_closed);
  EXPECT_EQ(r->first_streamed, 3u);
  EXPECT_EQ(r->compute_begin, 3u);
  EXPECT_EQ(r->compute_end, 3u);
}

TEST_F(FakePrefillTest, NeverComputingWorkerGetsEverything) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3));
    for (uint32_t i = 3; i > 0; --i) SendChunk(stream, i - 1, /*split=*/kFakeChunkBytes);
    stream->Write(DoneMessage(0, v1::PrefillDone::ALL_STREAMED));
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(3, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 0u);
  EXPECT_EQ(r->reason, v1::PrefillDone::ALL_STREAMED);
  EXPECT_EQ(r->compute_begin, 0u);
  EXPECT_EQ(r->compute_end, 0u);
  ExpectExactlyOnce(*r, sink);
  for (auto& [i, data] : sink.chunks()) EXPECT_TRUE(data == FakeChunk(i)) << i;
  EXPECT_FALSE((*session)->ShouldCompute(0));
}

// Each broken daemon below must make Finish fail with `code` and a message naming the
// problem; the worker then holds nothing, so ShouldCompute says yes to every chunk.
struct BrokenCase {
  const char* name;
  std::function<void(PrefillStream*)> script;  // After Open and a Plan with h = 4.
  absl::StatusCode code;
  const char* message;
};

class BrokenDaemonTest : public FakePrefillTest,
                         public ::testing::WithParamInterface<BrokenCase> {};

TEST_P(BrokenDaemonTest, FinishFailsAndTheWorkerHoldsNothing) {
  const BrokenCase& c = GetParam();
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(4));
    c.script(stream);
    AwaitProgress(stream, 100);  // Until the client cancels or half-closes.
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(4, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), c.code) << r.status();
  EXPECT_NE(r.status().message().find(c.message), absl::string_view::npos) << r.status();
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE((*session)->ShouldCompute(i)) << i;
}

INSTANTIATE_TEST_SUITE_P(
    Protocol, BrokenDaemonTest,
    ::testing::Values(
        BrokenCase{"BadCrc",
                   [](PrefillStream* s) {
                     std::string data = FakeChunk(3);
                     const uint32_t crc = crc32c::Value(data);
                     data[500] ^= 1;
                     s->Write(FrameMessage(3, 0, data, true, crc));
                   },
                   absl::StatusCode::kDataLoss, "failed its CRC32C"},
        BrokenCase{"IncreasingIndex",
                   [](PrefillStream* s) {
                     SendChunk(s, 2);
                     SendChunk(s, 3);
                   },
                   absl::StatusCode::kInternal, "must strictly decrease"},
        BrokenCase{"InterleavedChunks",
                   [](PrefillStream* s) {
                     SendRaw(s, 3, 0, 100, false);
                     SendRaw(s, 2, 0, 100, false);
                   },
                   absl::StatusCode::kInternal, "while chunk 3 had 100"},
        BrokenCase{"OffsetGap",
                   [](PrefillStream* s) {
                     SendRaw(s, 3, 0, 100, false);
                     SendRaw(s, 3, 200, 800, true);
                   },
                   absl::StatusCode::kInternal, "offset 200"},
        BrokenCase{"ShortChunk",
                   [](PrefillStream* s) { SendRaw(s, 3, 0, 999, true); },
                   absl::StatusCode::kInternal, "after 999 of 1000"},
        BrokenCase{"IndexBeyondPlan",
                   [](PrefillStream* s) { SendRaw(s, 4, 0, 1000, true); },
                   absl::StatusCode::kInternal, ">= cached_prefix"},
        BrokenCase{"MissingChunkInStreamedRange",
                   [](PrefillStream* s) {
                     SendChunk(s, 3);
                     SendChunk(s, 1);
                     s->Write(DoneMessage(1, v1::PrefillDone::MET));
                   },
                   absl::StatusCode::kInternal, "chunk 2 of [1, 4) never arrived"},
        BrokenCase{"CompleteChunkBelowFirstStreamed",
                   [](PrefillStream* s) {
                     SendChunk(s, 3);
                     SendChunk(s, 2);
                     s->Write(DoneMessage(3, v1::PrefillDone::MET));
                   },
                   absl::StatusCode::kInternal, "chunk 2 was streamed complete"},
        BrokenCase{"DoneWhileStreamedChunkIncomplete",
                   [](PrefillStream* s) {
                     SendRaw(s, 3, 0, 100, false);
                     s->Write(DoneMessage(3, v1::PrefillDone::MET));
                   },
                   absl::StatusCode::kInternal, "had only 100"},
        BrokenCase{"FirstStreamedBeyondPlan",
                   [](PrefillStream* s) {
                     s->Write(DoneMessage(5, v1::PrefillDone::MET));
                   },
                   absl::StatusCode::kInternal, "first_streamed 5 > cached_prefix 4"},
        BrokenCase{"AllStreamedWithoutStreaming",
                   [](PrefillStream* s) {
                     s->Write(DoneMessage(4, v1::PrefillDone::ALL_STREAMED));
                   },
                   absl::StatusCode::kInternal, "ALL_STREAMED"},
        BrokenCase{"SecondPlan",
                   [](PrefillStream* s) { s->Write(PlanMessage(4)); },
                   absl::StatusCode::kInternal, "a second Plan"}),
    [](const ::testing::TestParamInfo<BrokenCase>& info) { return info.param.name; });

TEST_F(FakePrefillTest, CallEndingWithoutDoneIsInternal) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(2));
    SendChunk(stream, 1);
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(2, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_NE(r.status().message().find("without Done"), absl::string_view::npos);
  EXPECT_TRUE((*session)->ShouldCompute(1));
}

TEST_F(FakePrefillTest, ServerErrorMidStreamIsReturnedByFinish) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3));
    SendChunk(stream, 2);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down hard");
  });
  ChunkSink sink;
  auto session = Start(3, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_EQ(r.status().message(), "shutting down hard");
  EXPECT_TRUE((*session)->ShouldCompute(2));
}

TEST_F(FakePrefillTest, ErrorAfterAValidDoneKeepsTheResult) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3));
    SendChunk(stream, 2);
    stream->Write(DoneMessage(2, v1::PrefillDone::SHUTTING_DOWN));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvtierd is shutting down");
  });
  ChunkSink sink;
  auto session = Start(3, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::SHUTTING_DOWN);
  EXPECT_EQ(r->compute_end, 2u);
  ExpectExactlyOnce(*r, sink);
  EXPECT_FALSE((*session)->ShouldCompute(2));
  EXPECT_TRUE((*session)->ShouldCompute(1));
  EXPECT_EQ((*session)->Close().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*session)->Close().code(), absl::StatusCode::kUnavailable);  // Idempotent.
}

TEST_F(FakePrefillTest, MessageAfterDoneIsReportedByClose) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(2));
    SendChunk(stream, 1);
    stream->Write(DoneMessage(1, v1::PrefillDone::MET));
    SendChunk(stream, 0);
    AwaitProgress(stream, 100);
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(2, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->ReportComputed(0).ok());
  // Finish may or may not have seen the stray chunk by the time Done settled it.
  auto r = (*session)->Finish();
  if (!r.ok()) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  }
  const absl::Status closed = (*session)->Close();
  EXPECT_EQ(closed.code(), absl::StatusCode::kInternal) << closed;
  EXPECT_NE(closed.message().find("after Done"), absl::string_view::npos) << closed;
  EXPECT_EQ(sink.deliveries(), std::vector<uint32_t>{1});  // Never the stray chunk 0.
}

TEST_F(FakePrefillTest, FinishReturnsAtDoneWithoutWaitingForTheCallToEnd) {
  absl::Notification release;
  std::atomic<bool> call_ended{false};
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(1));
    SendChunk(stream, 0);
    stream->Write(DoneMessage(0, v1::PrefillDone::ALL_STREAMED));
    AwaitProgress(stream, 100);  // The half-close.
    release.WaitForNotificationWithTimeout(absl::Seconds(10));
    call_ended = true;
    return grpc::Status::OK;
  });
  auto session = Start(1, nullptr);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  // The daemon still holds the call: Finish returned on Done, not on the call's end.
  EXPECT_FALSE(call_ended.load());
  release.Notify();
  EXPECT_TRUE((*session)->Close().ok());
}

// The use_forecast refinements. The fake streams 1000-byte chunks at the planned rate
// `rate` and has begun chunk 3 of 4 (100 bytes in), then waits.
class ForecastTest : public FakePrefillTest {
 protected:
  std::unique_ptr<PrefillSession> Open(uint64_t rate, std::optional<ComputeEstimate> estimate,
                                       bool use_forecast = true) {
    service_.set_script([rate](grpc::ServerContext*, PrefillStream* stream) {
      ReadOpen(stream);
      v1::PrefillServerMessage plan = PlanMessage(4);
      plan.mutable_plan()->set_stream_bytes_per_second(rate);
      stream->Write(plan);
      SendRaw(stream, 3, 0, 100, false);
      AwaitProgress(stream, 100);  // Until the client goes away.
      return grpc::Status::OK;
    });
    PrefillOptions options;
    options.compute_estimate = estimate;
    options.use_forecast = use_forecast;
    auto s = PrefillSession::Start(*client_, 42, {KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3)},
                                   options);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    EXPECT_TRUE(Eventually([&] { return (*s)->stream_reached() == 3; }));
    return *std::move(s);
  }
};

TEST_F(ForecastTest, StandsAsideForAChunkTheStreamBringsSooner) {
  // 10 ms per chunk on the stream; 1 s per chunk to compute.
  auto s = Open(100000, ComputeEstimate{1.0, 0});
  ASSERT_NE(s, nullptr);
  EXPECT_FALSE(s->ShouldCompute(2));  // About 20 ms of stream.
  EXPECT_FALSE(s->ShouldCompute(0));  // About 40 ms.
  EXPECT_FALSE(s->ShouldCompute(3));  // In flight, and the stream is faster.
}

TEST_F(ForecastTest, ComputesWhenTheWorkerIsFaster) {
  auto s = Open(100000, ComputeEstimate{0.001, 0});
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->ShouldCompute(2));
  EXPECT_TRUE(s->ShouldCompute(3));  // 1 ms against 9 ms of stream left: overtake it.
}

TEST_F(ForecastTest, OvertakesASlowChunkInFlight) {
  // 1 s per chunk on the stream, 0.9 s of it left; 0.1 s to compute.
  auto s = Open(1000, ComputeEstimate{0.1, 0});
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->ShouldCompute(3));
  EXPECT_TRUE(s->ShouldCompute(2));
}

TEST_F(ForecastTest, NearTiesKeepTheBaseRule) {
  // 10 ms per chunk either way: neither side wins by 20% on chunk 3.
  auto s = Open(100000, ComputeEstimate{0.010, 0});
  ASSERT_NE(s, nullptr);
  EXPECT_FALSE(s->ShouldCompute(3));  // Streaming: the base rule says no.
  EXPECT_TRUE(s->ShouldCompute(2));   // 19 ms of stream against 10 ms: compute.
}

TEST_F(ForecastTest, UsesTheWorkersOwnPaceWithoutAnEstimate) {
  auto s = Open(1000, std::nullopt);  // The stream: 0.9 s left of chunk 3.
  ASSERT_NE(s, nullptr);
  EXPECT_FALSE(s->ShouldCompute(3));  // No forecast yet: the base rule.
  ASSERT_TRUE(s->ReportComputed(0).ok());
  ASSERT_TRUE(s->ReportComputed(1).ok());  // Chunk 1 took microseconds.
  EXPECT_TRUE(s->ShouldCompute(3));
}

TEST_F(ForecastTest, OffMeansTheBaseRule) {
  auto slow_compute = Open(100000, ComputeEstimate{1.0, 0}, /*use_forecast=*/false);
  ASSERT_NE(slow_compute, nullptr);
  EXPECT_TRUE(slow_compute->ShouldCompute(2));
  slow_compute.reset();
  auto fast_compute = Open(1000, ComputeEstimate{0.001, 0}, /*use_forecast=*/false);
  ASSERT_NE(fast_compute, nullptr);
  EXPECT_FALSE(fast_compute->ShouldCompute(3));
}

TEST_F(FakePrefillTest, StartReturnsTheCallsErrorBeforeAPlan) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "namespace 2a is not registered");
  });
  auto session = Start(3, nullptr);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kNotFound) << session.status();
  EXPECT_EQ(session.status().message(), "namespace 2a is not registered");
}

TEST_F(FakePrefillTest, StartRejectsAnInconsistentPlan) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    v1::PrefillServerMessage plan = PlanMessage(3);
    plan.mutable_plan()->mutable_tiers()->RemoveLast();
    stream->Write(plan);
    AwaitProgress(stream, 100);
    return grpc::Status::OK;
  });
  auto session = Start(3, nullptr);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInternal) << session.status();
  EXPECT_NE(session.status().message().find("2 tiers for cached_prefix 3"),
            absl::string_view::npos)
      << session.status();
}

// Every copy into `into` and every chunk handed over is sized by the Plan: one whose
// chunk_bytes are not the layout's would put chunk 1 where chunk 0 belongs.
TEST_F(FakePrefillTest, StartRejectsAPlanWhoseChunkBytesAreNotTheLayouts) {
  service_.set_layout_chunk_bytes(kFakeChunkBytes);
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3, kFakeChunkBytes / 2));
    AwaitProgress(stream, 100);
    return grpc::Status::OK;
  });
  auto session = Start(3, nullptr);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInternal) << session.status();
  EXPECT_NE(session.status().message().find("the layout's chunks are 1000"),
            absl::string_view::npos)
      << session.status();
}

TEST_F(FakePrefillTest, StartRejectsMoreCachedThanKeys) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(4));
    AwaitProgress(stream, 100);
    return grpc::Status::OK;
  });
  auto session = Start(3, nullptr);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInternal) << session.status();
}

TEST_F(FakePrefillTest, UnimplementedDaemon) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream*) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  });
  auto session = Start(3, nullptr);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnimplemented) << session.status();
}

TEST_F(FakePrefillTest, DestructorCancelsAnUnfinishedSession) {
  absl::Notification server_saw_end;
  std::atomic<bool> cancelled{false};
  service_.set_script([&](grpc::ServerContext* ctx, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3));
    SendRaw(stream, 2, 0, 10, false);
    AwaitProgress(stream, 100);  // Returns when the client cancels.
    cancelled = ctx->IsCancelled();
    server_saw_end.Notify();
    return grpc::Status::OK;
  });
  ChunkSink sink;
  auto session = Start(3, &sink);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(Eventually([&] { return !(*session)->ShouldCompute(2); }));
  session->reset();
  EXPECT_TRUE(server_saw_end.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // Cancelled, not half-closed: the daemon, mid-chunk, would otherwise go on sending.
  EXPECT_TRUE(cancelled.load());
  EXPECT_TRUE(sink.deliveries().empty());
}

TEST_F(FakePrefillTest, DeadlineBoundsFinish) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(3));
    AwaitProgress(stream, 100);  // Never sends Done.
    return grpc::Status::OK;
  });
  PrefillOptions options;
  options.rpc_deadline = absl::Milliseconds(300);
  auto session = PrefillSession::Start(*client_, 1, {KeyOf(0), KeyOf(1), KeyOf(2)}, options);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
}

TEST_F(FakePrefillTest, ReportComputedChecksItsArgument) {
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(2));
    v1::PrefillClientMessage m;
    std::vector<uint32_t> progress;
    while (stream->Read(&m)) progress.push_back(m.progress().computed());
    EXPECT_EQ(progress, (std::vector<uint32_t>{1, 3}));
    stream->Write(DoneMessage(2, v1::PrefillDone::CLIENT_DONE));
    return grpc::Status::OK;
  });
  auto session = Start(3, nullptr);
  ASSERT_TRUE(session.ok()) << session.status();
  PrefillSession& s = **session;
  EXPECT_EQ(s.ReportComputed(3).code(), absl::StatusCode::kInvalidArgument);  // n = 3.
  ASSERT_TRUE(s.ReportComputed(0).ok());
  EXPECT_EQ(s.ReportComputed(0).code(), absl::StatusCode::kInvalidArgument);  // Again.
  ASSERT_TRUE(s.ReportComputed(2).ok());  // Covers chunk 1 too.
  auto r = s.Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->computed_reported, 3u);
  EXPECT_EQ(s.ReportComputed(2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Finish().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(FakePrefillTest, ConcurrentReportsReachTheDaemonInIncreasingOrder) {
  constexpr uint32_t kChunks = 2000;
  std::vector<uint32_t> progress;
  service_.set_script([&](grpc::ServerContext*, PrefillStream* stream) {
    ReadOpen(stream);
    stream->Write(PlanMessage(kChunks, 1));
    v1::PrefillClientMessage m;
    while (stream->Read(&m)) progress.push_back(m.progress().computed());
    stream->Write(DoneMessage(kChunks, v1::PrefillDone::CLIENT_DONE));
    return grpc::Status::OK;
  });
  auto session = Start(kChunks, nullptr);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Reports that lose the race to a later one are refused; that is fine here.
      for (uint32_t i = t; i < kChunks; i += 4) (*session)->ReportComputed(i).IgnoreError();
    });
  }
  for (auto& t : threads) t.join();  // Thread 3 reported the last chunk, 1999.
  auto r = (*session)->Finish();  // All computed: half-closes, the fake answers Done.
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->computed_reported, kChunks);
  ASSERT_TRUE((*session)->Close().ok());
  ASSERT_FALSE(progress.empty());
  for (size_t k = 1; k < progress.size(); ++k) {
    ASSERT_LT(progress[k - 1], progress[k]) << "Progress went down at message " << k;
  }
  EXPECT_EQ(progress.back(), kChunks);
}

TEST(PrefillOptionsTest, Validate) {
  PrefillOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.compute_estimate = ComputeEstimate{-1, 0};
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o.compute_estimate = ComputeEstimate{0, std::nan("")};
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o.compute_estimate = ComputeEstimate{0.1, 0.01};
  EXPECT_TRUE(o.Validate().ok());
  o.rpc_deadline = absl::Seconds(-1);
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------------------------
// Against a real kvtierd.

constexpr uint32_t kChunkMiB = 1;
constexpr uint64_t kChunkBytes = uint64_t{kChunkMiB} << 20;

class DaemonPrefillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start(MakeTempDir("kvtierd-prefill"),
                                  {"--ram-capacity=256MiB", "--write-mode=ram-only"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    ClientOptions options;
    options.rpc_deadline = absl::Seconds(60);
    auto c = KvTierClient::Connect(daemon_->target(), options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    auto r = client_->RegisterLayout(LayoutOfMiB(kChunkMiB));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
  }

  // Keys of an n-chunk request (prefix-chained over tokens seeded by `seed`); the first
  // `cached` chunks are Put, chunk i's payload being Payload(seed, i).
  std::vector<ChunkKey> Request(uint32_t seed, uint32_t n, uint32_t cached) {
    std::vector<uint32_t> tokens(size_t{n} * 256);
    for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = seed * 1000003u + t;
    std::vector<ChunkKey> keys = ComputeChunkKeys(ns_, tokens, 256);
    std::vector<std::string> payloads;
    for (uint32_t i = 0; i < cached; ++i) payloads.push_back(Payload(seed, i));
    std::vector<ChunkToPut> puts;
    for (uint32_t i = 0; i < cached; ++i) puts.push_back({keys[i], payloads[i], 256});
    auto put = client_->Put(ns_, puts);
    EXPECT_TRUE(put.ok()) << put.status();
    return keys;
  }
  static std::string Payload(uint32_t seed, uint32_t i) {
    return PatternBytes(uint64_t{seed} << 32 | i, kChunkBytes);
  }

  // A worker: computes chunk i (sleeping compute(i)) while ShouldCompute(i) says so,
  // reporting each, then Finish, then checks the contract and the bytes.
  absl::StatusOr<PrefillResult> RunWorker(uint32_t seed, const std::vector<ChunkKey>& keys,
                                          PrefillOptions options,
                                          const std::function<absl::Duration(uint32_t)>& compute,
                                          uint32_t stop_after = UINT32_MAX) {
    ChunkSink sink;
    options.on_chunk = sink.Callback();
    auto session = PrefillSession::Start(*client_, ns_, keys, std::move(options));
    if (!session.ok()) return session.status();
    PrefillSession& s = **session;
    const uint32_t h = s.plan().cached_prefix();
    for (uint32_t i = 0; i < h && i < stop_after && s.ShouldCompute(i); ++i) {
      absl::SleepFor(compute(i));
      if (absl::Status st = s.ReportComputed(i); !st.ok()) return st;
    }
    auto r = s.Finish();
    if (!r.ok()) return r;
    ExpectExactlyOnce(*r, sink);
    for (const auto& [i, data] : sink.chunks()) {
      EXPECT_TRUE(data == Payload(seed, i)) << "streamed chunk " << i << " differs";
    }
    for (const auto& [i, tier] : sink.tiers()) EXPECT_EQ(tier, v1::TIER_RAM) << i;
    EXPECT_EQ(r->bytes_streamed, uint64_t{r->chunks_streamed} * kChunkBytes);
    return r;
  }

  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(DaemonPrefillTest, FastWorkerComputesEverything) {
  const auto keys = Request(1, 8, 8);
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{0.001, 0};
  options.max_bytes_per_second = 1 << 20;  // 1 s per chunk: never worth streaming.
  auto r = RunWorker(1, keys, options, [](uint32_t) { return absl::ZeroDuration(); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cached_prefix, 8u);
  EXPECT_EQ(r->first_streamed, 8u) << "the daemon streamed a chunk the worker had";
  EXPECT_EQ(r->reason, v1::PrefillDone::MET) << r->detail;
  EXPECT_EQ(r->computed_reported, 8u);
}

TEST_F(DaemonPrefillTest, WorkerThatNeverComputesGetsEveryChunkByteIdentical) {
  const auto keys = Request(2, 12, 12);
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{100, 0};  // Computing would take forever.
  auto r = RunWorker(2, keys, options, [](uint32_t) { return absl::ZeroDuration(); },
                     /*stop_after=*/0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 0u);
  EXPECT_EQ(r->reason, v1::PrefillDone::ALL_STREAMED) << r->detail;
  EXPECT_EQ(r->chunks_streamed, 12u);
  EXPECT_EQ(r->compute_begin, 0u);
  EXPECT_EQ(r->compute_end, 0u);
}

TEST_F(DaemonPrefillTest, WorkerThatNeverComputesWithoutEstimateStillGetsEverything) {
  // The daemon's running fit, not a client estimate: the worker never reports, so the
  // daemon must not stop on a forecast the worker does not follow.
  const auto keys = Request(3, 6, 6);
  auto r = RunWorker(3, keys, {}, [](uint32_t) { return absl::ZeroDuration(); }, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  // With no Progress, whatever the daemon left below s the worker computes after
  // Finish; the contract holds either way (checked in RunWorker).
  EXPECT_EQ(r->compute_begin, 0u);
}

TEST_F(DaemonPrefillTest, BalancedWorkerMeetsTheStreamInTheMiddle) {
  const auto keys = Request(4, 16, 16);
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{0.05, 0};
  options.max_bytes_per_second = 20 << 20;  // 50 ms per 1 MiB chunk, like compute.
  // Both sides move at a chunk per 50 ms (the worker's compute is simulated by its
  // duration), so they meet near the middle: each did at least a quarter.
  auto r = RunWorker(4, keys, options, [](uint32_t) { return absl::Milliseconds(50); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->first_streamed, 4u);
  EXPECT_LE(r->first_streamed, 12u);
}

TEST_F(DaemonPrefillTest, PartialHitStreamsOnlyTheCachedPrefix) {
  const auto keys = Request(5, 10, 6);
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{100, 0};
  ChunkSink sink;
  options.on_chunk = sink.Callback();
  auto session = PrefillSession::Start(*client_, ns_, keys, options);
  ASSERT_TRUE(session.ok()) << session.status();
  PrefillSession& s = **session;
  EXPECT_EQ(s.plan().cached_prefix(), 6u);
  ASSERT_EQ(s.plan().tiers_size(), 6);
  for (int t : s.plan().tiers()) EXPECT_EQ(t, v1::TIER_RAM);
  EXPECT_EQ(s.plan().chunk_bytes(), kChunkBytes);
  EXPECT_TRUE(s.ShouldCompute(6));
  EXPECT_TRUE(s.ShouldCompute(9));
  auto r = s.Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 0u);
  ExpectExactlyOnce(*r, sink);
  EXPECT_TRUE(s.ShouldCompute(7));
}

TEST_F(DaemonPrefillTest, NothingCached) {
  const auto keys = Request(6, 4, 0);
  auto session = PrefillSession::Start(*client_, ns_, keys, {});
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->plan().cached_prefix(), 0u);
  EXPECT_TRUE((*session)->ShouldCompute(0));
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::NOTHING_CACHED) << r->detail;
  EXPECT_EQ(r->first_streamed, 0u);
  EXPECT_TRUE(r->sources.empty());
}

TEST_F(DaemonPrefillTest, UnknownNamespaceFailsStart) {
  auto session = PrefillSession::Start(*client_, ns_ ^ 1, {KeyOf(1)}, {});
  EXPECT_EQ(session.status().code(), absl::StatusCode::kNotFound) << session.status();
}

TEST_F(DaemonPrefillTest, AbandonedSessionLeavesTheDaemonServing) {
  const auto keys = Request(7, 8, 8);
  {
    PrefillOptions options;
    options.compute_estimate = ComputeEstimate{100, 0};
    options.max_bytes_per_second = 2 << 20;
    absl::Notification first_chunk;
    options.on_chunk = [&](uint32_t, std::string, v1::Tier) {
      if (!first_chunk.HasBeenNotified()) first_chunk.Notify();
    };
    auto session = PrefillSession::Start(*client_, ns_, keys, options);
    ASSERT_TRUE(session.ok()) << session.status();
    // 1 of 8 chunks at 2 MiB/s: the rest in flight.
    ASSERT_TRUE(first_chunk.WaitForNotificationWithTimeout(absl::Seconds(60)));
  }  // Destroyed mid-stream: cancelled.
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{100, 0};
  auto r = RunWorker(7, keys, options, [](uint32_t) { return absl::ZeroDuration(); }, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_streamed, 0u);
}

TEST_F(DaemonPrefillTest, ChunkDeletedMidSessionEndsWithChunkUnavailable) {
  const auto keys = Request(8, 8, 8);
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{100, 0};
  options.max_bytes_per_second = 8 << 20;
  KvTierClient* client = client_.get();
  const uint64_t ns = ns_;
  ChunkSink sink;
  auto record = sink.Callback();
  options.on_chunk = [&](uint32_t i, std::string data, v1::Tier tier) {
    if (i == 6) {
      EXPECT_TRUE(client->Delete(ns, std::vector<ChunkKey>{keys[1]}).ok());
    }
    record(i, std::move(data), tier);
  };
  auto session = PrefillSession::Start(*client_, ns_, keys, options);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::CHUNK_UNAVAILABLE) << r->detail;
  EXPECT_EQ(r->first_streamed, 2u);
  EXPECT_EQ(r->compute_begin, 0u);
  EXPECT_EQ(r->compute_end, 2u);
  ExpectExactlyOnce(*r, sink);
  for (const auto& [i, data] : sink.chunks()) EXPECT_TRUE(data == Payload(8, i)) << i;
}

TEST_F(DaemonPrefillTest, DaemonShutdownMidSessionKeepsWhatWasStreamed) {
  const auto keys = Request(9, 8, 8);
  PrefillOptions options;
  options.compute_estimate = ComputeEstimate{100, 0};
  options.max_bytes_per_second = 4 << 20;
  const pid_t pid = daemon_->pid();
  ChunkSink sink;
  auto record = sink.Callback();
  options.on_chunk = [&](uint32_t i, std::string data, v1::Tier tier) {
    if (i == 5) kill(pid, SIGTERM);
    record(i, std::move(data), tier);
  };
  auto session = PrefillSession::Start(*client_, ns_, keys, options);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::SHUTTING_DOWN) << r->detail;
  EXPECT_GE(r->first_streamed, 4u);
  EXPECT_LE(r->first_streamed, 5u);
  ExpectExactlyOnce(*r, sink);
  for (const auto& [i, data] : sink.chunks()) EXPECT_TRUE(data == Payload(9, i)) << i;
  // kvtierd ends a Done{SHUTTING_DOWN} with UNAVAILABLE; the result stands.
  const absl::Status closed = (*session)->Close();
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  session->reset();
  client_.reset();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  daemon_.reset();
}

TEST_F(DaemonPrefillTest, ConcurrentSessionsEachGetTheirOwnChunks) {
  std::vector<std::vector<ChunkKey>> requests;
  for (uint32_t seed = 10; seed < 14; ++seed) requests.push_back(Request(seed, 8, 8));
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(requests.size());
  for (size_t k = 0; k < requests.size(); ++k) {
    threads.emplace_back([&, k] {
      PrefillOptions options;
      options.compute_estimate = ComputeEstimate{0.02, 0};
      options.max_bytes_per_second = 50 << 20;
      auto r = RunWorker(10 + k, requests[k], options,
                         [](uint32_t) { return absl::Milliseconds(20); });
      results[k] = r.status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace kvtier
