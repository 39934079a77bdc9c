// EventsReactor: one Events subscriber. Sends the daemon's chunk events (EventLog) in
// batches, one batch in flight at a time, and parks on the log when it has caught up.
// The subscriber's only state is its cursor, so a slow reader costs no memory: when the
// ring has overwritten what it had not read yet, its next batch carries a resync marker.
// Ends when the client cancels, or UNAVAILABLE once the log is closed at shutdown.
// A write in flight always completes before the call finishes; nothing is written after
// a cancel.
//
// Thread-safety: gRPC calls the reactor's methods; the log's wake-up arrives on its
// notifier thread and reaches the reactor through a small shared state, so it cannot
// touch a reactor that is gone.
#ifndef KVTIER_SERVER_EVENTS_REACTOR_H_
#define KVTIER_SERVER_EVENTS_REACTOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/authenticator.h"
#include "server/rpc_metrics.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "storage/event_log.h"

namespace kvtier {

class EventsReactor final : public grpc::ServerWriteReactor<v1::EventBatch> {
 public:
  static constexpr size_t kMaxBatch = 512;  // Events per batch.

  // `log` must outlive the call. Starts at the request's cursor (0: from now on).
  // `internal_ns` is the store's id of the request's namespace (the caller's tenant
  // maps it; 0: all namespaces); events go out under the id the client named.
  // `subscription`: the call's place among the Events subscribers (the daemon's and its
  // tenant's share); `place`: its place among max_streams. Both are given back as the
  // call finishes, before the client sees its status (the reactor's before it can be
  // woken, and finished, on another thread).
  // `still_admitted` (may be empty) is asked before each batch whether the caller's
  // credentials still admit it; an error ends the call with it. `stalls` (may be null;
  // with `ctx`, must outlive the call) cancels a subscription whose client reads
  // nothing: a batch's write held back by flow control past its idle time. A
  // subscription waiting for events is not idle.
  EventsReactor(EventLog* log, const v1::EventsRequest& request, uint64_t internal_ns,
                RpcMetrics* metrics, StreamLimiter::Ticket subscription,
                StreamLimiter::Ticket place = {}, StillAdmitted still_admitted = nullptr,
                grpc::CallbackServerContext* ctx = nullptr, StallReaper* stalls = nullptr);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  // Keeps the call's place among max_streams until the call is done.

 private:
  // What the log's wake-up needs; outlives the reactor if a wake-up is in flight.
  struct Waker {
    absl::Mutex mu;
    EventsReactor* reactor ABSL_GUARDED_BY(mu);
  };

  // Sends the next batch, or parks on the log when there is none.
  void Next();
  void Finish(grpc::Status status);

  EventLog* const log_;
  const uint64_t ns_;         // Store id filtered on (0: all).
  const uint64_t public_ns_;  // What the client called it (0: all).
  RpcMetrics::Scope scope_;
  std::shared_ptr<Waker> waker_;

  absl::Mutex mu_;
  uint64_t after_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t wake_handle_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  v1::EventBatch batch_;  // Owned by gRPC between StartWrite and OnWriteDone.
  // Among the subscribers and among max_streams; given back as the call finishes,
  // before the client can see its status, so that a client's next call finds them free.
  StreamLimiter::Ticket subscription_;
  StreamLimiter::Ticket place_;
  StillAdmitted still_admitted_;  // Called on the threads that run Next().
  StallReaper::Watched stall_;    // Waiting on the client while a write is in flight.
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_EVENTS_REACTOR_H_
