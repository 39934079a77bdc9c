// EventLog: sequence numbers, namespace filter, batching, the gap a lapped or stale
// cursor finds, and wake-ups.
#include "storage/event_log.h"

#include <gtest/gtest.h>

#include <utility>

#include "absl/synchronization/mutex.h"

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

// Counts wake-ups, which run on the log's notifier thread.
class Woken {
 public:
  std::function<void()> Wake() {
    return [this] {
      absl::MutexLock lock(&mu_);
      ++n_;
    };
  }
  void WaitFor(int n) {
    std::pair<Woken*, int> arg(this, n);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::pair<Woken*, int>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return a->first->n_ >= a->second;
        },
        &arg));
  }
  int count() {
    absl::MutexLock lock(&mu_);
    return n_;
  }

 private:
  absl::Mutex mu_;
  int n_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(EventLog, WakesOnceWhenAnEventArrivesAndCanBeCancelled) {
  EventLog log(8);
  Woken woken, barrier;
  const uint64_t h = log.WakeAfter(0, woken.Wake());
  ASSERT_NE(h, 0u);
  log.Append(ChunkEventKind::kStored, Id(1), Tier::kRam);
  woken.WaitFor(1);
  log.Append(ChunkEventKind::kStored, Id(2), Tier::kRam);
  EXPECT_FALSE(log.CancelWake(h));  // Already ran.
  // Already past the cursor: nothing is kept, the caller reads again.
  EXPECT_EQ(log.WakeAfter(1, woken.Wake()), 0u);
  const uint64_t h2 = log.WakeAfter(2, woken.Wake());
  EXPECT_TRUE(log.CancelWake(h2));
  // Wake-ups run in order on one thread: once the barrier's has run, any left from the
  // appends above would have too.
  ASSERT_NE(log.WakeAfter(2, barrier.Wake()), 0u);
  log.Append(ChunkEventKind::kStored, Id(3), Tier::kRam);
  barrier.WaitFor(1);
  EXPECT_EQ(woken.count(), 1);  // Once, and the cancelled one never.
}

TEST(EventLog, CloseWakesEveryWaiterAndEndsWaiting) {
  EventLog log(8, /*instance_id=*/42);
  EXPECT_EQ(log.instance_id(), 42u);
  Woken woken;
  ASSERT_NE(log.WakeAfter(0, woken.Wake()), 0u);
  ASSERT_NE(log.WakeAfter(0, woken.Wake()), 0u);
  EXPECT_FALSE(log.Read(0, 0, 10).closed);
  log.Close();
  woken.WaitFor(2);
  EXPECT_TRUE(log.Read(0, 0, 10).closed);
  EXPECT_EQ(log.WakeAfter(0, woken.Wake()), 0u);  // Nothing to wait for.
  // Appends still work (puts draining at shutdown).
  log.Append(ChunkEventKind::kStored, Id(1), Tier::kRam);
  EXPECT_EQ(log.Read(0, 0, 10).events.size(), 1u);
}

}  // namespace
}  // namespace kvtier
