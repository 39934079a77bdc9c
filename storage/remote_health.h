// RemoteHealth: whether the remote tier is usable, with exponential backoff. A failure
// to reach the cluster marks it degraded (logged once, shown in metrics); while
// degraded, Allow() lets one operation through per backoff period as a probe and
// refuses the rest at once, so reads miss and writes are dropped without waiting on
// timeouts. The first success clears it.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_REMOTE_HEALTH_H_
#define KVTIER_STORAGE_REMOTE_HEALTH_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtier {

class RemoteHealth {
 public:
  RemoteHealth(absl::Duration min_backoff, absl::Duration max_backoff,
               std::function<absl::Time()> now);

  // True when healthy, or when degraded and the backoff has passed (then this caller is
  // the probe, and the next probe waits another backoff).
  bool Allow();
  // Allow() would say true now; takes nothing (for callers that only queue work).
  bool ProbeDue() const;
  void Succeeded();
  // The first failure degrades; while degraded, only the failure of a probe (an
  // operation Allow() let through as one) doubles the backoff, however many replies of
  // that operation, or of operations begun before, failed with it.
  void Failed(const absl::Status& why);

  bool degraded() const;
  // Times it went from healthy to degraded.
  uint64_t degradations() const;
  absl::Duration backoff() const;

 private:
  const absl::Duration min_backoff_;
  const absl::Duration max_backoff_;
  const std::function<absl::Time()> now_;
  mutable absl::Mutex mu_;
  bool degraded_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_);
  absl::Time next_probe_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool probing_ ABSL_GUARDED_BY(mu_) = false;  // A probe is out and has not failed yet.
  uint64_t degradations_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REMOTE_HEALTH_H_
