#include "scheduler/cake_planner.h"

#include <algorithm>
#include <vector>

namespace kvtier {

MeetingPlan PlanMeeting(absl::Span<const double> stream_seconds, const ComputeCost& cost) {
  const uint32_t h = static_cast<uint32_t>(stream_seconds.size());
  // suffix[m] = time to stream [m, h).
  std::vector<double> suffix(h + 1, 0.0);
  for (uint32_t j = h; j > 0; --j) suffix[j - 1] = suffix[j] + stream_seconds[j - 1];
  MeetingPlan best{0, suffix[0]};
  for (uint32_t m = 1; m <= h; ++m) {
    const double t = std::max(cost.Range(0, m), suffix[m]);
    if (t < best.seconds) best = {m, t};
  }
  return best;
}

bool WorthStreaming(uint32_t j, uint32_t computed, double busy_seconds,
                    const ComputeCost& cost, double stream_seconds_j) {
  // Time until the worker finishes chunk j: what is left of the chunk in hand (at
  // least nothing, if it is slower than forecast), then the chunks after it up to j.
  const double in_hand = std::max(0.0, cost.Chunk(computed) - busy_seconds);
  const double compute_done_j = in_hand + cost.Range(computed + 1, j + 1);
  return stream_seconds_j < compute_done_j;
}

}  // namespace kvtier
