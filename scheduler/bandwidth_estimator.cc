#include "scheduler/bandwidth_estimator.h"

#include <cmath>

namespace kvtier {

BandwidthEstimator::BandwidthEstimator(double prior, double half_life_bytes)
    : half_life_bytes_(half_life_bytes), seconds_per_byte_(prior > 0 ? 1.0 / prior : 0) {}

void BandwidthEstimator::Record(uint64_t bytes, double seconds) {
  if (bytes == 0 || !(seconds > 0)) return;
  const double sample = seconds / static_cast<double>(bytes);
  absl::MutexLock lock(&mu_);
  if (samples_ == 0) {
    seconds_per_byte_ = sample;  // The prior is a guess; the first measurement wins.
  } else {
    const double keep = std::exp2(-static_cast<double>(bytes) / half_life_bytes_);
    seconds_per_byte_ = keep * seconds_per_byte_ + (1 - keep) * sample;
  }
  ++samples_;
}

double BandwidthEstimator::BytesPerSecond() const {
  absl::MutexLock lock(&mu_);
  return seconds_per_byte_ > 0 ? 1.0 / seconds_per_byte_ : 0;
}

uint64_t BandwidthEstimator::samples() const {
  absl::MutexLock lock(&mu_);
  return samples_;
}

}  // namespace kvtier
