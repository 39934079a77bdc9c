#include "server/events_reactor.h"

#include <utility>

namespace kvtier {

EventsReactor::EventsReactor(EventLog* log, const v1::EventsRequest& request,
                             RpcMetrics* metrics, std::shared_ptr<std::atomic<int>> subscribers)
    : log_(log),
      ns_(request.namespace_id()),
      scope_(metrics, RpcMethod::kEvents),
      subscribers_(std::move(subscribers)),
      waker_(std::make_shared<Waker>()),
      after_(request.after_sequence() == 0 ? log->last_sequence() : request.after_sequence()) {
  {
    absl::MutexLock lock(&waker_->mu);
    waker_->reactor = this;
  }
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
      if (handle == 0) continue;  // Events arrived meanwhile.
      absl::MutexLock lock(&mu_);
      wake_handle_ = handle;
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_) return;
      after_ = r.next_after;
      writing_ = true;
      batch_.Clear();
      if (r.gap) {
        batch_.set_resync(true);
        batch_.set_resync_sequence(r.first_kept);
      }
      for (const ChunkEvent& e : r.events) {
        v1::ChunkEvent* out = batch_.add_events();
        out->set_sequence(e.sequence);
        out->set_kind(static_cast<v1::ChunkEventKind>(static_cast<int>(e.kind)));
        out->set_namespace_id(e.id.ns);
        if (!(e.id.key == ChunkKey{})) out->set_key(e.id.key.ToByteString());
        out->set_tier(static_cast<v1::Tier>(static_cast<int>(e.tier)));
      }
    }
    StartWrite(&batch_);
    return;
  }
}

void EventsReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
  }
  if (!ok) {
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "events: the subscriber went away"));
    return;
  }
  Next();
}

void EventsReactor::OnCancel() {
  uint64_t handle = 0;
  bool writing = false;
  {
    absl::MutexLock lock(&mu_);
    std::swap(handle, wake_handle_);
    writing = writing_;
  }
  if (handle != 0) log_->CancelWake(handle);
  // A write in flight finishes (not ok) first; OnWriteDone then ends the call.
  if (!writing) {
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "events: cancelled"));
  }
}

void EventsReactor::Finish(grpc::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
  }
  grpc::ServerWriteReactor<v1::EventBatch>::Finish(scope_.Done(std::move(status)));
}

void EventsReactor::OnDone() {
  {
    absl::MutexLock lock(&waker_->mu);
    waker_->reactor = nullptr;
  }
  subscribers_->fetch_sub(1);
  delete this;
}

}  // namespace kvtier
