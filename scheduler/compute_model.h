// ComputeModel: the worker's cost of computing chunk i, fitted as a + b*i seconds by
// least squares over (i, seconds) samples taken from Progress timings. Attention over
// the prefix makes the cost grow linearly with position (Cake, section 3), so two
// parameters are enough. With fewer than two distinct positions it keeps the prior's
// slope and fits only the intercept; fitted values are clamped to be non-negative.
//
// Thread-safety: not thread-safe; one session owns one model.
#ifndef KVTIER_SCHEDULER_COMPUTE_MODEL_H_
#define KVTIER_SCHEDULER_COMPUTE_MODEL_H_

#include <cstdint>

namespace kvtier {

struct ComputeCost {
  double a = 0;  // Seconds.
  double b = 0;  // Seconds per chunk index.

  double Chunk(uint32_t i) const { return a + b * i; }
  // Seconds to compute chunks [begin, end).
  double Range(uint32_t begin, uint32_t end) const;
};

class ComputeModel {
 public:
  explicit ComputeModel(ComputeCost prior) : prior_(prior) {}

  void AddSample(uint32_t index, double seconds);
  ComputeCost Estimate() const;
  uint32_t samples() const { return n_; }

 private:
  const ComputeCost prior_;
  uint32_t n_ = 0;
  double sum_i_ = 0, sum_t_ = 0, sum_ii_ = 0, sum_it_ = 0;
  uint32_t min_i_ = UINT32_MAX, max_i_ = 0;
};

// What a Prefill session plans with, given its fit so far and the worker's own estimate
// (if the Open carried one).
struct ChosenCost {
  ComputeCost cost;
  bool known = false;     // From the worker's estimate or a trusted fit; else a prior.
  bool from_fit = false;  // The fit was trusted (and may be folded into the prior).
};
// The fit is trusted from kTrustedFitSamples samples on. Progress that arrives in a
// burst (a worker's host thread descheduled while its GPU ran ahead, or an Open that
// reached the daemon late) has near-zero gaps and makes chunks look free, and a cost
// too low stops the stream early: the worker then computes what the daemon would have
// sent. So a fit that puts the request's `chunks` at under half of the worker's
// estimate is taken for a burst, and the estimate stands. Without an estimate the fit
// is trusted as it is (the prior is other workers' pace, which may be slower). Until
// the fit has enough samples: the estimate, or else `fallback` with known = false.
inline constexpr uint32_t kTrustedFitSamples = 4;
ChosenCost ChooseComputeCost(const ComputeModel& model, const ComputeCost* estimate,
                             const ComputeCost& fallback, uint32_t chunks);

}  // namespace kvtier

#endif  // KVTIER_SCHEDULER_COMPUTE_MODEL_H_
