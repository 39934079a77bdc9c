// SteadyNow: a monotonic clock as absl::Time, for the deadlines and idle times the
// daemon measures (stall reaping, waiting lines, leases, pacing, rate buckets). The wall
// clock (absl::Now) steps with NTP, a VM resumed or `date -s`: stepped forward it would
// end every wait and reap every healthy stream at once; stepped back, hold them all
// for the step. The value is only ever compared with other SteadyNow values.
#ifndef KVTIER_STORAGE_STEADY_NOW_H_
#define KVTIER_STORAGE_STEADY_NOW_H_

#include <chrono>

#include "absl/time/time.h"

namespace kvtier {

inline absl::Time SteadyNow() {
  return absl::UnixEpoch() +
         absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

}  // namespace kvtier

#endif  // KVTIER_STORAGE_STEADY_NOW_H_
