// PrefillEstimators: what the planner knows across sessions. SSD read bandwidth (one
// moving average for the tier), send bandwidth per connection (keyed by the gRPC peer,
// which names one TCP connection; bounded, least recently used dropped), and a prior for
// the compute cost: a moving average of the a and b that finished sessions fitted, used
// by sessions whose Open carries no estimate.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_SCHEDULER_PREFILL_ESTIMATORS_H_
#define KVTIER_SCHEDULER_PREFILL_ESTIMATORS_H_

#include <functional>
#include <list>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "scheduler/bandwidth_estimator.h"
#include "scheduler/compute_model.h"

namespace kvtier {

struct PrefillEstimatorOptions {
  double ssd_read_prior = 1.0e9;   // Bytes/s before the first SSD read is measured.
  double send_prior = 1.0e9;       // Bytes/s for a connection never measured.
  // Bytes/s of a delivery into a worker's GPU memory before the first is measured: a
  // PCIe 4 x16 link's host-to-device rate. Not a connection's rate: those bytes never
  // cross the network, so a stream's estimate would keep the daemon from streaming.
  double device_prior = 20.0e9;
  ComputeCost compute_prior{0.025, 0.0027};  // A 7B model on an A100, 512-token chunks.
  size_t max_connections = 1024;
  // A connection's estimate with no new sample for this long starts again from the
  // daemon-wide one, or send_prior if that is higher: the daemon records only what it
  // streams, so an estimate too low to stream anything would otherwise never be
  // corrected.
  absl::Duration connection_stale_after = absl::Minutes(5);
  std::function<absl::Time()> now = [] { return absl::Now(); };  // Tests inject one.
};

class PrefillEstimators {
 public:
  explicit PrefillEstimators(PrefillEstimatorOptions options = {});

  BandwidthEstimator& ssd_read() { return ssd_read_; }
  // The estimator of one connection; created from the daemon-wide send average, and
  // again (no lower than send_prior) once it has had no new sample for
  // connection_stale_after.
  std::shared_ptr<BandwidthEstimator> Connection(const std::string& peer);
  // Daemon-wide send bandwidth (all connections).
  BandwidthEstimator& send() { return send_; }
  // Deliveries into workers' GPU memory (Prefill sessions with a device target): the
  // daemon's one GPU, whichever worker asks.
  std::shared_ptr<BandwidthEstimator> Device() { return device_; }

  ComputeCost ComputePrior() const;
  // Folds a finished session's fit into the prior (moving average, weight 1/4), each
  // term within a factor of 4 of the prior's, and the prior within kPriorBand of
  // options.compute_prior.
  void RecordComputeFit(const ComputeCost& fit);
  static constexpr double kPriorBand = 64;

 private:
  const PrefillEstimatorOptions options_;
  BandwidthEstimator ssd_read_;
  BandwidthEstimator send_;
  const std::shared_ptr<BandwidthEstimator> device_;
  mutable absl::Mutex mu_;
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // Front: most recent.
  struct Known {
    std::shared_ptr<BandwidthEstimator> estimator;
    std::list<std::string>::iterator lru;
    uint64_t samples = 0;         // Its samples when last looked at...
    absl::Time sampled_at;        // ...and when that count last changed.
  };
  absl::flat_hash_map<std::string, Known> connections_ ABSL_GUARDED_BY(mu_);
  ComputeCost compute_prior_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SCHEDULER_PREFILL_ESTIMATORS_H_
