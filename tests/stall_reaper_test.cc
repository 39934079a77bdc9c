// StallReaper with a fake clock: only calls waiting on their client past `idle` are
// cancelled, each once; a call working for the daemon is never idle; unwatched calls
// are forgotten; a call holding a contended place is cancelled after `contended_idle`,
// but only while others wait for such a place.
#include "server/stall_reaper.h"

#include "scheduler/token_bucket.h"
#include "server/authenticator.h"
#include "server/lease_table.h"
#include "server/stream_limiter.h"
#include "storage/steady_now.h"

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

TEST(StallReaperTest, AContendedPlaceIsReclaimedOnlyWhileOthersWait) {
  testing::FakeClock clock;
  uint32_t in_line = 0;
  StallReaperOptions o;
  o.idle = absl::Seconds(60);
  o.contended_idle = absl::Seconds(1);
  o.waiting_for_place = [&] { return in_line; };
  o.run_thread = false;
  o.clock = clock.AsFunction();
  StallReaper reaper(o);
  int holder_cancels = 0, other_cancels = 0, busy_cancels = 0;
  const uint64_t holder = reaper.Watch([&] { ++holder_cancels; }, /*contendable=*/true);
  const uint64_t other = reaper.Watch([&] { ++other_cancels; });  // A Get, say.
  const uint64_t busy = reaper.Watch([&] { ++busy_cancels; }, /*contendable=*/true);
  reaper.SetWaitingOnClient(holder, true);
  reaper.SetWaitingOnClient(other, true);
  reaper.SetWaitingOnClient(busy, false);  // Waiting for room: the daemon's wait.
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(reaper.Sweep(), 0) << "nobody waits for the place: client_idle_timeout only";
  in_line = 1;
  EXPECT_EQ(reaper.Sweep(), 1) << "idle past contended_idle while another waits";
  EXPECT_EQ(holder_cancels, 1);
  EXPECT_EQ(other_cancels, 0) << "holds no contended place";
  EXPECT_EQ(busy_cancels, 0) << "not waiting on its client";
  // The holder's place is on its way to the line (cancelled, not yet gone): the next
  // sweep takes no second place for the same waiter.
  reaper.SetWaitingOnClient(busy, true);
  clock.Advance(absl::Seconds(2));
  EXPECT_EQ(reaper.Sweep(), 0) << "one waiter, one place on its way";
  reaper.Unwatch(holder);  // Its call ended, and its place went to the waiter...
  in_line = 1;             // ...and another Put joined the line.
  EXPECT_EQ(reaper.Sweep(), 1);
  EXPECT_EQ(busy_cancels, 1);
  EXPECT_EQ(reaper.reclaimed(), 2u);
  // Past `idle` a call is reaped as stalled, not counted as reclaimed.
  clock.Advance(absl::Seconds(60));
  EXPECT_EQ(reaper.Sweep(), 1);
  EXPECT_EQ(other_cancels, 1);
  EXPECT_EQ(reaper.reaped(), 3u);
  EXPECT_EQ(reaper.reclaimed(), 2u);
  reaper.Unwatch(other);
  reaper.Unwatch(busy);
}

TEST(StallReaperTest, ReclaimsNoMorePlacesThanWaitLongestIdleFirst) {
  testing::FakeClock clock;
  uint32_t in_line = 2;
  StallReaperOptions o;
  o.idle = absl::ZeroDuration();  // client_idle_timeout = 0: the contended bound alone.
  o.contended_idle = absl::Seconds(1);
  o.waiting_for_place = [&] { return in_line; };
  o.run_thread = false;
  o.clock = clock.AsFunction();
  StallReaper reaper(o);
  int cancels[4] = {0, 0, 0, 0};
  uint64_t h[4];
  for (int i = 0; i < 4; ++i) {
    h[i] = reaper.Watch([&cancels, i] { ++cancels[i]; }, /*contendable=*/true);
    ASSERT_NE(h[i], 0u);
  }
  // Quiet since 0s, 3s, 1s and 2s; all past contended_idle at 5s.
  reaper.SetWaitingOnClient(h[0], true);
  clock.Advance(absl::Seconds(1));
  reaper.SetWaitingOnClient(h[2], true);
  clock.Advance(absl::Seconds(1));
  reaper.SetWaitingOnClient(h[3], true);
  clock.Advance(absl::Seconds(1));
  reaper.SetWaitingOnClient(h[1], true);
  clock.Advance(absl::Seconds(2));
  EXPECT_EQ(reaper.Sweep(), 2) << "two wait: two places";
  EXPECT_EQ(cancels[0], 1) << "quiet longest";
  EXPECT_EQ(cancels[2], 1);
  EXPECT_EQ(cancels[3], 0);
  EXPECT_EQ(cancels[1], 0);
  clock.Advance(absl::Hours(1));
  EXPECT_EQ(reaper.Sweep(), 0) << "never stalled without idle; both places on their way";
  for (uint64_t handle : h) reaper.Unwatch(handle);
}

TEST(StallReaperTest, SlowFramesEverywhereRaiseTheContendedBound) {
  testing::FakeClock clock;
  uint32_t in_line = 0;
  StallReaperOptions o;
  o.idle = absl::ZeroDuration();
  o.contended_idle = absl::Milliseconds(500);
  o.waiting_for_place = [&] { return in_line; };
  o.full_frame_bytes = 4 << 20;
  o.run_thread = false;
  o.clock = clock.AsFunction();
  StallReaper reaper(o);
  EXPECT_EQ(reaper.ContendedBound(), absl::Milliseconds(500)) << "no frame seen yet";
  // A slow link: every holder's full frames take 750 ms to arrive. The bound is learned
  // from frames as they come, so it starts before anyone waits.
  int slow_cancels = 0, stalled_cancels = 0;
  const uint64_t slow = reaper.Watch([&] { ++slow_cancels; }, /*contendable=*/true);
  const uint64_t stalled = reaper.Watch([&] { ++stalled_cancels; }, /*contendable=*/true);
  auto one_frame = [&] {
    reaper.SetWaitingOnClient(slow, true);
    clock.Advance(absl::Milliseconds(750));
    const int cancelled = reaper.Sweep();
    reaper.SetWaitingOnClient(slow, false, 4 << 20);  // The frame arrived.
    return cancelled;
  };
  EXPECT_EQ(one_frame(), 0);
  EXPECT_EQ(reaper.ContendedBound(), absl::Seconds(3)) << "4 x the 750 ms of the first frame";
  in_line = 8;  // Now others wait for places.
  reaper.SetWaitingOnClient(stalled, true);  // And this holder's client goes quiet.
  for (int frame = 0; frame < 4; ++frame) {
    EXPECT_EQ(one_frame(), 0) << "frame " << frame << ": 750 ms is a frame's time here";
  }
  EXPECT_EQ(slow_cancels, 0);
  EXPECT_EQ(stalled_cancels, 0) << "quiet for exactly the bound, 3 s: not past it";
  EXPECT_EQ(reaper.ContendedBound(), absl::Seconds(3));
  clock.Advance(absl::Milliseconds(1));
  EXPECT_EQ(reaper.Sweep(), 1);
  EXPECT_EQ(stalled_cancels, 1) << "quiet for longer than 4 frames' time: stalled";
  EXPECT_EQ(slow_cancels, 0);
  // Its quiet time, once cancelled, does not feed the average: it was no frame.
  reaper.SetWaitingOnClient(stalled, false, 4 << 20);
  EXPECT_EQ(reaper.ContendedBound(), absl::Seconds(3));
  // Faster frames bring the bound back down to contended_idle, a sixteenth at a time.
  for (int frame = 0; frame < 64; ++frame) {
    reaper.SetWaitingOnClient(slow, true);
    clock.Advance(absl::Milliseconds(10));
    reaper.SetWaitingOnClient(slow, false, 4 << 20);
  }
  EXPECT_EQ(reaper.ContendedBound(), absl::Milliseconds(500));
  reaper.Unwatch(slow);
  reaper.Unwatch(stalled);
}

// Clients that hold every place cannot talk the bound up: tiny frames sent just inside
// it do not feed the average (a small frame arriving slowly is a stall, not a slow
// link), and full frames sent just inside it raise it only to kMaxBoundFactor times
// contended_idle. Past that, a holder that goes quiet loses its place to the line.
TEST(StallReaperTest, HoldersCannotRaiseTheBoundWithoutEnd) {
  testing::FakeClock clock;
  uint32_t in_line = 1;
  StallReaperOptions o;
  o.idle = absl::Seconds(60);
  o.contended_idle = absl::Milliseconds(500);
  o.waiting_for_place = [&] { return in_line; };
  o.full_frame_bytes = 4 << 20;
  o.run_thread = false;
  o.clock = clock.AsFunction();
  StallReaper reaper(o);
  int cancels = 0;
  const uint64_t holder = reaper.Watch([&] { ++cancels; }, /*contendable=*/true);
  auto frame_inside_the_bound = [&](uint64_t bytes) {
    reaper.SetWaitingOnClient(holder, true);
    clock.Advance(reaper.ContendedBound() * 9 / 10);
    EXPECT_EQ(reaper.Sweep(), 0);
    reaper.SetWaitingOnClient(holder, false, bytes);
  };
  for (int i = 0; i < 40; ++i) frame_inside_the_bound(1);
  EXPECT_EQ(reaper.ContendedBound(), absl::Milliseconds(500)) << "1-byte frames fed the average";
  for (int i = 0; i < 40; ++i) frame_inside_the_bound(1 << 20);
  EXPECT_EQ(reaper.ContendedBound(), StallReaper::kMaxBoundFactor * absl::Milliseconds(500));
  EXPECT_EQ(cancels, 0);
  reaper.SetWaitingOnClient(holder, true);
  clock.Advance(StallReaper::kMaxBoundFactor * absl::Milliseconds(500) + absl::Milliseconds(1));
  EXPECT_EQ(reaper.Sweep(), 1);
  EXPECT_EQ(cancels, 1) << "quiet past the capped bound while a Put waits, long before idle";
  reaper.Unwatch(holder);
}

TEST(StallReaperTest, AStalledHolderReapedByIdleCountsAsAPlaceOnItsWay) {
  testing::FakeClock clock;
  StallReaperOptions o;
  o.idle = absl::Seconds(10);
  o.contended_idle = absl::Seconds(1);
  uint32_t in_line = 0;
  o.waiting_for_place = [&] { return in_line; };
  o.run_thread = false;
  o.clock = clock.AsFunction();
  StallReaper reaper(o);
  int first = 0, second = 0;
  const uint64_t a = reaper.Watch([&] { ++first; }, /*contendable=*/true);
  reaper.SetWaitingOnClient(a, true);
  clock.Advance(absl::Seconds(5));
  const uint64_t b = reaper.Watch([&] { ++second; }, /*contendable=*/true);
  reaper.SetWaitingOnClient(b, true);
  clock.Advance(absl::Seconds(6));  // a: 11 s, past idle; b: 6 s, past contended_idle.
  in_line = 1;
  EXPECT_EQ(reaper.Sweep(), 1) << "a is stalled; its place serves the one waiter";
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 0);
  EXPECT_EQ(reaper.reclaimed(), 0u);
  reaper.Unwatch(a);
  reaper.Unwatch(b);
}

// The clocks that time idleness, waits and leases default to a monotonic one: on the
// wall clock, a step (NTP, a VM resumed) reaped every healthy stream at once, or held
// stalled ones, their places and their leases, for the step. Their defaults read the
// steady clock (time since boot here), decades from the wall clock's reading.
TEST(StallReaperTest, DeadlineClocksDefaultToTheMonotonicClock) {
  const auto near_steady = [](absl::Time t) {
    return absl::AbsDuration(t - SteadyNow()) < absl::Hours(1);
  };
  EXPECT_TRUE(near_steady(StallReaperOptions().clock()));
  EXPECT_TRUE(near_steady(StreamLineOptions().clock()));
  EXPECT_TRUE(near_steady(LeaseTableOptions().now()));
  EXPECT_TRUE(near_steady(AuthenticatorOptions().clock()));
  EXPECT_TRUE(near_steady(PacingClock().now()));
}

}  // namespace
}  // namespace kvtier
