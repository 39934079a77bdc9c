#include "server/prefill_metrics.h"

#include <cmath>
#include <cstdlib>

#include <prometheus/family.h>

namespace kvtier {

PrefillMetrics::PrefillMetrics(prometheus::Registry& registry) {
  auto& sessions = prometheus::BuildCounter()
                       .Name("kvtier_prefill_sessions_total")
                       .Help("Prefill sessions that sent Done, by reason")
                       .Register(registry);
  for (int r = 0; r < static_cast<int>(sessions_.size()); ++r) {
    sessions_[r] = &sessions.Add(
        {{"reason", v1::PrefillDone::Reason_Name(static_cast<v1::PrefillDone::Reason>(r))}});
  }
  auto& seconds = prometheus::BuildHistogram()
                      .Name("kvtier_prefill_seconds")
                      .Help("Prefill session time from Open to Done: the planner's forecast "
                            "(kind=predicted) and what happened (kind=actual)")
                      .Register(registry);
  const prometheus::Histogram::BucketBoundaries time_buckets = {
      0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128};
  predicted_ = &seconds.Add({{"kind", "predicted"}}, time_buckets);
  actual_ = &seconds.Add({{"kind", "actual"}}, time_buckets);
  meeting_error_ = &prometheus::BuildHistogram()
                        .Name("kvtier_prefill_meeting_error_chunks")
                        .Help("Chunks between the forecast meeting point and the actual one")
                        .Register(registry)
                        .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 4, 8, 16, 32, 64});
  auto& chunks = prometheus::BuildCounter()
                     .Name("kvtier_prefill_chunks_total")
                     .Help("Cached chunks of prefill sessions, by who supplied them")
                     .Register(registry);
  streamed_chunks_ = &chunks.Add({{"source", "streamed"}});
  computed_chunks_ = &chunks.Add({{"source", "computed"}});
  streamed_bytes_ = &prometheus::BuildCounter()
                         .Name("kvtier_prefill_streamed_bytes_total")
                         .Help("Chunk bytes sent by prefill sessions")
                         .Register(registry)
                         .Add({});
}

void PrefillMetrics::SessionEnded(v1::PrefillDone::Reason reason, double predicted_seconds,
                                  double actual_seconds, uint32_t predicted_meeting,
                                  uint32_t first_streamed, uint32_t cached_prefix) {
  const int r = static_cast<int>(reason);
  if (r >= 0 && r < static_cast<int>(sessions_.size())) sessions_[r]->Increment();
  if (cached_prefix == 0) return;
  predicted_->Observe(predicted_seconds);
  actual_->Observe(actual_seconds);
  meeting_error_->Observe(
      std::abs(static_cast<double>(predicted_meeting) - static_cast<double>(first_streamed)));
  streamed_chunks_->Increment(cached_prefix - first_streamed);
  computed_chunks_->Increment(first_streamed);
}

std::vector<prometheus::MetricFamily> PrefillEstimatesCollector::Collect() const {
  prometheus::MetricFamily f;
  f.name = "kvtier_prefill_estimate";
  f.help = "The Cake planner's current estimates";
  f.type = prometheus::MetricType::Gauge;
  const ComputeCost prior = estimators_->ComputePrior();
  const std::pair<const char*, double> values[] = {
      {"ssd_read_bytes_per_second", estimators_->ssd_read().BytesPerSecond()},
      {"send_bytes_per_second", estimators_->send().BytesPerSecond()},
      {"compute_a_seconds", prior.a},
      {"compute_b_seconds", prior.b},
  };
  for (const auto& [what, value] : values) {
    prometheus::ClientMetric m;
    m.label = {{"what", what}};
    m.gauge.value = value;
    f.metric.push_back(std::move(m));
  }
  return {f};
}

}  // namespace kvtier
