#include "storage/log_limiter.h"

namespace kvtier {

std::optional<uint64_t> LogLimiter::Allow(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (now < next_) {
    ++held_;
    return std::nullopt;
  }
  next_ = now + interval_;
  const uint64_t held = held_;
  held_ = 0;
  return held;
}

}  // namespace kvtier
