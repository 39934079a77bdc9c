// BandwidthEstimator: a moving average of measured throughput (bytes per second), one
// instance per thing measured: SSD reads, or sends on one connection. Each sample is a
// transfer of `bytes` that took `seconds`; the estimate is an exponentially weighted
// average of the samples' rates, weighted by bytes so a 4 MiB frame counts more than a
// 4 KiB one. Until the first sample it returns the prior.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_SCHEDULER_BANDWIDTH_ESTIMATOR_H_
#define KVTIER_SCHEDULER_BANDWIDTH_ESTIMATOR_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

class BandwidthEstimator {
 public:
  // `prior`: bytes/s before any sample. `half_life_bytes`: after this many bytes of new
  // samples, old ones weigh half (default 64 MiB: a few chunks).
  explicit BandwidthEstimator(double prior, double half_life_bytes = 64.0 * (1 << 20));

  // Ignores samples with no bytes or no time.
  void Record(uint64_t bytes, double seconds);
  double BytesPerSecond() const;
  uint64_t samples() const;

 private:
  const double half_life_bytes_;
  mutable absl::Mutex mu_;
  // Averaged in the time domain (seconds per byte), which is what predictions add up.
  double seconds_per_byte_ ABSL_GUARDED_BY(mu_);
  uint64_t samples_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SCHEDULER_BANDWIDTH_ESTIMATOR_H_
