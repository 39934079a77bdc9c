// EnqueueGate: orders "enqueued" before "done" for one device submission. A caller that
// is told when its copies are on the device's stream (to let another process wait on
// an event recorded after them) and when they have landed must hear it in that order,
// but the backend may complete the copies, on its own thread, before Submit returns.
//
//   auto gate = std::make_shared<EnqueueGate>();
//   backend->Submit(copies, [gate, done](absl::Status s) {
//     gate->AfterEnqueued([done, s] { done(s); });
//   });
//   gate->Enqueued(enqueued);  // Runs `enqueued`, then a `done` that came first.
//
// Thread-safety: thread-safe; each method is called once.
#ifndef KVTIER_STORAGE_ENQUEUE_GATE_H_
#define KVTIER_STORAGE_ENQUEUE_GATE_H_

#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

class EnqueueGate {
 public:
  // Runs `fn` now if Enqueued has run, else once it has (on Enqueued's thread).
  void AfterEnqueued(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu_);
      if (!enqueued_) {
        deferred_ = std::move(fn);
        return;
      }
    }
    fn();
  }
  // Runs `enqueued` (may be empty), then whatever AfterEnqueued deferred.
  void Enqueued(const std::function<void()>& enqueued) {
    if (enqueued) enqueued();
    std::function<void()> deferred;
    {
      absl::MutexLock lock(&mu_);
      enqueued_ = true;
      deferred = std::move(deferred_);
    }
    if (deferred) deferred();
  }

 private:
  absl::Mutex mu_;
  bool enqueued_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> deferred_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_ENQUEUE_GATE_H_
