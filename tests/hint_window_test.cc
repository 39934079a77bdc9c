// HintWindow (what schedulers said they run next: budgets, replacement, merging, expiry,
// the client bound) and HintedPolicy (eviction that spares the window, farthest first).
#include "storage/hint_window.h"

#include <gtest/gtest.h>

#include <string>

#include "storage/hinted_policy.h"
#include "storage/lru_policy.h"
#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

constexpr uint64_t kChunk = 1000;

ChunkKey K(uint64_t n) { return ChunkKey{n, n * 7}; }
ChunkId Id(uint64_t n, uint64_t ns = 1) { return ChunkId{ns, K(n)}; }
HintWindow::Request Req(std::vector<uint64_t> keys, uint64_t ns = 1) {
  HintWindow::Request r;
  r.ns = ns;
  r.chunk_bytes = kChunk;
  for (uint64_t k : keys) r.keys.push_back(K(k));
  return r;
}

HintWindowOptions Options(testing::FakeClock* clock, uint64_t chunks = 100) {
  HintWindowOptions o;
  o.max_bytes = chunks * kChunk;
  o.max_keys = 1000;
  o.max_clients = 2;
  o.ttl = absl::Seconds(60);
  o.now = clock->AsFunction();
  return o;
}

TEST(HintWindow, TakesRequestsInQueueOrderUntilTheByteBudgetAndSaysItCut) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock, /*chunks=*/3));
  auto a = w.Set("sched", {Req({1, 2}), Req({1, 3, 4}), Req({5})});
  ASSERT_TRUE(a.ok()) << a.status();
  // Request 2 repeats chunk 1 (no new bytes), adds 3, and 4 would be the fourth chunk.
  EXPECT_EQ(a->requests, 1u);
  EXPECT_EQ(a->keys, 4u);
  EXPECT_TRUE(a->truncated);
  EXPECT_EQ(a->window->by_rank, (std::vector<ChunkId>{Id(1), Id(2), Id(3)}));
  auto snap = w.snapshot();
  EXPECT_EQ(snap->by_rank, a->window->by_rank);
  EXPECT_EQ(snap->position.at(Id(3)), 2u);
  EXPECT_FALSE(snap->position.contains(Id(4)));
}

TEST(HintWindow, TheKeyBoundCutsTooAndAWholeHintIsNotTruncated) {
  testing::FakeClock clock;
  HintWindowOptions o = Options(&clock);
  o.max_keys = 3;
  HintWindow w(o);
  auto a = w.Set("sched", {Req({1, 2}), Req({3, 4})});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->keys, 3u);
  EXPECT_EQ(a->requests, 1u);
  EXPECT_TRUE(a->truncated);
  auto b = w.Set("sched", {Req({1, 2, 3})});
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->truncated);
  EXPECT_EQ(b->requests, 1u);
}

TEST(HintWindow, ANewHintReplacesTheOldAndAnEmptyOneWithdrawsIt) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock));
  ASSERT_TRUE(w.Set("sched", {Req({1, 2})}).ok());
  ASSERT_TRUE(w.Set("sched", {Req({3})}).ok());
  auto snap = w.snapshot();
  EXPECT_EQ(snap->by_rank, std::vector<ChunkId>{Id(3)});
  EXPECT_EQ(w.clients(), 1u);
  ASSERT_TRUE(w.Set("sched", {}).ok());
  EXPECT_EQ(w.clients(), 0u);
  EXPECT_TRUE(w.snapshot()->by_rank.empty());
  // The old snapshot a reader still holds is unchanged.
  EXPECT_EQ(snap->by_rank, std::vector<ChunkId>{Id(3)});
}

TEST(HintWindow, ClientsMergeByRankNearestFirst) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock));
  ASSERT_TRUE(w.Set("a", {Req({1, 2})}).ok());
  ASSERT_TRUE(w.Set("b", {Req({3, 1}, /*ns=*/1)}).ok());
  auto snap = w.snapshot();
  // Rank 0 of each client (a's first: it hinted first), then rank 1; 1 counts once, at
  // its nearest rank.
  EXPECT_EQ(snap->by_rank, (std::vector<ChunkId>{Id(1), Id(3), Id(2)}));
  EXPECT_EQ(snap->position.at(Id(1)), 0u);
  EXPECT_EQ(snap->position.at(Id(2)), 2u);
  // Namespaces keep equal keys apart.
  ASSERT_TRUE(w.Set("b", {Req({1}, /*ns=*/2)}).ok());
  EXPECT_TRUE(w.snapshot()->position.contains(Id(1, 2)));
  EXPECT_TRUE(w.snapshot()->position.contains(Id(1, 1)));
}

TEST(HintWindow, ClientsAreBoundedAndAHintNotRenewedExpires) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock));  // Two clients at most.
  ASSERT_TRUE(w.Set("a", {Req({1})}).ok());
  clock.Advance(absl::Seconds(30));
  ASSERT_TRUE(w.Set("b", {Req({2})}).ok());
  auto c = w.Set("c", {Req({3})});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("max_hint_clients"), std::string::npos);
  // A refused hint changes nothing; renewing a live one is always allowed.
  EXPECT_FALSE(w.snapshot()->position.contains(Id(3)));
  ASSERT_TRUE(w.Set("b", {Req({4})}).ok());
  clock.Advance(absl::Seconds(31));  // a is 61 s old: gone.
  ASSERT_TRUE(w.Set("c", {Req({3})}).ok());
  EXPECT_EQ(w.clients(), 2u);
  EXPECT_FALSE(w.snapshot()->position.contains(Id(1)));
  EXPECT_TRUE(w.snapshot()->position.contains(Id(4)));
  // Nobody hints again: the count of live clients (kvtier_hint_clients) drops as the
  // hints lapse, before anything drops them, and the windows lapse as eviction reads them.
  clock.Advance(absl::Seconds(61));
  EXPECT_EQ(w.clients(), 0u);
  EXPECT_TRUE(w.snapshot()->by_rank.empty());
  EXPECT_EQ(w.clients(), 0u);
}

// max_bytes bounds the merged window of all clients, not each client's: two schedulers
// each hinting the whole budget share it by rank, and the one whose hint is cut hears so
// (with the counts of what it kept); eviction spares only the kept chunks.
TEST(HintWindow, TheMergedWindowOfAllClientsIsCappedAndTheCutClientIsTold) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock, /*chunks=*/8));
  auto a = w.Set("a", {Req({1, 2, 3, 4}), Req({5, 6, 7, 8})});
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->truncated);
  auto b = w.Set("b", {Req({11, 12}), Req({13, 14}), Req({15, 16, 17, 18})});
  ASSERT_TRUE(b.ok());
  // Ranks 0-3 of each: a's first (it hinted first), then b's. b keeps two requests whole
  // and none of the third.
  auto snap = w.snapshot();
  EXPECT_EQ(snap->by_rank, (std::vector<ChunkId>{Id(1), Id(11), Id(2), Id(12), Id(3), Id(13),
                                                 Id(4), Id(14)}));
  EXPECT_TRUE(b->truncated);
  EXPECT_EQ(b->requests, 2u);
  EXPECT_EQ(b->keys, 4u);
  EXPECT_EQ(b->window->by_rank, (std::vector<ChunkId>{Id(11), Id(12), Id(13), Id(14)}));
  EXPECT_FALSE(snap->position.contains(Id(15)));
  // a's farther half is out of the window now, and a's renewal says so.
  EXPECT_FALSE(snap->position.contains(Id(5)));
  auto again = w.Set("a", {Req({1, 2, 3, 4}), Req({5, 6, 7, 8})});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->truncated);
  EXPECT_EQ(again->requests, 1u);
  EXPECT_EQ(again->keys, 4u);
  // A chunk both hint counts once; a smaller window cuts at the first chunk past it.
  auto c = w.Set("b", {Req({1, 21, 22, 23, 24, 25})});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(w.snapshot()->by_rank,
            (std::vector<ChunkId>{Id(1), Id(2), Id(21), Id(3), Id(22), Id(4), Id(23), Id(5)}));
  EXPECT_TRUE(c->truncated);
  EXPECT_EQ(c->keys, 4u);
  // When b goes, a's whole hint fits again.
  ASSERT_TRUE(w.Set("b", {}).ok());
  EXPECT_EQ(w.snapshot()->by_rank.size(), 8u);
  EXPECT_TRUE(w.snapshot()->position.contains(Id(8)));
}

TEST(HintedPolicy, EvictionSparesOnlyTheCappedMergedWindow) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock, /*chunks=*/2));
  HintedPolicy p(std::make_unique<LruPolicy>(), &w);
  for (uint64_t i = 1; i <= 5; ++i) p.OnInsert(Id(i));
  ASSERT_TRUE(w.Set("a", {Req({1, 2})}).ok());
  ASSERT_TRUE(w.Set("b", {Req({3, 4})}).ok());  // Cut to 3: 1 and 3 are the window.
  auto all = [](const ChunkId&) { return true; };
  EXPECT_EQ(p.PickVictim(all), Id(2));  // 2 was cut from a's part: plain LRU again.
  p.OnRemove(Id(2));
  EXPECT_EQ(p.PickVictim(all), Id(4));
}

// One tenant cannot keep another's schedulers out by holding every client place: a new
// client of a tenant under its equal share takes the place of the least recently
// renewed client of the tenant holding the most; at its share, it is refused.
TEST(HintWindow, AFullWindowGivesEachTenantItsShare) {
  testing::FakeClock clock;
  HintWindowOptions o = Options(&clock);
  o.max_clients = 4;
  HintWindow w(o);
  for (uint64_t i = 1; i <= 4; ++i) {
    ASSERT_TRUE(w.Set("a/" + std::to_string(i), {Req({i})}, "a").ok());
    clock.Advance(absl::Seconds(1));
  }
  ASSERT_TRUE(w.Set("a/1", {Req({1})}, "a").ok());  // Renewed: a/2 is now the oldest.
  auto more_a = w.Set("a/5", {Req({5})}, "a");
  EXPECT_EQ(more_a.status().code(), absl::StatusCode::kResourceExhausted) << more_a.status();
  // b holds none of its share (4 / 2 tenants = 2): a's least recently renewed goes.
  ASSERT_TRUE(w.Set("b/1", {Req({11})}, "b").ok());
  EXPECT_EQ(w.clients(), 4u);
  EXPECT_FALSE(w.snapshot()->position.contains(Id(2))) << "a/2, the oldest, should be gone";
  EXPECT_TRUE(w.snapshot()->position.contains(Id(1)));
  EXPECT_TRUE(w.snapshot()->position.contains(Id(11)));
  ASSERT_TRUE(w.Set("b/2", {Req({12})}, "b").ok());  // Takes a/3's place.
  EXPECT_FALSE(w.snapshot()->position.contains(Id(3)));
  // Each holds its share now: neither gets another place.
  EXPECT_EQ(w.Set("b/3", {Req({13})}, "b").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(w.Set("a/6", {Req({6})}, "a").status().code(), absl::StatusCode::kResourceExhausted);
  // A third tenant's share is 4 / 3 = 1, and a and b hold 2 each: it gets one.
  ASSERT_TRUE(w.Set("c/1", {Req({21})}, "c").ok());
  EXPECT_EQ(w.Set("c/2", {Req({22})}, "c").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(w.clients(), 4u);
}

TEST(HintWindow, OptionsAreValidated) {
  HintWindowOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.max_bytes = 0;
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o = HintWindowOptions{};
  o.ttl = absl::ZeroDuration();
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HintedPolicy, SparesHintedChunksThenEvictsTheFarthestFirst) {
  testing::FakeClock clock;
  HintWindow w(Options(&clock));
  HintedPolicy p(std::make_unique<LruPolicy>(), &w);
  for (uint64_t i = 1; i <= 4; ++i) p.OnInsert(Id(i));
  auto in = [](std::vector<uint64_t> ids) {
    return [ids](const ChunkId& id) {
      for (uint64_t n : ids) {
        if (id == Id(n)) return true;
      }
      return false;
    };
  };
  auto all = in({1, 2, 3, 4});
  EXPECT_EQ(p.PickVictim(all), Id(1));  // No hint: plain LRU.
  ASSERT_TRUE(w.Set("sched", {Req({2}), Req({1, 9})}).ok());  // 9: not in this tier.
  EXPECT_EQ(p.PickVictim(all), Id(3));  // The LRU among unhinted chunks.
  // Only hinted chunks can go: the one needed last (1 is rank 1; 9 is not held).
  EXPECT_EQ(p.PickVictim(in({1, 2})), Id(1));
  EXPECT_EQ(p.PickVictim(in({2})), Id(2));
  EXPECT_FALSE(p.PickVictim(in({})).has_value());
  EXPECT_EQ(p.size(), 4u);
  // Hinted chunks the LRU offered were passed over and touched: once the hint is gone
  // they are younger than 4, which nobody touched.
  ASSERT_TRUE(w.Set("sched", {}).ok());
  EXPECT_EQ(p.PickVictim(all), Id(3));
  p.OnRemove(Id(3));
  EXPECT_EQ(p.PickVictim(all), Id(4));
}

}  // namespace
}  // namespace kvtier
