#include "scheduler/prefill_estimators.h"

namespace kvtier {

PrefillEstimators::PrefillEstimators(PrefillEstimatorOptions options)
    : options_(options),
      ssd_read_(options.ssd_read_prior),
      send_(options.send_prior),
      device_(std::make_shared<BandwidthEstimator>(options.device_prior)),
      compute_prior_(options.compute_prior) {}

std::shared_ptr<BandwidthEstimator> PrefillEstimators::Connection(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  if (auto it = connections_.find(peer); it != connections_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.second);
    return it->second.first;
  }
  if (connections_.size() >= options_.max_connections && !lru_.empty()) {
    connections_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(peer);
  auto estimator = std::make_shared<BandwidthEstimator>(send_.BytesPerSecond());
  connections_[peer] = {estimator, lru_.begin()};
  return estimator;
}

ComputeCost PrefillEstimators::ComputePrior() const {
  absl::MutexLock lock(&mu_);
  return compute_prior_;
}

void PrefillEstimators::RecordComputeFit(const ComputeCost& fit) {
  absl::MutexLock lock(&mu_);
  compute_prior_.a = 0.75 * compute_prior_.a + 0.25 * fit.a;
  compute_prior_.b = 0.75 * compute_prior_.b + 0.25 * fit.b;
}

}  // namespace kvtier
