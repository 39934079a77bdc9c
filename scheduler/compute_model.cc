#include "scheduler/compute_model.h"

#include <algorithm>

namespace kvtier {

double ComputeCost::Range(uint32_t begin, uint32_t end) const {
  if (end <= begin) return 0;
  const double n = end - begin;
  // Sum of a + b*i over [begin, end): n*a + b*(begin + end - 1)*n/2.
  return n * a + b * (static_cast<double>(begin) + end - 1) * n / 2;
}

void ComputeModel::AddSample(uint32_t index, double seconds) {
  if (!(seconds >= 0)) return;
  ++n_;
  sum_i_ += index;
  sum_t_ += seconds;
  sum_ii_ += static_cast<double>(index) * index;
  sum_it_ += index * seconds;
  min_i_ = std::min(min_i_, index);
  max_i_ = std::max(max_i_, index);
}

ComputeCost ComputeModel::Estimate() const {
  if (n_ == 0) return prior_;
  const double n = n_;
  ComputeCost c;
  if (max_i_ == min_i_) {
    // One position: keep the prior's slope, fit the intercept.
    c.b = prior_.b;
    c.a = sum_t_ / n - c.b * sum_i_ / n;
  } else {
    const double denom = n * sum_ii_ - sum_i_ * sum_i_;
    c.b = (n * sum_it_ - sum_i_ * sum_t_) / denom;
    c.a = (sum_t_ - c.b * sum_i_) / n;
  }
  if (c.b < 0) {  // Noise can tilt a short fit; cost does not fall with position.
    c.b = 0;
    c.a = sum_t_ / n;
  }
  c.a = std::max(0.0, c.a);
  return c;
}

ChosenCost ChooseComputeCost(const ComputeModel& model, const ComputeCost* estimate,
                             const ComputeCost& fallback, uint32_t chunks) {
  ChosenCost out;
  out.cost = estimate != nullptr ? *estimate : fallback;
  out.known = estimate != nullptr;
  if (model.samples() < kTrustedFitSamples) return out;
  const ComputeCost fit = model.Estimate();
  // Over the chunks the fit saw at least: with none cached (chunks 0) both ranges were
  // 0, and a burst's fit passed as the worker's pace.
  const uint32_t horizon = std::max(chunks, model.samples());
  if (estimate != nullptr && fit.Range(0, horizon) < 0.5 * estimate->Range(0, horizon)) {
    return out;  // A burst, not the worker's pace.
  }
  out.cost = fit;
  out.known = true;
  out.from_fit = true;
  return out;
}

}  // namespace kvtier
