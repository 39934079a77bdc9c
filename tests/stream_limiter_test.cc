// StreamLimiter: the daemon-wide bound on open streaming calls, and a tenant's own
// bound within it.
#include "server/stream_limiter.h"

#include <optional>
#include <utility>
#include <vector>

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

}  // namespace
}  // namespace kvtier
