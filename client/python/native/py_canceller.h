// PyCanceller: lets Python cancel a native call that is running on another thread with
// the GIL released (kvtier.aio cancels a task this way; kvtier.Client's background
// loads use it on close). Cancel() may be called from any thread, before or during the
// call; the call then ends with kvtier.CancelledError once it notices: at its next
// frame for a transfer in progress, or at once through the gRPC context for a call
// that is waiting on the daemon.
//
// Threading: Cancel() and cancelled() are thread-safe (an atomic flag, and the
// CallCanceller's own lock).
#ifndef KVTIER_CLIENT_PYTHON_NATIVE_PY_CANCELLER_H_
#define KVTIER_CLIENT_PYTHON_NATIVE_PY_CANCELLER_H_

#include <atomic>

#include "absl/status/status.h"

namespace kvtier::python {

class PyCanceller {
 public:
  void Cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // CancelledError once Cancel() was called, else Ok.
  absl::Status Check() const {
    return cancelled() ? absl::CancelledError("cancelled by the caller") : absl::OkStatus();
  }

 private:
  std::atomic<bool> cancelled_{false};
};

}  // namespace kvtier::python

#endif  // KVTIER_CLIENT_PYTHON_NATIVE_PY_CANCELLER_H_
