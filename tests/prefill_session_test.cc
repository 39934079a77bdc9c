// The Prefill (Cake) session against a real kvtierd, driven through the raw stream so
// each race can be forced: the worker faster than the stream, the stream faster than
// the worker, both on the same chunk; and the faults: Progress out of range, a bad
// Open, a client that disconnects mid-chunk, a chunk evicted mid-session, the daemon
// shutting down mid-session. Every ending checks the contract: streamed chunks are
// exactly [first_streamed, h), each whole and byte-identical.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "client/kvtier_client.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::PatternBytes;
using Stream = grpc::ClientReaderWriter<v1::PrefillClientMessage, v1::PrefillServerMessage>;

constexpr uint32_t kCached = 6;     // Chunks put before each session.
constexpr uint32_t kKeys = 8;       // Keys in each Open: 6 cached + 2 not.
constexpr uint64_t kChunk = 1 << 20;
constexpr uint32_t kFrame = 256 << 10;  // 4 frames per chunk.

// What a worker saw of one session.
struct Seen {
  v1::PrefillPlan plan;
  std::map<uint32_t, std::string> whole;    // Complete chunks.
  std::map<uint32_t, uint64_t> partial;     // Chunks cut off, bytes received.
  std::vector<uint32_t> order;              // Indices in arrival order (first frames).
  std::optional<v1::PrefillDone> done;
  grpc::Status status;
};

class PrefillTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> args = {}) {
    if (dir_.empty()) dir_ = testing::MakeTempDir("kvtier-prefill");
    args.push_back("--ram-capacity=64MiB");
    auto d = testing::DaemonProcess::Start(dir_, args);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    auto c = KvTierClient::Connect(daemon_->target());
    ASSERT_TRUE(c.ok());
    client_ = *std::move(c);
    auto reg = client_->RegisterLayout(testing::LayoutOfMiB(1));
    ASSERT_TRUE(reg.ok()) << reg.status();
    ns_ = reg->namespace_id;
    for (uint32_t i = 0; i < kCached; ++i) {
      const std::string data = PatternBytes(i, kChunk);
      ChunkToPut c{KeyOf(i), data, 256};
      ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
    }
  }

  std::unique_ptr<Stream> Open(grpc::ClientContext* ctx, uint64_t bytes_per_second,
                               std::optional<std::pair<double, double>> estimate = std::nullopt,
                               uint64_t ns = 0) {
    auto stream = client_->stub()->Prefill(ctx);
    v1::PrefillClientMessage m;
    auto* open = m.mutable_open();
    open->set_namespace_id(ns ? ns : ns_);
    for (uint32_t i = 0; i < kKeys; ++i) open->add_keys(KeyOf(i).ToByteString());
    open->set_max_bytes_per_second(bytes_per_second);
    open->set_max_frame_bytes(kFrame);
    if (estimate) {
      open->mutable_compute_estimate()->set_a_seconds(estimate->first);
      open->mutable_compute_estimate()->set_b_seconds(estimate->second);
    }
    EXPECT_TRUE(stream->Write(m));
    return stream;
  }

  double SessionsOpen() {
    auto m = testing::HttpGet(daemon_->metrics_port(), "/metrics");
    return m.ok() ? testing::SeriesValue(m->body, "kvtier_prefill_sessions_open") : -1;
  }

  static bool Progress(Stream* s, uint32_t computed) {
    v1::PrefillClientMessage m;
    m.mutable_progress()->set_computed(computed);
    return s->Write(m);
  }

  // Reads to the end; `on_frame` may act (send Progress) after each chunk frame.
  static Seen Drain(Stream* s, std::function<void(const v1::PrefillChunkFrame&)> on_frame = {}) {
    Seen seen;
    v1::PrefillServerMessage m;
    std::map<uint32_t, std::string> building;
    while (s->Read(&m)) {
      if (m.has_plan()) seen.plan = m.plan();
      if (m.has_chunk()) {
        const auto& f = m.chunk();
        if (f.offset() == 0) seen.order.push_back(f.index());
        building[f.index()] += f.data();
        if (f.last()) {
          seen.whole[f.index()] = std::move(building[f.index()]);
          building.erase(f.index());
        }
        if (on_frame) on_frame(f);
      }
      if (m.has_done()) {
        seen.done = m.done();
        s->WritesDone();
      }
    }
    for (auto& [i, bytes] : building) seen.partial[i] = bytes.size();
    seen.status = s->Finish();
    return seen;
  }

  // The contract: whole chunks are exactly [s, h), in descending order, intact.
  static void ExpectContract(const Seen& seen) {
    ASSERT_TRUE(seen.done.has_value()) << seen.status.error_message();
    const uint32_t s = seen.done->first_streamed();
    const uint32_t h = seen.plan.cached_prefix();
    ASSERT_LE(s, h);
    EXPECT_EQ(seen.whole.size(), h - s);
    for (uint32_t i = s; i < h; ++i) {
      auto it = seen.whole.find(i);
      ASSERT_NE(it, seen.whole.end()) << "chunk " << i << " in [s,h) missing";
      EXPECT_TRUE(it->second == PatternBytes(i, kChunk)) << "chunk " << i << " corrupt";
    }
    for (const auto& [i, _] : seen.partial) EXPECT_LT(i, s) << "cut-off chunk above s";
    for (size_t k = 1; k < seen.order.size(); ++k) EXPECT_LT(seen.order[k], seen.order[k - 1]);
  }

  std::string dir_;
  std::optional<testing::DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(PrefillTest, WorkerThatNeverComputesGetsEverythingStreamed) {
  Start();
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 0);
  Seen seen = Drain(s.get());
  ExpectContract(seen);
  EXPECT_TRUE(seen.status.ok()) << seen.status.error_message();
  EXPECT_EQ(seen.plan.cached_prefix(), kCached);
  ASSERT_EQ(seen.plan.tiers_size(), static_cast<int>(kCached));
  EXPECT_EQ(seen.plan.chunk_bytes(), kChunk);
  EXPECT_EQ(seen.done->first_streamed(), 0u);
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::ALL_STREAMED);
  EXPECT_EQ(seen.order.front(), kCached - 1);
}

TEST_F(PrefillTest, WorkerFasterThanStreamStopsItEarly) {
  Start();
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 2 << 20);  // 0.5 s per chunk.
  ASSERT_TRUE(Progress(s.get(), kKeys));  // The worker computed everything at once.
  Seen seen = Drain(s.get());
  ExpectContract(seen);
  EXPECT_TRUE(seen.status.ok());
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::MET);
  EXPECT_GE(seen.done->first_streamed(), kCached - 1);  // At most the first chunk went out.
  EXPECT_LT(seen.done->elapsed_seconds(), 2.0);
}

TEST_F(PrefillTest, StreamFasterThanWorkerDeliversAllCachedChunks) {
  Start();
  grpc::ClientContext ctx;
  // The worker says each chunk costs a second: streaming all six is far quicker.
  auto s = Open(&ctx, 0, std::make_pair(1.0, 0.0));
  Seen seen = Drain(s.get());
  ExpectContract(seen);
  EXPECT_EQ(seen.done->first_streamed(), 0u);
  EXPECT_EQ(seen.plan.predicted_meeting(), 0u);
}

TEST_F(PrefillTest, ForecastOfAFastWorkerEndsTheStreamBeforeItStarts) {
  Start();
  grpc::ClientContext ctx;
  // 1 ms per chunk against 1 s per streamed chunk: streaming anything is a loss.
  auto s = Open(&ctx, 1 << 20, std::make_pair(0.001, 0.0));
  Seen seen = Drain(s.get());
  ExpectContract(seen);
  EXPECT_EQ(seen.plan.predicted_meeting(), kCached);
  EXPECT_EQ(seen.done->first_streamed(), kCached);
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::MET);
  EXPECT_TRUE(seen.whole.empty());
}

TEST_F(PrefillTest, BothSidesOnTheSameChunkTheStreamYields) {
  Start();
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 4 << 20);  // 64 ms per frame.
  // As the first frame of chunk 3 arrives, the worker reports [0, 4) computed: chunk 3
  // is being streamed and was computed. The stream must give it up, whole or not.
  Stream* raw = s.get();
  Seen seen = Drain(raw, [raw](const v1::PrefillChunkFrame& f) {
    if (f.index() == 3 && f.offset() == 0) Progress(raw, 4);
  });
  ExpectContract(seen);
  EXPECT_EQ(seen.done->first_streamed(), 4u);
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::MET);
  EXPECT_EQ(seen.partial.count(3), 1u) << "chunk 3 should have been cut off mid-way";
}

TEST_F(PrefillTest, WorkerOvershootsAStreamedChunkUsedOnce) {
  Start();
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 8 << 20);
  // When chunk 4 is complete the worker says it computed [0, 5): chunk 4 exists twice.
  // Done must put the split at 4, so chunk 4 is taken from the stream, once.
  Stream* raw = s.get();
  Seen seen = Drain(raw, [raw](const v1::PrefillChunkFrame& f) {
    if (f.index() == 4 && f.last()) Progress(raw, 5);
  });
  ExpectContract(seen);
  EXPECT_EQ(seen.done->first_streamed(), 4u);
}

TEST_F(PrefillTest, ProgressOutOfRangeEndsWithInvalidArgument) {
  Start();
  {
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 1 << 20);
    Progress(s.get(), kKeys + 5);
    Seen seen = Drain(s.get());
    EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(seen.status.error_message().find("progress.computed"), std::string::npos);
    EXPECT_FALSE(seen.done.has_value());
  }
  {
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 1 << 20);
    Progress(s.get(), 3);
    Progress(s.get(), 2);  // Going backwards.
    Seen seen = Drain(s.get());
    EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto stats = client_->Stats();  // Still serving.
  EXPECT_TRUE(stats.ok());
}

TEST_F(PrefillTest, BadOpens) {
  Start();
  {
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 0, std::nullopt, /*ns=*/0x1234);
    Seen seen = Drain(s.get());
    EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    auto s = client_->stub()->Prefill(&ctx);
    Progress(s.get(), 1);  // Progress before Open.
    Seen seen = Drain(s.get());
    EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(seen.status.error_message().find("open"), std::string::npos);
  }
  {
    // Keys of another namespace: nothing is cached under this one; compute everything.
    auto other = client_->RegisterLayout(testing::LayoutOfMiB(1, "other-model"));
    ASSERT_TRUE(other.ok());
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 0, std::nullopt, other->namespace_id);
    Seen seen = Drain(s.get());
    ExpectContract(seen);
    EXPECT_EQ(seen.plan.cached_prefix(), 0u);
    EXPECT_EQ(seen.done->reason(), v1::PrefillDone::NOTHING_CACHED);
  }
  // Compute estimates that are no estimate: negative, NaN, infinite.
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const auto& [a, b] : std::vector<std::pair<double, double>>{
           {-1, 0}, {0, -1}, {nan, 0}, {0, nan}, {inf, 0}, {0, inf}, {inf, inf}}) {
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 0, std::make_pair(a, b));
    Seen seen = Drain(s.get());
    EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << a << ", " << b;
    EXPECT_NE(seen.status.error_message().find("compute_estimate"), std::string::npos);
  }
}

TEST_F(PrefillTest, ClientDisconnectMidChunkLeaksNothing) {
  Start();
  auto used = [&] { return client_->Stats()->tiers(0).used_bytes(); };
  const uint64_t before = used();
  {
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 4 << 20);
    v1::PrefillServerMessage m;
    while (s->Read(&m) && !m.has_chunk()) {
    }
    ctx.TryCancel();
    s->Finish().IgnoreError();
  }
  // The session notices, stops its threads and drops its chunk views: once it is gone,
  // deleting the chunks frees all their slots (a view it still held would keep its
  // chunk's; the chunks stay in RAM either way, so comparing before and after the
  // session alone could not tell).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (SessionsOpen() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(SessionsOpen(), 0);
  std::vector<ChunkKey> keys;
  for (uint32_t i = 0; i < kCached; ++i) keys.push_back(KeyOf(i));
  ASSERT_TRUE(client_->Delete(ns_, keys).ok());
  EXPECT_EQ(used(), before - kCached * kChunk);
  for (uint32_t i = 0; i < kCached; ++i) {  // The chunks again, for the contract check.
    const std::string data = PatternBytes(i, kChunk);
    ChunkToPut c{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  }
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 0);
  ExpectContract(Drain(s.get()));
}

// A session paced by its own max_bytes_per_second waits on its client's choice: past
// client_idle_timeout on one frame it is reaped like a client that stopped reading. At
// 1 byte/s it once ran for weeks, holding its place, threads and prefetched chunks.
TEST_F(PrefillTest, ASessionPacedSlowerThanTheIdleTimeoutIsReaped) {
  Start({"--client-idle-timeout=1s"});
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  // Compute costs far more than streaming even at 1 byte/s: the plan streams.
  auto s = Open(&ctx, /*bytes_per_second=*/1, std::make_pair(1e8, 0.0));
  const Seen seen = Drain(s.get());
  EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::CANCELLED)
      << seen.status.error_message() << " done: " << (seen.done ? seen.done->DebugString() : "-")
      << " plan: " << seen.plan.DebugString() << " whole: " << seen.whole.size();
  EXPECT_TRUE(seen.whole.empty());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (SessionsOpen() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(SessionsOpen(), 0);
}

// Each session holds one of gRPC's handler threads (max_rpc_threads) while it runs.
// Sessions past max_prefill_sessions (half of those threads) are refused with a retry
// hint, so unary calls keep the other half: with every thread held by sessions, gRPC
// itself refused every Lookup and Stats ("Server Threadpool Exhausted").
TEST_F(PrefillTest, SessionsPastTheirBoundAreRefusedAndUnaryCallsKeepAnswering) {
  Start({"--max-rpc-threads=8"});  // 4 sessions at most.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> open;
  for (int i = 0; i < 4; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    open.push_back(Open(contexts.back().get(), /*bytes_per_second=*/1));  // Never ends.
    v1::PrefillServerMessage m;
    ASSERT_TRUE(open.back()->Read(&m)) << i;
    ASSERT_TRUE(m.has_plan()) << i;  // Running: its thread is taken.
  }
  {
    grpc::ClientContext ctx;
    auto s = Open(&ctx, 0);
    const Seen refused = Drain(s.get());
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(refused.status.error_message().find("max_prefill_sessions"), std::string::npos)
        << refused.status.error_message();
    EXPECT_EQ(ctx.GetServerTrailingMetadata().count("kvtier-retry-after-ms"), 1u);
  }
  for (int i = 0; i < 3; ++i) {
    auto lookup = client_->Lookup(ns_, {KeyOf(0), KeyOf(1)});
    ASSERT_TRUE(lookup.ok()) << lookup.status();
    EXPECT_EQ(lookup->tiers[0], v1::TIER_RAM);
    ASSERT_TRUE(client_->Stats().ok());
  }
  // A session that ends gives its place back (once its handler has noticed).
  contexts[0]->TryCancel();
  open[0]->Finish().IgnoreError();
  auto sessions_open = [&] {
    auto m = testing::HttpGet(daemon_->metrics_port(), "/metrics");
    return m.ok() ? testing::SeriesValue(m->body, "kvtier_prefill_sessions_open") : -1;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (sessions_open() != 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(sessions_open(), 3);
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 0);
  ExpectContract(Drain(s.get()));
  for (size_t i = 1; i < open.size(); ++i) {
    contexts[i]->TryCancel();
    open[i]->Finish().IgnoreError();
  }
}

// With RAM full of pinned chunks, sessions stream SSD chunks a frame at a time, holding
// no whole-chunk buffer while their worker reads slowly. Two sessions paced at 1 byte a
// second once held every one of the store's four SSD read buffers (the prefetch window
// of each), and a third session never got a frame; cancelled, they could not stop, their
// prefetchers waiting for a buffer.
TEST_F(PrefillTest, SlowSessionsOverSsdChunksDoNotStallOthers) {
  Start({"--write-mode=write-through", "--max-pinned-fraction=1"});
  std::vector<ChunkKey> pin;
  for (uint32_t i = 100; i < 164; ++i) {  // 64 MiB: the whole pool, pinned.
    const std::string data = PatternBytes(i, kChunk);
    ChunkToPut c{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok()) << i;
    pin.push_back(KeyOf(i));
  }
  auto pinned = client_->Pin(ns_, pin, 0);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_EQ(pinned->pinned, 64u);
  auto where = client_->Lookup(ns_, {KeyOf(0), KeyOf(5)});
  ASSERT_TRUE(where.ok());
  ASSERT_EQ(where->tiers[0], v1::TIER_SSD);
  ASSERT_EQ(where->tiers[1], v1::TIER_SSD);
  auto streams_open = [&] {
    auto m = testing::HttpGet(daemon_->metrics_port(), "/metrics");
    return m.ok() ? testing::SeriesValue(m->body, "kvtier_prefill_sessions_open") : -1;
  };
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> slow;
  for (int i = 0; i < 2; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    slow.push_back(Open(contexts.back().get(), /*bytes_per_second=*/1));
    v1::PrefillServerMessage m;
    ASSERT_TRUE(slow.back()->Read(&m));
    ASSERT_TRUE(m.has_plan());
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto s = Open(&ctx, 0);
    const Seen seen = Drain(s.get());
    ExpectContract(seen);
    ASSERT_TRUE(seen.done.has_value());
    EXPECT_EQ(seen.done->first_streamed(), 0u) << "every cached chunk, from SSD";
    EXPECT_EQ(seen.done->reason(), v1::PrefillDone::ALL_STREAMED);
  }
  // Cancelled, the slow sessions end and give their places back.
  for (size_t i = 0; i < slow.size(); ++i) {
    contexts[i]->TryCancel();
    slow[i]->Finish().IgnoreError();
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (streams_open() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(streams_open(), 0);
}

// A chunk streamed from SSD a frame at a time that fails its checksum mid-chunk ends the
// session CHUNK_UNAVAILABLE at that chunk: the worker keeps what arrived whole (nothing,
// here) and computes the rest. No frame of bad bytes is sent.
TEST_F(PrefillTest, ACorruptSsdChunkStreamedAFrameAtATimeEndsChunkUnavailable) {
  const std::vector<std::string> args = {"--write-mode=write-through", "--max-pinned-fraction=1"};
  Start(args);
  client_.reset();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  daemon_.reset();
  const int corrupted = testing::CorruptPayloadFiles(dir_ + "/ssd", [](uint64_t size) {
    std::vector<uint64_t> at;  // The second half of every MiB: each chunk's later frames.
    for (uint64_t off = 640 << 10; off + 64 < size; off += 1 << 20) at.push_back(off);
    return at;
  });
  ASSERT_GT(corrupted, 0);
  Start(args);  // The cached chunks are on SSD only now; fill RAM with pinned ones.
  std::vector<ChunkKey> pin;
  for (uint32_t i = 100; i < 164; ++i) {
    const std::string data = PatternBytes(i, kChunk);
    ChunkToPut c{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok()) << i;
    pin.push_back(KeyOf(i));
  }
  ASSERT_TRUE(client_->Pin(ns_, pin, 0).ok());
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 0);
  std::vector<uint64_t> offsets;  // Of chunk 5's frames, as they came.
  const Seen seen = Drain(s.get(), [&](const v1::PrefillChunkFrame& f) {
    if (f.index() == kCached - 1) offsets.push_back(f.offset());
  });
  ExpectContract(seen);
  ASSERT_TRUE(seen.done.has_value()) << seen.status.error_message();
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::CHUNK_UNAVAILABLE) << seen.done->detail();
  EXPECT_EQ(seen.done->first_streamed(), kCached);
  EXPECT_TRUE(seen.whole.empty());
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 256 << 10})) << "frames before the bad one";
}

TEST_F(PrefillTest, ChunkEvictedMidSessionEndsWithWhatWasStreamed) {
  Start();
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 4 << 20);
  // Once chunk 5 starts, delete chunk 1 (far below the prefetch window of 2).
  KvTierClient* c = client_.get();
  const uint64_t ns = ns_;
  Seen seen = Drain(s.get(), [c, ns](const v1::PrefillChunkFrame& f) {
    if (f.index() == 5 && f.offset() == 0) {
      ASSERT_TRUE(c->Delete(ns, std::vector<ChunkKey>{KeyOf(1)}).ok());
    }
  });
  ExpectContract(seen);
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::CHUNK_UNAVAILABLE);
  EXPECT_EQ(seen.done->first_streamed(), 2u);
  EXPECT_NE(seen.done->detail().find("chunk 1"), std::string::npos) << seen.done->detail();
}

TEST_F(PrefillTest, DaemonShutdownMidSessionSendsDone) {
  Start();
  grpc::ClientContext ctx;
  auto s = Open(&ctx, 2 << 20);
  const pid_t pid = daemon_->pid();
  Seen seen = Drain(s.get(), [pid](const v1::PrefillChunkFrame& f) {
    if (f.index() == 4 && f.offset() == 0) kill(pid, SIGTERM);
  });
  ExpectContract(seen);
  EXPECT_EQ(seen.done->reason(), v1::PrefillDone::SHUTTING_DOWN);
  EXPECT_EQ(seen.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_GE(seen.done->first_streamed(), 4u);
  client_.reset();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  daemon_.reset();
}

// Two sessions share a daemon-wide limit: the short one, started while the long one
// streams, is served alongside it instead of waiting behind it. Checked by order, not by
// time: the short one ends while the long one has had a fraction of its chunks.
TEST_F(PrefillTest, ShortSessionIsNotStarvedByALongOne) {
  Start({"--prefill-bandwidth-limit=8MiB"});
  for (uint32_t i = kCached; i < 40; ++i) {  // A 40-chunk prefix for the long session.
    const std::string data = PatternBytes(i, kChunk);
    ChunkToPut c{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  }
  auto run = [&](uint32_t keys, std::function<void(const v1::PrefillChunkFrame&)> on_frame) {
    grpc::ClientContext ctx;
    auto s = client_->stub()->Prefill(&ctx);
    v1::PrefillClientMessage m;
    m.mutable_open()->set_namespace_id(ns_);
    for (uint32_t i = 0; i < keys; ++i) m.mutable_open()->add_keys(KeyOf(i).ToByteString());
    s->Write(m);
    return Drain(s.get(), std::move(on_frame));
  };
  absl::Notification long_streaming;
  std::atomic<uint32_t> long_chunks{0};  // Chunks the long session has begun receiving.
  std::atomic<bool> long_done{false};
  Seen long_seen;
  std::thread long_session([&] {
    long_seen = run(40, [&](const v1::PrefillChunkFrame& f) {
      if (f.offset() != 0) return;
      ++long_chunks;
      if (!long_streaming.HasBeenNotified()) long_streaming.Notify();
    });
    long_done = true;
  });
  if (!long_streaming.WaitForNotificationWithTimeout(absl::Seconds(60))) {
    ADD_FAILURE() << "the long session never streamed";
  }
  const uint32_t long_before = long_chunks.load();
  Seen short_seen = run(4, {});
  const bool long_done_first = long_done.load();
  const uint32_t long_meanwhile = long_chunks.load() - long_before;
  long_session.join();
  ExpectContract(short_seen);
  ExpectContract(long_seen);
  // Queued behind the long session, the short one would end after it. Sharing the
  // limit frame by frame, the long one gets about as many bytes as the short one's 4
  // chunks while the short one runs.
  EXPECT_FALSE(long_done_first);
  EXPECT_LE(long_meanwhile, 12u) << "the long session got " << long_meanwhile
                                 << " chunks while the short one got 4";
}

}  // namespace
}  // namespace kvtier
