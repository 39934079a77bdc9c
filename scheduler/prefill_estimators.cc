#include "scheduler/prefill_estimators.h"

#include <algorithm>

namespace kvtier {

PrefillEstimators::PrefillEstimators(PrefillEstimatorOptions options)
    : options_(options),
      ssd_read_(options.ssd_read_prior),
      send_(options.send_prior),
      device_(std::make_shared<BandwidthEstimator>(options.device_prior)),
      compute_prior_(options.compute_prior) {}

std::shared_ptr<BandwidthEstimator> PrefillEstimators::Connection(const std::string& peer) {
  const absl::Time now = options_.now();
  absl::MutexLock lock(&mu_);
  if (auto it = connections_.find(peer); it != connections_.end()) {
    Known& k = it->second;
    lru_.splice(lru_.begin(), lru_, k.lru);
    if (const uint64_t samples = k.estimator->samples(); samples != k.samples) {
      k.samples = samples;
      k.sampled_at = now;
    } else if (now - k.sampled_at > options_.connection_stale_after) {
      // Sessions this estimate kept from streaming taught it nothing since. It starts
      // again no lower than the prior: the daemon-wide figure took the same samples as
      // this one (every send records into both), so on a daemon with one connection it
      // is the same stalled figure, and starting there would change nothing.
      k.estimator = std::make_shared<BandwidthEstimator>(
          std::max(options_.send_prior, send_.BytesPerSecond()));
      k.samples = 0;
      k.sampled_at = now;
    }
    return k.estimator;
  }
  if (connections_.size() >= options_.max_connections && !lru_.empty()) {
    connections_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(peer);
  auto estimator = std::make_shared<BandwidthEstimator>(send_.BytesPerSecond());
  connections_[peer] = Known{estimator, lru_.begin(), 0, now};
  return estimator;
}

ComputeCost PrefillEstimators::ComputePrior() const {
  absl::MutexLock lock(&mu_);
  return compute_prior_;
}

void PrefillEstimators::RecordComputeFit(const ComputeCost& fit) {
  absl::MutexLock lock(&mu_);
  // Within a factor of 4 of the prior, each term against its own: one session (any
  // tenant's, timed by itself: a worker that reports slowly on purpose) moves every
  // later session's plan by at most 1.75x, however far off its fit is. (b was once
  // bounded by a, ten times b with the defaults.)
  const double a = compute_prior_.a, b = compute_prior_.b;
  const double fit_a = a > 0 ? std::clamp(fit.a, a / 4, a * 4) : std::max(0.0, fit.a);
  const double fit_b = std::clamp(fit.b, 0.0, b > 0 ? 4 * b : a);
  // And within kPriorBand of the configured prior, however many sessions push it one
  // way: steps compound (ten sessions at 1.75x once moved it 270x).
  const ComputeCost& base = options_.compute_prior;
  compute_prior_.a = std::clamp(0.75 * a + 0.25 * fit_a, base.a / kPriorBand, base.a * kPriorBand);
  compute_prior_.b = std::clamp(0.75 * b + 0.25 * fit_b, 0.0,
                                (base.b > 0 ? base.b : base.a) * kPriorBand);
}

}  // namespace kvtier
