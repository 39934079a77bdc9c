// PyCanceller: lets Python cancel a native call that is running on another thread with
// the GIL released (kvtier.aio cancels a task this way; kvtier.Client's background
// loads use it on close). Cancel() may be called from any thread, before or during the
// call; the call then ends with kvtier.CancelledError: at its next frame for a transfer
// in progress, and at once through the gRPC context (CallCancellation) for a call that
// is waiting on the daemon, a stopped one included. The call opens a Scope of
// cancellation() on its thread (ScopeOf).
//
// Threading: Cancel() and cancelled() are thread-safe (an atomic flag, and the
// CallCancellation's own lock).
#ifndef KVTIER_CLIENT_PYTHON_NATIVE_PY_CANCELLER_H_
#define KVTIER_CLIENT_PYTHON_NATIVE_PY_CANCELLER_H_

#include <atomic>

#include "absl/status/status.h"
#include "client/call_cancellation.h"

namespace kvtier::python {

class PyCanceller {
 public:
  void Cancel() {
    cancelled_.store(true, std::memory_order_release);
    cancellation_.Cancel();
  }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // CancelledError once Cancel() was called, else Ok.
  absl::Status Check() const {
    return cancelled() ? absl::CancelledError("cancelled by the caller") : absl::OkStatus();
  }

  CallCancellation* cancellation() { return &cancellation_; }

 private:
  std::atomic<bool> cancelled_{false};
  CallCancellation cancellation_;
};

// The cancellation a call with `canceller` (may be null) opens a Scope of.
inline CallCancellation* ScopeOf(PyCanceller* canceller) {
  return canceller != nullptr ? canceller->cancellation() : nullptr;
}

}  // namespace kvtier::python

#endif  // KVTIER_CLIENT_PYTHON_NATIVE_PY_CANCELLER_H_
