// Unit tests of the Cake planner's pieces: estimators, the meeting-point arithmetic,
// the token bucket and the fair gate.
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "scheduler/bandwidth_estimator.h"
#include "scheduler/cake_planner.h"
#include "scheduler/compute_model.h"
#include "scheduler/prefill_estimators.h"
#include "scheduler/token_bucket.h"
#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

TEST(BandwidthEstimatorTest, PriorThenMeasurementsWeightedByBytes) {
  BandwidthEstimator e(100.0, /*half_life_bytes=*/1000);
  EXPECT_DOUBLE_EQ(e.BytesPerSecond(), 100.0);
  e.Record(1000, 1.0);  // 1000 B/s: the first sample replaces the prior.
  EXPECT_NEAR(e.BytesPerSecond(), 1000.0, 1e-6);
  e.Record(1000, 0.5);  // 2000 B/s for one half-life: half-way in seconds per byte.
  EXPECT_NEAR(1.0 / e.BytesPerSecond(), (0.001 + 0.0005) / 2, 1e-9);
  e.Record(0, 1.0);     // Ignored.
  e.Record(10, 0.0);    // Ignored.
  EXPECT_EQ(e.samples(), 2u);
  for (int i = 0; i < 50; ++i) e.Record(1000, 0.25);
  EXPECT_NEAR(e.BytesPerSecond(), 4000.0, 1.0);  // Converges to the new rate.
}

TEST(ComputeModelTest, FitsInterceptAndSlope) {
  ComputeModel m(ComputeCost{1.0, 1.0});
  EXPECT_DOUBLE_EQ(m.Estimate().a, 1.0);  // Prior until samples arrive.
  for (uint32_t i = 0; i < 10; ++i) m.AddSample(i, 0.02 + 0.003 * i);
  const ComputeCost c = m.Estimate();
  EXPECT_NEAR(c.a, 0.02, 1e-9);
  EXPECT_NEAR(c.b, 0.003, 1e-9);
  EXPECT_NEAR(c.Range(0, 10), 10 * 0.02 + 0.003 * 45, 1e-9);
  EXPECT_NEAR(c.Range(3, 5), c.Chunk(3) + c.Chunk(4), 1e-12);
  EXPECT_EQ(c.Range(5, 5), 0);
}

TEST(ComputeModelTest, OnePositionKeepsPriorSlopeAndNoiseNeverGoesNegative) {
  ComputeModel one(ComputeCost{0.5, 0.01});
  one.AddSample(4, 0.1);
  one.AddSample(4, 0.1);
  EXPECT_NEAR(one.Estimate().b, 0.01, 1e-12);
  EXPECT_NEAR(one.Estimate().a, 0.1 - 0.04, 1e-12);
  ComputeModel falling(ComputeCost{0.5, 0.01});
  falling.AddSample(0, 0.3);
  falling.AddSample(1, 0.1);
  EXPECT_EQ(falling.Estimate().b, 0);
  EXPECT_NEAR(falling.Estimate().a, 0.2, 1e-12);
}

// The cost a Prefill session plans with. A 64-chunk request whose worker says 0.1 s a
// chunk; Progress that came in a burst (one report at the worker's pace, then three at
// once: its host thread was descheduled while the GPU ran ahead) fits to a quarter of
// that and is not believed; a fit at the worker's real pace, even if faster than its
// estimate, is.
TEST(ChooseComputeCostTest, ABurstOfProgressDoesNotMakeChunksLookFree) {
  const ComputeCost estimate{0.1, 0};
  const ComputeCost prior{0.025, 0.0027};
  ComputeModel burst(estimate);
  burst.AddSample(0, 0.1);
  for (uint32_t i = 1; i < 3; ++i) burst.AddSample(i, 0.0001);
  ChosenCost c = ChooseComputeCost(burst, &estimate, prior, 64);
  EXPECT_TRUE(c.known);
  EXPECT_FALSE(c.from_fit);  // Three samples: not yet trusted.
  EXPECT_DOUBLE_EQ(c.cost.a, 0.1);
  burst.AddSample(3, 0.0001);
  ASSERT_LT(burst.Estimate().Range(0, 64), 0.5 * estimate.Range(0, 64));
  c = ChooseComputeCost(burst, &estimate, prior, 64);
  EXPECT_FALSE(c.from_fit);  // A quarter of the worker's own estimate: a burst.
  EXPECT_DOUBLE_EQ(c.cost.a, 0.1);
  EXPECT_DOUBLE_EQ(c.cost.b, 0);

  ComputeModel faster(estimate);  // The worker is in fact 0.07 s a chunk.
  for (uint32_t i = 0; i < 4; ++i) faster.AddSample(i, 0.07);
  c = ChooseComputeCost(faster, &estimate, prior, 64);
  EXPECT_TRUE(c.from_fit);
  EXPECT_NEAR(c.cost.Range(0, 64), 64 * 0.07, 1e-9);
}

// With nothing cached (h = 0) the burst check compared two empty ranges and passed a
// burst's fit, which the session then folded into the daemon-wide prior.
TEST(ChooseComputeCostTest, ABurstIsCaughtWithNothingCachedToo) {
  const ComputeCost estimate{0.1, 0.01};
  ComputeModel burst(estimate);
  for (uint32_t i = 0; i < kTrustedFitSamples; ++i) burst.AddSample(i, 1e-6);
  EXPECT_FALSE(ChooseComputeCost(burst, &estimate, estimate, /*chunks=*/0).from_fit);
  EXPECT_FALSE(ChooseComputeCost(burst, &estimate, estimate, /*chunks=*/1).from_fit);
}

TEST(ChooseComputeCostTest, WithoutAnEstimateTheFitIsTrustedOnceItHasEnoughSamples) {
  const ComputeCost none{0, 0};
  ComputeModel m(ComputeCost{0.025, 0.0027});
  for (uint32_t i = 0; i + 1 < kTrustedFitSamples; ++i) m.AddSample(i, 0.001);
  ChosenCost c = ChooseComputeCost(m, nullptr, none, 64);
  EXPECT_FALSE(c.known);  // Nothing to plan with yet.
  EXPECT_FALSE(c.from_fit);
  EXPECT_EQ(c.cost.a, 0);
  m.AddSample(kTrustedFitSamples - 1, 0.001);
  c = ChooseComputeCost(m, nullptr, none, 64);
  EXPECT_TRUE(c.known);
  EXPECT_TRUE(c.from_fit);  // A fast worker's own pace, not another's prior.
  EXPECT_NEAR(c.cost.Chunk(10), 0.001, 1e-9);
}

TEST(CakePlannerTest, MeetsWhereBothSidesFinishTogether) {
  // 10 chunks, each 0.1 s to stream; computing chunk i takes 0.05 + 0.01 i.
  std::vector<double> stream(10, 0.1);
  const ComputeCost cost{0.05, 0.01};
  const MeetingPlan p = PlanMeeting(stream, cost);
  // Brute force over every split.
  double best = 1e9;
  uint32_t best_m = 0;
  for (uint32_t m = 0; m <= 10; ++m) {
    const double t = std::max(cost.Range(0, m), 0.1 * (10 - m));
    if (t < best) best = t, best_m = m;
  }
  EXPECT_EQ(p.meeting, best_m);
  EXPECT_NEAR(p.seconds, best, 1e-12);
  EXPECT_GT(p.meeting, 0u);
  EXPECT_LT(p.meeting, 10u);
}

TEST(CakePlannerTest, ExtremesAreComputeOnlyAndLoadOnly) {
  std::vector<double> slow(8, 10.0), fast(8, 0.001);
  const ComputeCost cost{0.1, 0.0};
  EXPECT_EQ(PlanMeeting(slow, cost).meeting, 8u);  // Streaming is hopeless: compute all.
  EXPECT_EQ(PlanMeeting(fast, cost).meeting, 0u);  // Streaming is free: stream all.
  EXPECT_EQ(PlanMeeting({}, cost).meeting, 0u);
}

TEST(CakePlannerTest, WorthStreamingComparesArrivalWithComputation) {
  const ComputeCost cost{0.1, 0.0};
  // Worker at chunk 2, just started: chunk 5 is done in 0.4 s.
  EXPECT_TRUE(WorthStreaming(5, 2, 0.0, cost, 0.3));
  EXPECT_FALSE(WorthStreaming(5, 2, 0.0, cost, 0.5));
  // 0.09 s into chunk 2, only 0.31 s remain until chunk 5 is done.
  EXPECT_FALSE(WorthStreaming(5, 2, 0.09, cost, 0.35));
  // A worker past its forecast on chunk 2 is taken to finish it now (never negative
  // time): chunk 2 itself is left to it, chunk 3 still pays if it arrives within 0.1 s.
  EXPECT_FALSE(WorthStreaming(2, 2, 5.0, cost, 0.0001));
  EXPECT_TRUE(WorthStreaming(3, 2, 5.0, cost, 0.05));
  EXPECT_FALSE(WorthStreaming(3, 2, 5.0, cost, 0.15));
}

// A pacing clock that never waits: each sleep moves a fake clock forward by what was
// asked, and the sleeps are counted.
struct FakePacing {
  testing::FakeClock clock;
  std::atomic<int> sleeps{0};
  absl::Time start = clock.Now();
  PacingClock Clock() {
    return {clock.AsFunction(), [this](absl::Duration d) {
              ++sleeps;
              clock.Advance(d);
            }};
  }
  double ElapsedMs() const { return absl::ToDoubleMilliseconds(clock.Now() - start); }
};

TEST(TokenBucketTest, CapsTheRate) {
  FakePacing pacing;
  TokenBucket bucket(10.0 * (1 << 20), absl::Milliseconds(5), pacing.Clock());  // 10 MiB/s.
  ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  EXPECT_EQ(pacing.sleeps.load(), 0);  // The first MiB goes at once, on the burst credit.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  // Four more at 0.1 s each, less the 5 ms of burst the first one started with.
  EXPECT_NEAR(pacing.ElapsedMs(), 395.0, 1e-3);
  EXPECT_GE(pacing.sleeps.load(), 395);  // In steps of at most 1 ms, to notice cancels.
  TokenBucket unlimited(0, absl::Milliseconds(5), pacing.Clock());
  const int sleeps = pacing.sleeps.load();
  EXPECT_TRUE(unlimited.Acquire(1ull << 40, [] { return false; }));
  EXPECT_EQ(pacing.sleeps.load(), sleeps);
}

TEST(TokenBucketTest, AnIdleBucketBanksNoMoreThanTheBurst) {
  FakePacing pacing;
  TokenBucket bucket(10.0 * (1 << 20), absl::Milliseconds(5), pacing.Clock());
  ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  pacing.clock.Advance(absl::Seconds(10));  // Idle: ten seconds' worth unused.
  pacing.start = pacing.clock.Now();
  ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  EXPECT_EQ(pacing.ElapsedMs(), 0.0);
  ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  EXPECT_NEAR(pacing.ElapsedMs(), 95.0, 1e-3);  // Not at once: only 5 ms were banked.
}

// A clock stepped back by an hour held every reservation back by the hour: sessions
// sharing the daemon-wide limit streamed nothing meanwhile. The reservations move back
// with the clock; and the default clock is a monotonic one.
TEST(TokenBucketTest, AClockSteppedBackDoesNotHoldReservationsBack) {
  FakePacing pacing;
  TokenBucket bucket(1 << 20, absl::Milliseconds(5), pacing.Clock());  // 1 MiB/s.
  ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  ASSERT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
  pacing.clock.Advance(-absl::Hours(1));
  pacing.start = pacing.clock.Now();
  // The next MiB waits for what was reserved before the step (under a second), not an
  // hour: cancelled (false) only if it would sleep past 5000 polls (5 s).
  EXPECT_TRUE(bucket.Acquire(1 << 10, [&] { return pacing.sleeps.load() > 5000; }));
  EXPECT_LE(pacing.ElapsedMs(), 1000.0);

  const absl::Time a = PacingClock{}.now();
  const absl::Time b = PacingClock{}.now();
  EXPECT_LE(a, b);
}

TEST(TokenBucketTest, CancelledWaitReturnsFalseAndHandsItsReservationBack) {
  FakePacing pacing;
  TokenBucket bucket(1.0, absl::Milliseconds(5), pacing.Clock());  // One byte per second.
  ASSERT_TRUE(bucket.Acquire(1, [] { return false; }));
  // 100 bytes: 100 s away. Cancelled after 30 polls.
  EXPECT_FALSE(bucket.Acquire(100, [&] { return pacing.sleeps.load() >= 30; }));
  EXPECT_NEAR(pacing.ElapsedMs(), 30.0, 1e-3);
  // The cancelled reservation was handed back: the next byte waits for the first one
  // only (1 s from the start, less the burst), not for the 100 that were never sent.
  ASSERT_TRUE(bucket.Acquire(1, [] { return false; }));
  EXPECT_NEAR(pacing.ElapsedMs(), 995.0, 1e-3);
}

// A pacing clock the test steps, for sessions on several threads: a sleep waits until
// the test moves the clock on by 1 ms, and the test moves it only once every session
// is asleep (waiting for its reservation) or finished. So which session reserves when
// is set by the fake clock, not by how the threads happen to run.
class SteppedPacing {
 public:
  PacingClock Clock() {
    return {clock_.AsFunction(), [this](absl::Duration d) {
              absl::MutexLock lock(&mu_);
              if (free_running_) {
                clock_.Advance(d);
                return;
              }
              const uint64_t step = step_;
              ++asleep_;
              const auto stepped = [this, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                return step_ != step || free_running_;
              };
              mu_.Await(absl::Condition(&stepped));
            }};
  }
  absl::Time Now() const { return clock_.Now(); }
  // Before a session's thread starts, and as its last act.
  void SessionStarts() {
    absl::MutexLock lock(&mu_);
    ++running_;
  }
  void SessionEnds() {
    absl::MutexLock lock(&mu_);
    --running_;
  }
  int running() const {
    absl::MutexLock lock(&mu_);
    return running_;
  }
  // Waits (bounded) until every running session is asleep on this step.
  bool WaitUntilAllAsleep() {
    absl::MutexLock lock(&mu_);
    const auto all = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return asleep_ == running_;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(30));
  }
  void Step() {
    absl::MutexLock lock(&mu_);
    clock_.Advance(absl::Milliseconds(1));
    ++step_;
    asleep_ = 0;
  }
  // Lets sleeps advance the clock themselves, so sessions finish whatever happened.
  void RunFree() {
    absl::MutexLock lock(&mu_);
    free_running_ = true;
  }

 private:
  testing::FakeClock clock_;
  mutable absl::Mutex mu_;
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  int asleep_ ABSL_GUARDED_BY(mu_) = 0;  // Sessions asleep since the last step.
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool free_running_ ABSL_GUARDED_BY(mu_) = false;
};

// Reservations are granted in call order, so two sessions sharing a bucket, each with
// one reservation outstanding, alternate frame by frame. Session 0 sends its first
// frame (on the burst credit) and reserves its second; only then does session 1 start
// and reserve its first, behind it. From there each reserves again when its frame's
// turn comes, behind the other's reservation: 20 ms apart at 50 MiB/s for 1 MiB.
TEST(TokenBucketTest, SessionsSharingABucketAlternate) {
  SteppedPacing pacing;
  const absl::Time t0 = pacing.Now();
  TokenBucket bucket(50.0 * (1 << 20), absl::Milliseconds(5), pacing.Clock());
  absl::Mutex mu;
  std::vector<std::pair<int, int64_t>> sent;  // (session, ms after t0), in order.
  auto session = [&](int id) {
    for (int i = 0; i < 6; ++i) {
      EXPECT_TRUE(bucket.Acquire(1 << 20, [] { return false; }));
      absl::MutexLock lock(&mu);
      sent.emplace_back(id, absl::ToInt64Milliseconds(pacing.Now() - t0));
    }
    pacing.SessionEnds();
  };
  pacing.SessionStarts();
  std::thread a(session, 0);
  EXPECT_TRUE(pacing.WaitUntilAllAsleep());  // 0 sent one frame, waits for its second.
  pacing.SessionStarts();
  std::thread b(session, 1);
  EXPECT_TRUE(pacing.WaitUntilAllAsleep());  // 1 reserved behind 0's second, waits.
  for (int step = 0; step < 1000 && pacing.running() > 0; ++step) {
    pacing.Step();
    if (!pacing.WaitUntilAllAsleep()) {
      ADD_FAILURE() << "a session neither slept nor finished after step " << step;
      break;
    }
  }
  pacing.RunFree();  // Lets the sessions end if the steps did not.
  a.join();
  b.join();
  const std::vector<std::pair<int, int64_t>> expected = {
      {0, 0},   {0, 15},  {1, 35},  {0, 55},  {1, 75},  {0, 95},
      {1, 115}, {0, 135}, {1, 155}, {0, 175}, {1, 195}, {1, 215}};
  EXPECT_EQ(sent, expected);
}

// Many callers at once: never more than `capacity` inside.
TEST(FairGateTest, BoundsHoldersUnderContention) {
  FairGate gate(2);
  std::atomic<int> inside{0}, peak{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        gate.Enter();
        const int now = ++inside;
        int p = peak.load();
        while (now > p && !peak.compare_exchange_weak(p, now)) {
        }
        --inside;
        gate.Leave();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GE(peak.load(), 1);
  EXPECT_LE(peak.load(), 2);
}

// Polls `cond` until it holds, for up to 30 s: for a state another thread reaches.
bool PollUntil(const std::function<bool()>& cond) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!cond()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// With both places held, two callers that arrive one after the other wait; a place
// freed goes to the first to arrive, and TryEnter never takes a place ahead of them.
TEST(FairGateTest, AdmitsWaitersInArrivalOrderAndTryEnterDoesNotJumpTheLine) {
  FairGate gate(2);
  EXPECT_TRUE(gate.TryEnter());  // A place free, nobody waiting: at once.
  gate.Enter();
  EXPECT_FALSE(gate.TryEnter());  // Both places held.

  absl::Mutex mu;
  std::vector<int> entered;  // Waiters, in the order they got in.
  absl::Notification go_out;
  const auto waiter = [&](int id) {
    gate.Enter();
    {
      absl::MutexLock lock(&mu);
      entered.push_back(id);
    }
    go_out.WaitForNotification();  // Holds its place until the test is done.
    gate.Leave();
  };
  const auto entered_now = [&] {
    absl::MutexLock lock(&mu);
    return entered;
  };
  std::thread first(waiter, 1);
  ASSERT_TRUE(PollUntil([&] { return gate.waiting() == 1; })) << "the first never waited";
  std::thread second(waiter, 2);
  ASSERT_TRUE(PollUntil([&] { return gate.waiting() == 2; })) << "the second never waited";
  EXPECT_TRUE(entered_now().empty()) << "entered with both places held";
  EXPECT_FALSE(gate.TryEnter());  // Full, and two waiting.

  gate.Leave();  // One place: the first to arrive's.
  // Whether or not the first has taken it yet, it is not TryEnter's.
  EXPECT_FALSE(gate.TryEnter()) << "took the place freed for the first waiter";
  EXPECT_TRUE(PollUntil([&] { return !entered_now().empty(); })) << "nobody got the place";
  EXPECT_EQ(entered_now(), std::vector<int>{1}) << "the place went to a later arrival";
  // The second still waits: both places are held again (the first's and one here).
  EXPECT_EQ(gate.waiting(), 1u);
  EXPECT_FALSE(gate.TryEnter());

  gate.Leave();  // Now the second's turn.
  EXPECT_TRUE(PollUntil([&] { return entered_now().size() == 2; })) << "the second never got in";
  EXPECT_EQ(entered_now(), (std::vector<int>{1, 2}));
  EXPECT_EQ(gate.waiting(), 0u);
  EXPECT_FALSE(gate.TryEnter());  // The two waiters hold both places.

  go_out.Notify();
  first.join();
  second.join();
  // Nobody inside, nobody waiting: TryEnter takes both places, and no third.
  EXPECT_TRUE(gate.TryEnter());
  EXPECT_TRUE(gate.TryEnter());
  EXPECT_FALSE(gate.TryEnter());
  gate.Leave();
  gate.Leave();
}

TEST(PrefillEstimatorsTest, ConnectionsAreBoundedAndPriorMoves) {
  PrefillEstimatorOptions o;
  o.max_connections = 2;
  o.compute_prior = {1.0, 1.0};
  PrefillEstimators e(o);
  auto a = e.Connection("ipv4:127.0.0.1:1");
  a->Record(1000, 1.0);
  EXPECT_EQ(e.Connection("ipv4:127.0.0.1:1"), a);  // Same connection, same estimator.
  e.Connection("ipv4:127.0.0.1:2");
  e.Connection("ipv4:127.0.0.1:3");  // Evicts :1, the least recently used.
  EXPECT_NE(e.Connection("ipv4:127.0.0.1:1"), a);
  e.RecordComputeFit({0.0, 0.0});
  // A fit of nothing moves the prior a quarter of the way to a quarter of it.
  EXPECT_NEAR(e.ComputePrior().a, 0.75 + 0.25 * 0.25, 1e-12);
}

// A connection whose estimate fell too low to stream anything records no sample again:
// once it has had none for connection_stale_after it starts from the daemon-wide one.
TEST(PrefillEstimatorsTest, AConnectionsEstimateWithNoNewSampleStartsAgain) {
  testing::FakeClock clock;
  PrefillEstimatorOptions o;
  o.now = clock.AsFunction();
  PrefillEstimators e(o);
  e.send().Record(1 << 30, 1.0);  // The daemon streams at 1 GiB/s.
  auto a = e.Connection("ipv4:127.0.0.1:1");
  a->Record(4 << 20, 1.0);  // One stalled transfer: 4 MiB/s.
  ASSERT_LT(a->BytesPerSecond(), 5e6);
  clock.Advance(absl::Minutes(4));
  EXPECT_EQ(e.Connection("ipv4:127.0.0.1:1"), a) << "a new sample 4 minutes ago";
  clock.Advance(absl::Minutes(4));
  EXPECT_EQ(e.Connection("ipv4:127.0.0.1:1"), a) << "the sample was new at the last look";
  clock.Advance(absl::Minutes(6));
  auto fresh = e.Connection("ipv4:127.0.0.1:1");
  EXPECT_NE(fresh, a);
  EXPECT_NEAR(fresh->BytesPerSecond(), e.send().BytesPerSecond(), 1.0);
  fresh->Record(1 << 20, 0.001);  // Streaming again: kept while it records.
  clock.Advance(absl::Minutes(6));
  EXPECT_EQ(e.Connection("ipv4:127.0.0.1:1"), fresh);
}

// As the runner records: every send into its connection's estimate and the daemon's.
// One stall on the only connection pulled both down; at the stale reset the
// connection started again from the daemon's figure, the same stalled one, so a daemon
// whose estimate was too low to stream anything stayed compute-only for good. It now
// starts again no lower than the prior, and streams (and measures) again.
TEST(PrefillEstimatorsTest, AStaleConnectionStartsAgainNoLowerThanThePrior) {
  testing::FakeClock clock;
  PrefillEstimatorOptions o;
  o.now = clock.AsFunction();
  PrefillEstimators e(o);
  auto a = e.Connection("unix:");
  for (int i = 0; i < 8; ++i) {
    a->Record(4 << 20, 0.004);
    e.send().Record(4 << 20, 0.004);
  }
  a->Record(4 << 20, 1.0);  // One stalled write: a GC pause.
  e.send().Record(4 << 20, 1.0);
  ASSERT_LT(e.send().BytesPerSecond(), 0.2 * o.send_prior);
  ASSERT_EQ(e.Connection("unix:"), a);  // Looked at: its samples are new.
  clock.Advance(absl::Minutes(6));
  auto fresh = e.Connection("unix:");
  ASSERT_NE(fresh, a);
  EXPECT_GE(fresh->BytesPerSecond(), o.send_prior * 0.999);
}

// One session's fit moves the daemon-wide prior (every tenant's plans) by a bounded
// step: a worker that reported 100 s a chunk once moved it to 25 s from 0.025.
// Steps compound: sessions that each push the prior as far as one may (4x their fit)
// once moved it without end, and b moved 10x in one session (it was bounded by a).
// The prior now stays within kPriorBand of the configured one, and one session moves
// each term by at most 1.75x.
TEST(PrefillEstimatorsTest, ThePriorStaysWithinABandOfTheConfiguredOne) {
  PrefillEstimatorOptions o;
  PrefillEstimators e(o);
  const ComputeCost base = o.compute_prior;
  ComputeCost before = e.ComputePrior();
  e.RecordComputeFit({1e6, 1e6});
  EXPECT_LE(e.ComputePrior().a, 1.75 * before.a * (1 + 1e-12));
  EXPECT_LE(e.ComputePrior().b, 1.75 * before.b * (1 + 1e-12));
  for (int i = 0; i < 100; ++i) {
    const ComputeCost p = e.ComputePrior();
    e.RecordComputeFit({4 * p.a, 4 * p.b});
  }
  EXPECT_LE(e.ComputePrior().a, base.a * PrefillEstimators::kPriorBand * (1 + 1e-12));
  EXPECT_LE(e.ComputePrior().b, base.b * PrefillEstimators::kPriorBand * (1 + 1e-12));
  for (int i = 0; i < 200; ++i) e.RecordComputeFit({0, 0});
  EXPECT_GE(e.ComputePrior().a, base.a / PrefillEstimators::kPriorBand * (1 - 1e-12));
  EXPECT_GE(e.ComputePrior().b, 0.0);
}

TEST(PrefillEstimatorsTest, OneSessionsFitMovesThePriorABoundedStep) {
  PrefillEstimatorOptions o;
  o.compute_prior = {0.025, 0.0};
  PrefillEstimators e(o);
  e.RecordComputeFit({1000.0, 50.0});
  EXPECT_LE(e.ComputePrior().a, 0.75 * 0.025 + 0.25 * 4 * 0.025 + 1e-12);
  EXPECT_LE(e.ComputePrior().b, 0.25 * 4 * 0.025 + 1e-12);
  e.RecordComputeFit({-5.0, -5.0});  // Nonsense below: no negative cost either.
  EXPECT_GT(e.ComputePrior().a, 0.0);
  EXPECT_GE(e.ComputePrior().b, 0.0);
}

}  // namespace
}  // namespace kvtier
