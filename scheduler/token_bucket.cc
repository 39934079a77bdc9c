#include "scheduler/token_bucket.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace kvtier {

TokenBucket::TokenBucket(double bytes_per_second, absl::Duration burst, PacingClock clock)
    : rate_(bytes_per_second), burst_(burst), clock_(std::move(clock)) {}

bool TokenBucket::Acquire(uint64_t bytes, absl::FunctionRef<bool()> cancelled) {
  if (rate_ <= 0) return !cancelled();
  const absl::Duration cost = absl::Seconds(static_cast<double>(bytes) / rate_);
  absl::Time start;
  {
    absl::MutexLock lock(&mu_);
    // An idle bucket does not bank more than `burst` of credit.
    next_ = std::max(next_, clock_.now() - burst_);
    start = next_;
    next_ += cost;
  }
  while (true) {
    const absl::Duration wait = start - clock_.now();
    if (wait <= absl::ZeroDuration()) return true;
    if (cancelled()) {
      // Hand back what we did not use, if nobody reserved after us.
      absl::MutexLock lock(&mu_);
      if (next_ == start + cost) next_ = start;
      return false;
    }
    clock_.sleep(std::min(wait, absl::Milliseconds(1)));
  }
}

}  // namespace kvtier
