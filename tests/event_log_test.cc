// EventLog: sequence numbers, namespace filter, batching, the gap a lapped or stale
// cursor finds, and wake-ups.
#include "storage/event_log.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

ChunkId Id(uint64_t n, uint64_t ns = 1) { return ChunkId{ns, ChunkKey{n, n}}; }

TEST(EventLog, ReadsInSequenceOrderFilteredByNamespaceInBatches) {
  EventLog log(16);
  log.Append(ChunkEventKind::kStored, Id(1), Tier::kRam);
  log.Append(ChunkEventKind::kStored, Id(2, /*ns=*/2), Tier::kRam);
  log.Append(ChunkEventKind::kEvicted, Id(1), Tier::kRam);
  log.Append(ChunkEventKind::kDeleted, Id(3), Tier::kNone);
  EXPECT_EQ(log.last_sequence(), 4u);
  auto all = log.Read(0, 0, 100);
  ASSERT_EQ(all.events.size(), 4u);
  EXPECT_FALSE(all.gap);
  EXPECT_EQ(all.events[2].sequence, 3u);
  EXPECT_EQ(all.events[2].kind, ChunkEventKind::kEvicted);
  EXPECT_EQ(all.next_after, 4u);
  auto ns1 = log.Read(0, 1, 2);
  ASSERT_EQ(ns1.events.size(), 2u);
  EXPECT_EQ(ns1.events[0].sequence, 1u);
  EXPECT_EQ(ns1.events[1].sequence, 3u);
  EXPECT_EQ(ns1.next_after, 3u);  // Resume after what was looked at.
  auto rest = log.Read(ns1.next_after, 1, 2);
  ASSERT_EQ(rest.events.size(), 1u);
  EXPECT_EQ(rest.events[0].id, Id(3));
  EXPECT_TRUE(log.Read(4, 0, 10).events.empty());
}

TEST(EventLog, ALappedCursorFindsAGapAndResumesAtTheOldestKept) {
  EventLog log(4);
  for (uint64_t i = 1; i <= 10; ++i) log.Append(ChunkEventKind::kStored, Id(i), Tier::kRam);
  auto r = log.Read(2, 0, 100);
  EXPECT_TRUE(r.gap);
  EXPECT_EQ(r.first_kept, 7u);
  ASSERT_EQ(r.events.size(), 4u);
  EXPECT_EQ(r.events.front().sequence, 7u);
  EXPECT_EQ(r.events.back().id, Id(10));
  // Exactly at the edge: no gap.
  EXPECT_FALSE(log.Read(6, 0, 100).gap);
  // A cursor from another run of the daemon (beyond the last sequence) is a gap too.
  auto stale = log.Read(500, 0, 100);
  EXPECT_TRUE(stale.gap);
  EXPECT_EQ(stale.events.size(), 4u);
}

TEST(EventLog, WakesOnceWhenAnEventArrivesAndCanBeCancelled) {
  EventLog log(8);
  int woken = 0;
  const uint64_t h = log.WakeAfter(0, [&] { ++woken; });
  ASSERT_NE(h, 0u);
  EXPECT_EQ(woken, 0);
  log.Append(ChunkEventKind::kStored, Id(1), Tier::kRam);
  EXPECT_EQ(woken, 1);
  log.Append(ChunkEventKind::kStored, Id(2), Tier::kRam);
  EXPECT_EQ(woken, 1);  // Once.
  EXPECT_FALSE(log.CancelWake(h));
  // Already past the cursor: nothing is kept, the caller reads again.
  EXPECT_EQ(log.WakeAfter(1, [&] { ++woken; }), 0u);
  const uint64_t h2 = log.WakeAfter(2, [&] { ++woken; });
  EXPECT_TRUE(log.CancelWake(h2));
  log.Append(ChunkEventKind::kStored, Id(3), Tier::kRam);
  EXPECT_EQ(woken, 1);
}

TEST(EventLog, CloseWakesEveryWaiterAndEndsWaiting) {
  EventLog log(8, /*instance_id=*/42);
  EXPECT_EQ(log.instance_id(), 42u);
  int woken = 0;
  ASSERT_NE(log.WakeAfter(0, [&] { ++woken; }), 0u);
  ASSERT_NE(log.WakeAfter(0, [&] { ++woken; }), 0u);
  EXPECT_FALSE(log.Read(0, 0, 10).closed);
  log.Close();
  EXPECT_EQ(woken, 2);
  EXPECT_TRUE(log.Read(0, 0, 10).closed);
  EXPECT_EQ(log.WakeAfter(0, [&] { ++woken; }), 0u);  // Nothing to wait for.
  // Appends still work (puts draining at shutdown), and wake nobody.
  log.Append(ChunkEventKind::kStored, Id(1), Tier::kRam);
  EXPECT_EQ(log.Read(0, 0, 10).events.size(), 1u);
  EXPECT_EQ(woken, 2);
}

}  // namespace
}  // namespace kvtier
