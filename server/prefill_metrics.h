// PrefillMetrics: the Cake sessions' Prometheus metrics, declared here and nowhere else.
//   kvtier_prefill_sessions_total{reason}              how sessions ended
//   kvtier_prefill_seconds{kind="predicted"|"actual"}  forecast vs outcome, Open to Done
//   kvtier_prefill_meeting_error_chunks                |predicted meeting - actual|
//   kvtier_prefill_streamed_chunks_total, kvtier_prefill_computed_chunks_total
//   kvtier_prefill_streamed_bytes_total
//   kvtier_prefill_estimate{what="ssd_read_bytes_per_second"|"send_bytes_per_second"|
//                           "compute_a_seconds"|"compute_b_seconds"} (read at scrape)
//
// Thread-safety: thread-safe.
#ifndef KVTIER_SERVER_PREFILL_METRICS_H_
#define KVTIER_SERVER_PREFILL_METRICS_H_

#include <array>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "kvtier/v1/kvtier.pb.h"
#include "scheduler/prefill_estimators.h"

namespace kvtier {

class PrefillMetrics {
 public:
  // `registry` must outlive this object.
  explicit PrefillMetrics(prometheus::Registry& registry);

  void SessionEnded(v1::PrefillDone::Reason reason, double predicted_seconds,
                    double actual_seconds, uint32_t predicted_meeting, uint32_t first_streamed,
                    uint32_t cached_prefix);
  void Streamed(uint64_t bytes) { streamed_bytes_->Increment(static_cast<double>(bytes)); }

 private:
  // One per PrefillDone::Reason value.
  std::array<prometheus::Counter*, v1::PrefillDone::Reason_ARRAYSIZE> sessions_{};
  prometheus::Histogram* predicted_ = nullptr;
  prometheus::Histogram* actual_ = nullptr;
  prometheus::Histogram* meeting_error_ = nullptr;
  prometheus::Counter* streamed_chunks_ = nullptr;
  prometheus::Counter* computed_chunks_ = nullptr;
  prometheus::Counter* streamed_bytes_ = nullptr;
};

// The estimators' current values, read at scrape time.
class PrefillEstimatesCollector final : public prometheus::Collectable {
 public:
  explicit PrefillEstimatesCollector(PrefillEstimators* estimators) : estimators_(estimators) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  PrefillEstimators* const estimators_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_PREFILL_METRICS_H_
