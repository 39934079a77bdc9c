// The Cake planner's arithmetic: where the worker computing forward and the daemon
// streaming backward should meet, and, at run time, whether the next chunk is still
// worth streaming. Pure functions; the estimates come from BandwidthEstimator and
// ComputeModel.
#ifndef KVTIER_SCHEDULER_CAKE_PLANNER_H_
#define KVTIER_SCHEDULER_CAKE_PLANNER_H_

#include <cstdint>

#include "absl/types/span.h"
#include "scheduler/compute_model.h"

namespace kvtier {

struct MeetingPlan {
  uint32_t meeting = 0;  // Compute [0, meeting), stream [meeting, h).
  double seconds = 0;    // When both sides finish: max(compute, stream).
};

// `stream_seconds[j]`: time to stream chunk j, for j in [0, h). Picks the split with the
// least finishing time (the earliest meeting among ties). O(h).
MeetingPlan PlanMeeting(absl::Span<const double> stream_seconds, const ComputeCost& cost);

// Before streaming chunk j: the worker has computed [0, computed) and has spent
// `busy_seconds` on chunk `computed`. Streaming j pays off only if it arrives before the
// worker would have computed it. j >= computed.
bool WorthStreaming(uint32_t j, uint32_t computed, double busy_seconds,
                    const ComputeCost& cost, double stream_seconds_j);

}  // namespace kvtier

#endif  // KVTIER_SCHEDULER_CAKE_PLANNER_H_
