// LogLimiter: lets one log line of a kind through per interval and counts the ones it
// held back, so that a fault hit by every request (a full disk under a stream of
// write-backs) leaves a line a second in the journal, not thousands.
//
//   static LogLimiter limiter(absl::Seconds(1));
//   if (auto held = limiter.Allow(now)) LogWarning("...", *held, " more like it");
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_LOG_LIMITER_H_
#define KVTIER_STORAGE_LOG_LIMITER_H_

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtier {

class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration interval) : interval_(interval) {}

  // If a line may be logged at `now`: how many were held back since the last one
  // allowed. nullopt: hold this one back (it is counted).
  std::optional<uint64_t> Allow(absl::Time now);

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_LOG_LIMITER_H_
