// LogLimiter: one line per interval on the injected clock, the rest counted.
#include "storage/log_limiter.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

TEST(LogLimiterTest, OneLinePerIntervalAndTheRestCounted) {
  LogLimiter limiter(absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  ASSERT_EQ(limiter.Allow(t0), 0u);  // The first line always goes out.
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Allow(t0 + absl::Milliseconds(100 * i)));
  EXPECT_FALSE(limiter.Allow(t0 + absl::Milliseconds(999)));
  // One interval on: allowed, saying six were held back.
  EXPECT_EQ(limiter.Allow(t0 + absl::Seconds(1)), 6u);
  // And the count starts over.
  EXPECT_FALSE(limiter.Allow(t0 + absl::Milliseconds(1500)));
  EXPECT_EQ(limiter.Allow(t0 + absl::Seconds(5)), 1u);
  EXPECT_EQ(limiter.Allow(t0 + absl::Seconds(6)), 0u);
}

}  // namespace
}  // namespace kvtier
