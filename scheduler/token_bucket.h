// TokenBucket: caps a byte rate, for the per-session and daemon-wide streaming limits
// (QoS, and reproducing slower links and devices). Callers reserve before each frame;
// reservations are granted in call order, so sessions sharing one bucket, each with one
// reservation outstanding at a time, are served round robin frame by frame.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_SCHEDULER_TOKEN_BUCKET_H_
#define KVTIER_SCHEDULER_TOKEN_BUCKET_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "storage/fair_gate.h"  // FairGate, used beside TokenBucket.
#include "storage/steady_now.h"

namespace kvtier {

// The time a TokenBucket paces by: a monotonic clock unless a test injects its own (a
// sleep that advances a fake clock, so pacing is checked without waiting for it). The
// wall clock stepped back (NTP, a VM resumed) held every reservation back by the step.
struct PacingClock {
  std::function<absl::Time()> now = SteadyNow;
  std::function<void(absl::Duration)> sleep = [](absl::Duration d) { absl::SleepFor(d); };
};

class TokenBucket {
 public:
  // bytes_per_second 0 means unlimited. `burst`: how far a caller that was idle may run
  // ahead of the rate.
  explicit TokenBucket(double bytes_per_second, absl::Duration burst = absl::Milliseconds(5),
                       PacingClock clock = {});

  // Waits until `bytes` may be sent. Returns false (and gives the reservation up) if
  // `cancelled` turns true while waiting; it is polled every millisecond.
  bool Acquire(uint64_t bytes, absl::FunctionRef<bool()> cancelled);
  double bytes_per_second() const { return rate_; }

 private:
  const double rate_;
  const absl::Duration burst_;
  const PacingClock clock_;
  absl::Mutex mu_;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_now_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // The clock, last read.
};

}  // namespace kvtier

#endif  // KVTIER_SCHEDULER_TOKEN_BUCKET_H_
