// StallReaper with a fake clock: only calls waiting on their client past `idle` are
// cancelled, each once; a call working for the daemon is never idle; unwatched calls
// are forgotten.
#include "server/stall_reaper.h"

#include <gtest/gtest.h>

#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

TEST(StallReaperTest, CancelsOnlyCallsWaitingOnTheirClientPastIdle) {
  testing::FakeClock clock;
  StallReaperOptions o;
  o.idle = absl::Seconds(10);
  o.run_thread = false;
  o.clock = clock.AsFunction();
  StallReaper reaper(o);
  int quiet_cancels = 0, busy_cancels = 0, gone_cancels = 0;
  const uint64_t quiet = reaper.Watch([&] { ++quiet_cancels; });
  const uint64_t busy = reaper.Watch([&] { ++busy_cancels; });
  const uint64_t gone = reaper.Watch([&] { ++gone_cancels; });
  reaper.SetWaitingOnClient(quiet, true);
  reaper.SetWaitingOnClient(busy, false);  // Waiting for room, say.
  reaper.SetWaitingOnClient(gone, true);
  reaper.Unwatch(gone);
  clock.Advance(absl::Seconds(10));
  EXPECT_EQ(reaper.Sweep(), 0) << "exactly idle is not past it";
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(reaper.Sweep(), 1);
  EXPECT_EQ(quiet_cancels, 1);
  EXPECT_EQ(busy_cancels, 0);
  EXPECT_EQ(gone_cancels, 0);
  clock.Advance(absl::Seconds(30));
  EXPECT_EQ(reaper.Sweep(), 0) << "cancelled once";
  EXPECT_EQ(quiet_cancels, 1);
  // A frame arrives (no longer waiting), then the next read starts the clock again.
  reaper.SetWaitingOnClient(busy, true);
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(reaper.Sweep(), 0);
  reaper.SetWaitingOnClient(busy, false);
  reaper.SetWaitingOnClient(busy, true);
  clock.Advance(absl::Seconds(6));
  EXPECT_EQ(reaper.Sweep(), 0) << "each frame restarts the idle time";
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(reaper.Sweep(), 1);
  EXPECT_EQ(busy_cancels, 1);
  EXPECT_EQ(reaper.reaped(), 2u);
  reaper.Unwatch(quiet);
  reaper.Unwatch(busy);
}

TEST(StallReaperTest, ZeroIdleWatchesNothing) {
  StallReaperOptions o;
  o.idle = absl::ZeroDuration();
  StallReaper reaper(o);
  bool cancelled = false;
  const uint64_t h = reaper.Watch([&] { cancelled = true; });
  EXPECT_EQ(h, 0u);
  reaper.SetWaitingOnClient(h, true);
  EXPECT_EQ(reaper.Sweep(), 0);
  reaper.Unwatch(h);
  EXPECT_FALSE(cancelled);
}

}  // namespace
}  // namespace kvtier
