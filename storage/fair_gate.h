// FairGate: a counting semaphore that admits waiters in arrival order (a ticket lock
// with capacity). Bounds concurrent SSD reads across Prefill sessions, and the SSD
// reads the tiered store serves from heap buffers.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_FAIR_GATE_H_
#define KVTIER_STORAGE_FAIR_GATE_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtier {

// FairGate: at most `capacity` holders at once, admitted in arrival order (a ticket
// lock with capacity). Bounds concurrent SSD reads across sessions.
class FairGate {
 public:
  explicit FairGate(int capacity) : capacity_(capacity) {}
  void Enter();
  // Enter, unless `cancelled()` (checked every `poll` while waiting, without this
  // object's lock) says to give up first: then it leaves the line, its place in it goes
  // to the next, and it returns false. A caller whose work was called off (a Prefill
  // session that ended) does not wait behind every queued read for a read nobody needs.
  bool EnterUnless(absl::FunctionRef<bool()> cancelled,
                   absl::Duration poll = absl::Milliseconds(10));
  // Enter, only if that needs no wait (a place free and nobody waiting for one).
  bool TryEnter();
  void Leave();
  // Callers blocked in Enter now (tests: a named point to wait for instead of a sleep).
  uint64_t waiting() const;

 private:
  const int capacity_;
  mutable absl::Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t serving_ ABSL_GUARDED_BY(mu_) = 0;  // Tickets below this may enter.
  int inside_ ABSL_GUARDED_BY(mu_) = 0;
  // Tickets whose holders gave up waiting (EnterUnless): skipped when their turn comes.
  absl::flat_hash_set<uint64_t> abandoned_ ABSL_GUARDED_BY(mu_);
  void SkipAbandonedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_FAIR_GATE_H_
