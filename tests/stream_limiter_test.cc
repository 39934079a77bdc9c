// StreamLimiter: the daemon-wide bound on open streaming calls, a tenant's own bound
// within it, and the line callers may wait in for a place.
#include "server/stream_limiter.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(StreamLimiterTest, BoundsOpenStreamsAndGivesPlacesBack) {
  StreamLimiter limiter(2, nullptr);
  auto a = limiter.TryAcquire();
  auto b = limiter.TryAcquire();
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  auto c = limiter.TryAcquire();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("max_streams (2)"), absl::string_view::npos);
  EXPECT_EQ(limiter.open(), 2u);
  { StreamLimiter::Ticket gone = *std::move(a); }
  EXPECT_EQ(limiter.open(), 1u);
  EXPECT_TRUE(limiter.TryAcquire().ok());
}

TEST(StreamLimiterTest, ATenantsOwnBoundRefusesOnlyThatTenant) {
  StreamLimiter limiter(10, nullptr);
  std::vector<StreamLimiter::Ticket> a;
  for (int i = 0; i < 3; ++i) {
    auto t = limiter.TryAcquire("team-a", 3);
    ASSERT_TRUE(t.ok()) << t.status();
    a.push_back(*std::move(t));
  }
  auto refused = limiter.TryAcquire("team-a", 3);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("tenant team-a has its max_streams (3)"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(limiter.open("team-a"), 3u);
  // Others are not held back by team-a's bound, only by the daemon's.
  auto b = limiter.TryAcquire("team-b", 3);
  auto implicit = limiter.TryAcquire();
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(implicit.ok());
  EXPECT_EQ(limiter.open(), 5u);
  // A ticket moved elsewhere still gives team-a's place back once, when it goes.
  std::optional<StreamLimiter::Ticket> moved(std::move(a[0]));
  a.erase(a.begin());
  EXPECT_EQ(limiter.open("team-a"), 3u);
  moved.reset();
  EXPECT_EQ(limiter.open("team-a"), 2u);
  EXPECT_EQ(limiter.open(), 4u);
  EXPECT_TRUE(limiter.TryAcquire("team-a", 3).ok());  // Destroyed at once: back to 2.
  EXPECT_EQ(limiter.open("team-a"), 2u);
  a.clear();
  EXPECT_EQ(limiter.open("team-a"), 0u);
}

TEST(StreamLimiterTest, TheDaemonsBoundRefusesATenantWithinItsOwn) {
  StreamLimiter limiter(1, nullptr);
  auto first = limiter.TryAcquire("team-a", 5);
  ASSERT_TRUE(first.ok());
  auto second = limiter.TryAcquire("team-a", 5);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("kvtierd has max_streams (1)"),
            absl::string_view::npos);
  EXPECT_EQ(limiter.open("team-a"), 1u);  // The refused call took no tenant place.
}

// A waiter that keeps what it was told.
class TestWaiter : public StreamLimiter::Waiter {
 public:
  void PlaceGranted(StreamLimiter::Ticket place) override {
    ++told;
    ticket = std::move(place);
    done.Notify();
  }
  void WaitRefused(absl::Status refusal) override {
    ++told;
    refused = std::move(refusal);
    done.Notify();
  }
  bool granted() const { return ticket.has_value(); }

  int told = 0;
  std::optional<StreamLimiter::Ticket> ticket;
  absl::Status refused;
  absl::Notification done;
};

// A limiter with a line and a fake clock, expired only by ExpireWaits.
struct Lined {
  explicit Lined(uint32_t places, uint32_t max_waiting) {
    StreamLimiter::LineOptions line;
    line.max_waiting = max_waiting;
    line.max_wait = absl::Seconds(5);
    line.clock = [this] { return now; };
    line.run_thread = false;
    limiter.emplace(places, nullptr, "put_streams",
                    StreamLimiter::Naming{"max_put_buffer", "max_put_buffer", "Put streams",
                                          "max_put_waiters", "put_wait"},
                    std::move(line));
  }
  absl::Time now = absl::UnixEpoch();
  std::optional<StreamLimiter> limiter;
};

TEST(StreamLimiterLineTest, APlaceGivenBackGoesToTheFirstWaiterInLine) {
  Lined l(1, 2);
  StreamLimiter& limiter = *l.limiter;
  TestWaiter a, w1, w2, w3;
  auto first = limiter.TryAcquireOrWait(&a);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->has_value()) << "a free place is taken at once";
  auto in1 = limiter.TryAcquireOrWait(&w1);
  auto in2 = limiter.TryAcquireOrWait(&w2);
  ASSERT_TRUE(in1.ok() && in2.ok());
  EXPECT_FALSE(in1->has_value());
  EXPECT_FALSE(in2->has_value());
  EXPECT_EQ(limiter.waiting(), 2u);
  // The line is full: the next caller is refused at once, naming the line's bound.
  auto full = limiter.TryAcquireOrWait(&w3);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("2 waiting"), absl::string_view::npos)
      << full.status();
  EXPECT_NE(full.status().message().find("max_put_waiters"), absl::string_view::npos);
  EXPECT_EQ(w3.told, 0);
  // The place goes to w1, not to the pool of free places and not to w2.
  first->reset();
  EXPECT_TRUE(w1.granted());
  EXPECT_EQ(w2.told, 0);
  EXPECT_EQ(limiter.open(), 1u);
  EXPECT_EQ(limiter.waiting(), 1u);
  // Nor can a plain TryAcquire take it meanwhile.
  EXPECT_FALSE(limiter.TryAcquire().ok());
  w1.ticket.reset();
  EXPECT_TRUE(w2.granted());
  EXPECT_EQ(limiter.open(), 1u);
  EXPECT_EQ(limiter.waiting(), 0u);
  // With nobody in line, a place given back is free again.
  w2.ticket.reset();
  EXPECT_EQ(limiter.open(), 0u);
  auto again = limiter.TryAcquireOrWait(&w3);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->has_value());
  EXPECT_EQ(w1.told + w2.told + w3.told, 2) << "each waiter told once, w3 never";
}

// Plentiful (what each Put's kvtier-put-places trailer says): always without a bound;
// with one, while nobody waits and a quarter of the places (at least 2) are free.
TEST(StreamLimiterLineTest, PlacesArePlentifulWhileAQuarterAreFreeAndNobodyWaits) {
  EXPECT_TRUE(StreamLimiter(0, nullptr).Plentiful());
  EXPECT_FALSE(StreamLimiter(1, nullptr).Plentiful()) << "one place is never two free";
  Lined l(8, 2);
  StreamLimiter& limiter = *l.limiter;
  EXPECT_TRUE(limiter.Plentiful());
  std::vector<StreamLimiter::Ticket> held;
  for (int i = 0; i < 6; ++i) held.push_back(*limiter.TryAcquire());
  EXPECT_TRUE(limiter.Plentiful()) << "2 of 8 free";
  held.push_back(*limiter.TryAcquire());
  EXPECT_FALSE(limiter.Plentiful()) << "1 of 8 free";
  held.pop_back();
  EXPECT_TRUE(limiter.Plentiful());
  // A waiter in line (every place taken) makes them scarce; once it is granted and the
  // line is empty, the count decides again.
  held.push_back(*limiter.TryAcquire());
  held.push_back(*limiter.TryAcquire());
  TestWaiter w;
  auto in = limiter.TryAcquireOrWait(&w);
  ASSERT_TRUE(in.ok());
  ASSERT_FALSE(in->has_value());
  held.resize(5);  // 3 given back: the first goes to the waiter.
  EXPECT_TRUE(w.granted());
  EXPECT_EQ(limiter.open(), 6u);
  EXPECT_TRUE(limiter.Plentiful()) << "the line is empty again, 2 of 8 free";
  held.push_back(*limiter.TryAcquire());
  TestWaiter w2;
  held.push_back(*limiter.TryAcquire());
  auto in2 = limiter.TryAcquireOrWait(&w2);
  ASSERT_TRUE(in2.ok());
  ASSERT_FALSE(in2->has_value());
  EXPECT_FALSE(limiter.Plentiful()) << "every place taken, one waiting";
  EXPECT_TRUE(limiter.Leave(&w2));
}

TEST(StreamLimiterLineTest, AWaiterIsRefusedAfterMaxWaitAndOnlyThen) {
  Lined l(1, 4);
  StreamLimiter& limiter = *l.limiter;
  TestWaiter a, w1, w2;
  auto held = limiter.TryAcquireOrWait(&a);
  ASSERT_TRUE(held.ok() && held->has_value());
  ASSERT_TRUE(limiter.TryAcquireOrWait(&w1).ok());  // In line at t = 0,
  l.now += absl::Seconds(2);
  ASSERT_TRUE(limiter.TryAcquireOrWait(&w2).ok());  // and at t = 2 s.
  l.now += absl::Seconds(3) - absl::Nanoseconds(1);
  EXPECT_EQ(limiter.ExpireWaits(), 0);
  EXPECT_EQ(w1.told, 0);
  l.now += absl::Nanoseconds(1);  // w1 has waited its 5 s.
  EXPECT_EQ(limiter.ExpireWaits(), 1);
  EXPECT_EQ(w1.refused.code(), absl::StatusCode::kResourceExhausted) << w1.refused;
  EXPECT_NE(w1.refused.message().find("waited 5s (put_wait)"), absl::string_view::npos)
      << w1.refused;
  EXPECT_NE(w1.refused.message().find("retry in"), absl::string_view::npos);
  EXPECT_EQ(w2.told, 0);
  EXPECT_EQ(limiter.waiting(), 1u);
  l.now += absl::Seconds(2);
  EXPECT_EQ(limiter.ExpireWaits(), 1);
  EXPECT_EQ(w2.refused.code(), absl::StatusCode::kResourceExhausted);
  // Refused waiters took no place: the holder's, given back, is free.
  EXPECT_EQ(limiter.open(), 1u);
  held->reset();
  EXPECT_EQ(limiter.open(), 0u);
  EXPECT_EQ(w1.told + w2.told, 2);
}

TEST(StreamLimiterLineTest, AWaiterThatLeavesIsNeverTold) {
  Lined l(1, 4);
  StreamLimiter& limiter = *l.limiter;
  TestWaiter a, w1, w2;
  auto held = limiter.TryAcquireOrWait(&a);
  ASSERT_TRUE(held.ok() && held->has_value());
  ASSERT_TRUE(limiter.TryAcquireOrWait(&w1).ok());
  ASSERT_TRUE(limiter.TryAcquireOrWait(&w2).ok());
  EXPECT_TRUE(limiter.Leave(&w1));
  EXPECT_FALSE(limiter.Leave(&w1)) << "out of the line already";
  held->reset();
  EXPECT_EQ(w1.told, 0);
  EXPECT_TRUE(w2.granted()) << "the place skips the waiter that left";
  EXPECT_FALSE(limiter.Leave(&w2)) << "granted: no longer in line";
  l.now += absl::Hours(1);
  EXPECT_EQ(limiter.ExpireWaits(), 0);
  EXPECT_EQ(w1.told, 0);
}

// Without a fake clock, the limiter's own thread refuses a waiter once max_wait passes.
TEST(StreamLimiterLineTest, TheLimitersThreadRefusesExpiredWaiters) {
  StreamLimiter::LineOptions line;
  line.max_waiting = 1;
  line.max_wait = absl::Milliseconds(1);
  StreamLimiter limiter(1, nullptr, "put_streams", StreamLimiter::Naming(), std::move(line));
  TestWaiter a, w;
  auto held = limiter.TryAcquireOrWait(&a);
  ASSERT_TRUE(held.ok() && held->has_value());
  ASSERT_TRUE(limiter.TryAcquireOrWait(&w).ok());
  w.done.WaitForNotification();
  EXPECT_EQ(w.refused.code(), absl::StatusCode::kResourceExhausted) << w.refused;
  EXPECT_FALSE(w.granted());
  EXPECT_EQ(limiter.waiting(), 0u);
}

// Without a line, TryAcquireOrWait takes a place or refuses, as TryAcquire does.
TEST(StreamLimiterLineTest, WithoutALineNobodyWaits) {
  StreamLimiter limiter(1, nullptr);
  TestWaiter a, w;
  auto held = limiter.TryAcquireOrWait(&a);
  ASSERT_TRUE(held.ok() && held->has_value());
  auto refused = limiter.TryAcquireOrWait(&w);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(limiter.waiting(), 0u);
  EXPECT_EQ(w.told, 0);
}

}  // namespace
}  // namespace kvtier
