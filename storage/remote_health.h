// RemoteHealth: whether the remote tier is usable, with exponential backoff. A failure
// to reach the cluster marks it degraded (logged once, shown in metrics); while
// degraded, Allow() refuses operations at once, so reads miss and writes are dropped
// without waiting on timeouts, except one per backoff period, which first runs a probe.
// Only a probe that succeeds clears the state: an ordinary operation that succeeds
// says nothing of the nodes it did not touch (with one master down, a read of a key on
// another one answers, and the next chunk, with segments on every master, would wait
// out the timeout on the dead one again).
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_REMOTE_HEALTH_H_
#define KVTIER_STORAGE_REMOTE_HEALTH_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtier {

class RemoteHealth {
 public:
  RemoteHealth(absl::Duration min_backoff, absl::Duration max_backoff,
               std::function<absl::Time()> now);

  // True when healthy. When degraded: false within the backoff; past it this caller
  // runs `probe` (on its own thread, without the lock; the next probe waits another
  // backoff), which must reach the whole cluster, and its result decides: Ok clears the
  // state and returns true, a failure counts as Failed() of a probe and returns false.
  bool Allow(absl::FunctionRef<absl::Status()> probe);
  // Allow() would not refuse now; takes nothing (for callers that only queue work).
  bool ProbeDue() const;
  // The first failure degrades; while degraded, only the failure of a probe doubles the
  // backoff, however many replies of operations begun before failed with it.
  void Failed(const absl::Status& why);

  bool degraded() const;
  // Times it went from healthy to degraded.
  uint64_t degradations() const;
  absl::Duration backoff() const;

 private:
  // A probe reached the whole cluster: healthy again, the backoff back to its minimum.
  void Succeeded();

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
