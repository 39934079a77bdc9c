// CallCancellation: cancels, from any thread, the RPCs that KvTierClient calls make on
// another thread. The calling thread opens a Scope around its call; each RPC the client
// then starts is watched (Watch) for the Scope's life, and Cancel() cancels every watched
// RPC through its gRPC context, at once, even one waiting on a daemon that does not
// answer. An RPC started after Cancel() is cancelled as it starts. The call returns
// Cancelled.
//
//   CallCancellation cancel;            // Shared with whoever may cancel.
//   {
//     CallCancellation::Scope scope(&cancel);
//     client->GetInto(...);             // Another thread: cancel.Cancel().
//   }
//
// Thread-safety: Cancel() and cancelled() from any thread. Scopes nest per thread (the
// innermost counts). A Watch must be destroyed before its context.
#ifndef KVTIER_CLIENT_CALL_CANCELLATION_H_
#define KVTIER_CLIENT_CALL_CANCELLATION_H_

#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class ClientContext;
}

namespace kvtier {

class CallCancellation {
 public:
  CallCancellation() = default;
  CallCancellation(const CallCancellation&) = delete;
  CallCancellation& operator=(const CallCancellation&) = delete;

  void Cancel();
  bool cancelled() const;
  // Whether a call under a Scope of this one is waiting on something Cancel() would end
  // (an RPC, a region request): for tests that cancel a call mid-wait.
  bool watching() const;
  // Whether this thread's open Scope, if any, has been cancelled.
  static bool CurrentCancelled();

  // While alive, the RPCs this thread's client calls start can be cancelled by `c`
  // (null: none; an outer Scope is hidden either way).
  class Scope {
   public:
    explicit Scope(CallCancellation* c);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CallCancellation* const outer_;
  };

  // For the client: while alive, a Cancel() of this thread's open Scope, if any, runs
  // `on_cancel` (at once if cancelled already). It runs on the cancelling thread, under
  // the cancellation's lock, so it must be quick and must not call back in.
  class Hook {
   public:
    explicit Hook(std::function<void()> on_cancel);
    ~Hook();
    Hook(const Hook&) = delete;
    Hook& operator=(const Hook&) = delete;

   private:
    CallCancellation* const cancellation_;
  };

  // A Hook that cancels the RPC of `ctx` through its context.
  class Watch {
   public:
    explicit Watch(grpc::ClientContext* ctx);

   private:
    Hook hook_;
  };

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::pair<const Hook*, std::function<void()>>> hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_CALL_CANCELLATION_H_
