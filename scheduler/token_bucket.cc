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
    const absl::Time now = clock_.now();
    // A clock that stepped back (an injected one) moves the reservations back with it,
    // rather than holding every caller back by the step.
    if (now < last_now_) next_ -= last_now_ - now;
    last_now_ = now;
    // An idle bucket does not bank more than `burst` of credit.
    next_ = std::max(next_, now - burst_);
    start = next_;
    next_ += cost;
  }
  while (true) {
    const absl::Time now = clock_.now();
    const absl::Duration wait = start - now;
    if (wait <= absl::ZeroDuration()) {
      absl::MutexLock lock(&mu_);
      last_now_ = std::max(last_now_, now);  // Time the wait saw pass.
      return true;
    }
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
