#include "server/events_reactor.h"

#include <utility>

#include "server/status_util.h"

namespace kvtier {

EventsReactor::EventsReactor(EventLog* log, const v1::EventsRequest& request,
                             uint64_t internal_ns, RpcMetrics* metrics,
                             StreamLimiter::Ticket subscription,
                             StreamLimiter::Ticket place, StillAdmitted still_admitted,
                             grpc::CallbackServerContext* ctx, StallReaper* stalls)
    : log_(log),
      ns_(internal_ns),
      public_ns_(request.namespace_id()),
      scope_(metrics, RpcMethod::kEvents),
      waker_(std::make_shared<Waker>()),
      subscription_(std::move(subscription)),
      place_(std::move(place)),
      still_admitted_(std::move(still_admitted)),
      stall_(ctx != nullptr ? stalls : nullptr, [ctx] { ctx->TryCancel(); }) {
  // A cursor from another run of the daemon (its instance id differs) says nothing
  // about this one: start from the oldest event kept, marked resync.
  const bool other_run =
      request.instance_id() != 0 && request.instance_id() != log->instance_id();
  after_ = other_run                          ? EventLog::kStaleCursor
           : request.after_sequence() == 0 ? log->last_sequence()
                                             : request.after_sequence();
  {
    absl::MutexLock lock(&waker_->mu);
    waker_->reactor = this;
  }
  // Tells the subscriber that its cursor is fixed: events from here on are its.
  StartSendInitialMetadata();
  Next();
}

void EventsReactor::Next() {
  while (true) {
    uint64_t after;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_) return;
      after = after_;
    }
    EventLog::ReadResult r = log_->Read(after, ns_, kMaxBatch);
    if (r.closed) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "events: kvtierd is shutting down; resubscribe after it restarts"));
      return;
    }
    // Before waiting as before sending: woken by any namespace's event, an idle
    // subscription of credentials the tenants file no longer admits ends then, rather
    // than hold its place until its own namespace changes.
    if (still_admitted_) {
      if (absl::Status s = still_admitted_(); !s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
    }
    if (r.events.empty() && !r.gap) {
      {
        absl::MutexLock lock(&mu_);
        after_ = r.next_after;
      }
      const uint64_t handle =
          log_->WakeAfter(r.next_after, [waker = waker_] {
            absl::MutexLock lock(&waker->mu);
            if (waker->reactor != nullptr) waker->reactor->Next();
          });
      if (handle == 0) continue;  // Events arrived (or the log closed) meanwhile.
      absl::MutexLock lock(&mu_);
      wake_handle_ = handle;
      return;
    }
    {
      // Decided in one critical section with OnCancel: a write starts only on a call
      // that is neither finished nor cancelled.
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_ || cancelled_) return;
      after_ = r.next_after;
      writing_ = true;
      batch_.Clear();
      batch_.set_instance_id(log_->instance_id());
      if (r.gap) {
        batch_.set_resync(true);
        batch_.set_resync_sequence(r.first_kept);
      }
      for (const ChunkEvent& e : r.events) {
        v1::ChunkEvent* out = batch_.add_events();
        out->set_sequence(e.sequence);
        out->set_kind(static_cast<v1::ChunkEventKind>(static_cast<int>(e.kind)));
        out->set_namespace_id(public_ns_ != 0 ? public_ns_ : e.id.ns);
        if (!(e.id.key == ChunkKey{})) out->set_key(e.id.key.ToByteString());
        out->set_tier(static_cast<v1::Tier>(static_cast<int>(e.tier)));
      }
    }
    stall_.WaitingOnClient(true);  // Until the write completes: a reader that stopped.
    StartWrite(&batch_);
    return;
  }
}

void EventsReactor::OnWriteDone(bool ok) {
  stall_.WaitingOnClient(false);
  bool cancelled;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    cancelled = cancelled_;
  }
  if (!ok || cancelled) {
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "events: the subscriber went away"));
    return;
  }
  Next();
}

void EventsReactor::OnCancel() {
  uint64_t handle = 0;
  bool writing;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    std::swap(handle, wake_handle_);
    writing = writing_;
  }
  if (handle != 0) log_->CancelWake(handle);
  // A write in flight completes first (ok or not); OnWriteDone then ends the call.
  if (!writing) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "events: cancelled"));
}

void EventsReactor::Finish(grpc::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || writing_) return;  // A write in flight: OnWriteDone finishes.
    finished_ = true;
  }
  // Free before the client sees the status.
  subscription_ = StreamLimiter::Ticket();
  place_ = StreamLimiter::Ticket();
  grpc::ServerWriteReactor<v1::EventBatch>::Finish(scope_.Done(std::move(status)));
}

void EventsReactor::OnDone() {
  stall_.Reset();  // Before the context goes.
  {
    absl::MutexLock lock(&waker_->mu);
    waker_->reactor = nullptr;
  }
  delete this;
}

}  // namespace kvtier
