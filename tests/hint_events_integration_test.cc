// A real kvtierd: Hint prefetches SSD chunks into RAM (seen through the Events stream),
// --eviction-policy changes which chunk of a chain goes, lineage travels on PutFrame,
// and Events filters by namespace and marks a resync when a cursor was overwritten.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "client/call_cancellation.h"
#include "client/kvtier_client.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;

class HintEventsTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> args) {
    client_.reset();
    daemon_.reset();
    auto d = DaemonProcess::Start(MakeTempDir("kvtierd-hint"), std::move(args));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    auto c = KvTierClient::Connect(daemon_->target());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    auto r = client_->RegisterLayout(LayoutOfMiB(1));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
  }

  // Puts keys[first..last] as one chain in one stream (with chunk_index and prev_key
  // when `chain`).
  void Put(uint64_t first, uint64_t last, bool chain, uint64_t ns = 0) {
    std::vector<std::string> data;
    std::vector<ChunkToPut> chunks;
    for (uint64_t n = first; n <= last; ++n) data.push_back(PatternBytes(n, 1 << 20));
    for (uint64_t n = first; n <= last; ++n) {
      ChunkToPut c{KeyOf(n), data[n - first], 256};
      if (chain) {
        c.chunk_index = static_cast<uint32_t>(n - first);
        if (n > first) c.prev_key = KeyOf(n - 1);
      }
      chunks.push_back(c);
    }
    auto r = client_->Put(ns ? ns : ns_, chunks);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  v1::Tier Where(uint64_t n) {
    std::vector<ChunkKey> keys = {KeyOf(n)};
    auto l = client_->Lookup(ns_, keys);
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? l->tiers[0] : v1::TIER_UNSPECIFIED;
  }

  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(HintEventsTest, HintPromotesAnSsdChunkAndTheEventStreamSaysSo) {
  Start({"--write-mode=write-through", "--ram-capacity=4MiB", "--ram-slot-size=1MiB",
         "--hint-window-fraction=0.5"});
  Put(1, 8, /*chain=*/false);  // RAM keeps 5..8; all eight are on SSD.
  ASSERT_EQ(Where(2), v1::TIER_SSD);
  auto r = client_->Hint("scheduler-0", std::vector<HintedRequest>{{ns_, {KeyOf(2), KeyOf(7)}}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests_accepted(), 1u);
  EXPECT_EQ(r->keys_accepted(), 2u);
  EXPECT_FALSE(r->truncated());
  EXPECT_EQ(r->prefetching(), 1u);
  EXPECT_EQ(r->cached(), 1u);
  // Sequence 1 is the first put's event; reading after it replays the rest, so the
  // promotion is seen whether or not it happened before this subscription.
  std::vector<v1::ChunkEvent> seen;
  bool promoted = false;
  absl::Status s = client_->WatchEvents(ns_, 1, [&](const v1::EventBatch& batch) {
    EXPECT_FALSE(batch.resync());
    for (const v1::ChunkEvent& e : batch.events()) {
      seen.push_back(e);
      promoted |= e.kind() == v1::CHUNK_EVENT_PROMOTED && e.key() == KeyOf(2).ToByteString();
    }
    return !promoted;
  });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(promoted);
  EXPECT_EQ(Where(2), v1::TIER_RAM);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.front().sequence(), 2u);
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_GT(seen[i].sequence(), seen[i - 1].sequence());
  int stored = 0;
  for (const v1::ChunkEvent& e : seen) stored += e.kind() == v1::CHUNK_EVENT_STORED;
  EXPECT_EQ(stored, 7);  // Puts 2..8.
}

TEST_F(HintEventsTest, EvictionPolicyFlagDecidesWhichEndOfAChainGoes) {
  for (const char* policy : {"lru", "prefix-lru", "prefix-cost"}) {
    Start({"--write-mode=ram-only", "--ram-capacity=4MiB", "--ram-slot-size=1MiB",
           std::string("--eviction-policy=") + policy});
    Put(1, 4, /*chain=*/true);
    Put(10, 10, /*chain=*/false);
    const bool lru = std::string(policy) == "lru";
    EXPECT_EQ(Where(1), lru ? v1::TIER_UNSPECIFIED : v1::TIER_RAM) << policy;
    EXPECT_EQ(Where(4), lru ? v1::TIER_RAM : v1::TIER_UNSPECIFIED) << policy;
  }
  auto bad = DaemonProcess::Start(MakeTempDir("kvtierd-hint"), {"--eviction-policy=belady"});
  EXPECT_FALSE(bad.ok());
}

TEST_F(HintEventsTest, EventsFilterByNamespaceAndAnOverwrittenCursorGetsAResyncMarker) {
  Start({"--write-mode=ram-only", "--ram-capacity=64MiB", "--event-buffer=4"});
  auto other = client_->RegisterLayout(LayoutOfMiB(1, "other-model"));
  ASSERT_TRUE(other.ok());
  Put(1, 5, /*chain=*/false);                        // Sequences 1..5.
  Put(6, 6, /*chain=*/false, other->namespace_id);   // 6.
  Put(7, 7, /*chain=*/false);                        // 7.
  v1::EventBatch first;
  ASSERT_TRUE(client_->WatchEvents(0, 1, [&](const v1::EventBatch& b) {
    first = b;
    return false;
  }).ok());
  EXPECT_TRUE(first.resync());
  EXPECT_EQ(first.resync_sequence(), 4u);  // The ring keeps the last four.
  ASSERT_EQ(first.events_size(), 4);
  EXPECT_EQ(first.events(0).sequence(), 4u);
  std::vector<uint64_t> mine;
  ASSERT_TRUE(client_->WatchEvents(other->namespace_id, 3, [&](const v1::EventBatch& b) {
    for (const auto& e : b.events()) mine.push_back(e.sequence());
    return mine.empty();
  }).ok());
  EXPECT_EQ(mine, std::vector<uint64_t>{6});
}

// A subscription to a namespace nobody registered is NOT_FOUND at once: it would
// otherwise hold a subscriber's place and a stream's, silent, until the client gave up.
TEST_F(HintEventsTest, EventsForAnUnregisteredNamespaceAreNotFound) {
  Start({"--write-mode=ram-only", "--ram-capacity=64MiB"});
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  // A bound on a test that would otherwise wait forever, not a timing assertion.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::EventsRequest req;
  req.set_namespace_id(ns_ ^ 0x5a5a5a5a);
  auto reader = stub->Events(&ctx, req);
  v1::EventBatch batch;
  EXPECT_FALSE(reader->Read(&batch));
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  int batches = 0;
  // The registered one still subscribes (resuming after the first of two events).
  Put(1, 2, /*chain=*/false);
  ASSERT_TRUE(client_->WatchEvents(ns_, 1, [&](const v1::EventBatch& b) {
    batches += b.events_size();
    return false;
  }).ok());
  EXPECT_EQ(batches, 1);
}

TEST_F(HintEventsTest, ASubscriberThatStopsReadingIsLappedAndToldToResync) {
  Start({"--write-mode=ram-only", "--ram-capacity=64MiB", "--ram-slot-size=4KiB",
         "--event-buffer=64"});
  LayoutSpec tiny = LayoutOfMiB(1, "tiny-model");
  tiny.tokens_per_chunk = 1;  // 4 KiB chunks: many events cheaply.
  auto reg = client_->RegisterLayout(tiny);
  ASSERT_TRUE(reg.ok()) << reg.status();
  // A raw channel with a small, fixed receive window: a reader that stops reading
  // stops the daemon's writes after a few batches.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt("grpc.http2.lookahead_bytes", 16384);
  auto channel = grpc::CreateCustomChannel(daemon_->target(), grpc::InsecureChannelCredentials(), args);
  auto stub = v1::KvCache::NewStub(channel);
  grpc::ClientContext ctx;
  v1::EventsRequest req;
  req.set_namespace_id(reg->namespace_id);
  auto reader = stub->Events(&ctx, req);
  reader->WaitForInitialMetadata();  // The daemon has fixed the cursor: "from now on".
  const std::string payload = PatternBytes(1, 4096);
  ChunkToPut probe{KeyOf(0), payload, 1};
  ASSERT_TRUE(client_->Put(reg->namespace_id, {&probe, 1}).ok());
  v1::EventBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  ASSERT_GE(batch.events_size(), 1);
  EXPECT_FALSE(batch.resync());
  // Now it stops reading while 8000 chunks are stored: far more than the 64 events the
  // daemon keeps and the few batches the window holds.
  std::vector<ChunkToPut> chunks;
  for (uint64_t n = 1; n <= 8000; ++n) chunks.push_back({KeyOf(n), payload, 1});
  ASSERT_TRUE(client_->Put(reg->namespace_id, chunks).ok());
  // Reading again: what was in flight, then a resync marker, then the newest events.
  bool resync = false;
  uint64_t last = batch.events(batch.events_size() - 1).sequence();
  uint64_t before_gap = 0;
  while (!resync && reader->Read(&batch)) {
    resync = batch.resync();
    if (resync) before_gap = last;
    for (const auto& e : batch.events()) {
      EXPECT_GT(e.sequence(), last);
      last = e.sequence();
    }
  }
  ASSERT_TRUE(resync);
  // Events were lost between what it had and the marker, and it was told where to go on.
  EXPECT_GT(batch.resync_sequence(), before_gap + 1);
  ASSERT_GT(batch.events_size(), 0);
  EXPECT_EQ(batch.events(0).sequence(), batch.resync_sequence());
  ctx.TryCancel();
  reader->Finish().IgnoreError();
  // The daemon serves on, and stored every chunk.
  std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(8000)};
  auto l = client_->Lookup(reg->namespace_id, keys);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->prefix_hits, 2u);
}

TEST_F(HintEventsTest, ACursorFromAnotherRunResyncsAndShutdownEndsSubscriptions) {
  Start({"--write-mode=ram-only", "--ram-capacity=64MiB"});
  Put(1, 2, /*chain=*/false);
  uint64_t instance = 0;
  ASSERT_TRUE(client_->WatchEvents(0, 1, [&](const v1::EventBatch& b) {
    instance = b.instance_id();
    return false;
  }).ok());
  ASSERT_NE(instance, 0u);
  // Same sequence, another instance: the daemon restarted since; start over.
  grpc::ClientContext ctx;
  v1::EventsRequest req;
  req.set_after_sequence(1);
  req.set_instance_id(instance ^ 1);
  auto reader = client_->stub()->Events(&ctx, req);
  v1::EventBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  EXPECT_TRUE(batch.resync());
  ASSERT_EQ(batch.events_size(), 2);
  EXPECT_EQ(batch.events(0).sequence(), 1u);
  // Parked waiting for events, the subscription does not hold up a SIGTERM (the
  // default shutdown_grace is 30 s): it ends UNAVAILABLE at once.
  auto code = daemon_->Terminate(10);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_FALSE(reader->Read(&batch));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  daemon_.reset();
}

// A router resuming with the client's WatchEvents after a daemon restart passes the
// instance its cursor came from and gets the new run's events from the oldest kept,
// marked resync. The client could not say it, and skipped the new run's first events.
TEST_F(HintEventsTest, TheClientResumesACursorFromAnEarlierRunWithAResync) {
  Start({"--write-mode=ram-only", "--ram-capacity=64MiB"});
  Put(1, 3, /*chain=*/false);
  uint64_t instance = 0, last = 0;
  ASSERT_TRUE(client_->WatchEvents(0, 1, [&](const v1::EventBatch& b) {
    instance = b.instance_id();
    if (b.events_size() > 0) last = b.events(b.events_size() - 1).sequence();
    return last < 3;
  }).ok());
  ASSERT_EQ(last, 3u);
  Start({"--write-mode=ram-only", "--ram-capacity=64MiB"});
  Put(11, 15, /*chain=*/false);
  v1::EventBatch first;
  ASSERT_TRUE(client_->WatchEvents(0, last, [&](const v1::EventBatch& b) {
    first = b;
    return false;
  }, instance).ok());
  EXPECT_NE(first.instance_id(), instance);
  EXPECT_TRUE(first.resync()) << "a cursor from the earlier run was taken for this one's";
  ASSERT_GT(first.events_size(), 0);
  EXPECT_EQ(first.events(0).sequence(), 1u);
}

// A subscription to a quiet namespace waits on its stream with no deadline: a
// CallCancellation is the way out. It once was not watched, and the thread stayed in
// WatchEvents for ever.
TEST_F(HintEventsTest, CancellationEndsAQuietSubscription) {
  Start({"--write-mode=ram-only"});
  CallCancellation cancel;
  absl::Status s;
  std::thread watcher([&] {
    CallCancellation::Scope scope(&cancel);
    // Takes every batch (the layout's registration may be one): only the cancel ends it.
    s = client_->WatchEvents(ns_, 1, [](const v1::EventBatch&) { return true; });
  });
  const bool subscribed = testing::Eventually([&] { return cancel.watching(); });
  cancel.Cancel();
  watcher.join();
  ASSERT_TRUE(subscribed);
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
}

}  // namespace
}  // namespace kvtier
