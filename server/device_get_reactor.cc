#include "server/device_get_reactor.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/status_util.h"

namespace kvtier {

DeviceGetReactor::DeviceGetReactor(grpc::CallbackServerContext* ctx, const v1::GetRequest& req,
                                   TieredStore* store, RpcMetrics* metrics, LeaseTable* leases,
                                   RegionTable* regions, uint64_t max_frame_bytes,
                                   uint32_t max_keys, StreamLimiter::Ticket place,
                                   StallReaper* stalls, StillAdmitted still_admitted)
    : ctx_(ctx),
      store_(store),
      scope_(metrics, RpcMethod::kGet),
      place_(std::move(place)),
      stall_(stalls, [ctx] { ctx->TryCancel(); }),
      still_admitted_(std::move(still_admitted)) {
  absl::Status s = Start(req, leases, regions, max_frame_bytes, max_keys);
  {
    absl::MutexLock lock(&mu_);
    error_ = s;
    results_.resize(plan_.items.size());
    enqueued_.resize(plan_.items.size());
    found_.assign(plan_.ids.size(), false);
    pins_.resize(plan_.ids.size());
    events_lent_ = record_events_;
  }
  Pump();
}

absl::Status DeviceGetReactor::Start(const v1::GetRequest& req, LeaseTable* leases,
                                     RegionTable* regions, uint64_t max_frame_bytes,
                                     uint32_t max_keys) {
  auto plan = StartGet(store_, &req, max_frame_bytes, max_keys);
  if (!plan.ok()) return plan.status();
  if (!store_->has_gpu()) {
    return absl::FailedPreconditionError("target: this daemon has no GPU");
  }
  auto target = ResolveDeviceTarget(regions, req.target(), plan->ids.size(), plan->KeyBytes());
  if (!target.ok()) return target.status();
  if (req.target().record_events()) {
    if (absl::Status s = CheckEventCount(req.target(), plan->items.size(), *target->region);
        !s.ok()) {
      return s;
    }
    if (!target->region->TakeEvents()) {
      return absl::AbortedError(absl::StrCat(
          "target.record_events: region ", req.target().region_id(),
          "'s events are in use by another Get; retry once it has ended"));
    }
    record_events_ = true;
  }
  plan_ = *std::move(plan);
  target_ = *std::move(target);
  TakeLease(leases, req, &lease_hold_);
  remote_ahead_ = store_->FetchRemoteAsync(plan_.ids);
  return absl::OkStatus();
}

void DeviceGetReactor::Pump() {
  std::vector<std::pair<size_t, bool>> issue;  // Items, and whether to check the CRC32C.
  bool write = false, finish = false, write_and_finish = false;
  absl::Status finish_status;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (error_.ok() && ctx_->IsCancelled()) error_ = absl::CancelledError("get cancelled");
    // An item's frame is ready once it landed (or failed), or, with record_events, once
    // its copies are queued.
    auto ready = [this](size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return results_[i].has_value() || enqueued_[i].has_value();
    };
    // Issue, then skip the frames of keys absent in the first pass, until neither moves:
    // skipped items count in the window, so skipping can make room to issue more (once,
    // ten layers of a missing key left the last item unissued with nothing in flight to
    // pump again, and the call hung).
    for (;;) {
      if (error_.ok()) {
        // With record_events frames go out before the copies land: copies_ bounds them.
        while (next_issue_ < plan_.items.size() && next_issue_ - next_write_ < kWindow &&
               copies_ < static_cast<int>(kWindow)) {
          const size_t i = next_issue_;
          if (FirstItemOfKey(i) && still_admitted_) {
            // Credentials revoked by a tenants file reloaded while the call ran end it
            // before its next chunk.
            error_ = still_admitted_();
            if (!error_.ok()) break;
          }
          if (!FirstItemOfKey(i)) {
            // A later pass: only for keys the first pass found (layer-major items are
            // pass by pass, so key k's first item is item k).
            const uint32_t key = plan_.items[i].key;
            if (!FirstPassTier(key).has_value() && !results_[key].has_value()) {
              break;  // Not known yet: wait for it.
            }
            if (!found_[key]) {
              results_[i] = absl::NotFoundError("absent");  // Skipped, never copied.
              ++next_issue_;
              continue;
            }
          }
          // A key's later layers (layer-major) come from the chunk its first pass read
          // from the host and checked: held in RAM since (OnDelivered), or, read from SSD
          // into a buffer without promotion, checked by the SSD read itself each time. Its
          // whole-chunk CRC32C is not checked again for each layer on the host. After a
          // first pass from staging it is. (A later pass runs only for found keys.)
          const uint32_t key = plan_.items[i].key;
          const bool check = FirstItemOfKey(i) || *FirstPassTier(key) == Tier::kGpu;
          issue.emplace_back(next_issue_++, check);
          ++in_flight_;
          ++copies_;
        }
      }
      const size_t skipped_from = next_write_;
      // Later-pass items of keys absent in the first pass get no frame.
      while (!writing_ && error_.ok() && next_write_ < results_.size() && ready(next_write_) &&
             !FirstItemOfKey(next_write_) && !found_[plan_.items[next_write_].key]) {
        ++next_write_;
      }
      if (next_write_ == skipped_from) break;
    }
    if (!writing_ && error_.ok() && next_write_ < results_.size() &&
        !enqueued_[next_write_].has_value() && results_[next_write_].has_value() &&
        !FirstItemOfKey(next_write_) && !results_[next_write_]->ok()) {
      // Found in the first pass (the loop above skipped the others), gone now: the
      // stream cannot stay consistent.
      error_ = absl::AbortedError(absl::StrCat(
          "keys[", plan_.items[next_write_].key, "]: the chunk left the cache during this "
          "Get (evicted, deleted, or stored afresh with other bytes); retry"));
    }
    if (!writing_ && error_.ok() && next_write_ < results_.size() && ready(next_write_)) {
      const size_t i = next_write_++;
      // Queued with its event (in flight), else landed or failed.
      const absl::StatusOr<Tier> r =
          enqueued_[i].has_value() ? absl::StatusOr<Tier>(*enqueued_[i]) : *results_[i];
      const GetPlan::Item& item = plan_.items[i];
      v1::GetFrame frame;
      frame.set_key_index(item.key);
      frame.set_last(true);
      if (plan_.layer_major) frame.set_layer(item.begin);
      if (r.ok()) {
        if (record_events_) {
          frame.set_in_flight(true);
          frame.set_event_index(static_cast<uint32_t>(i));
        }
        frame.set_found(true);
        frame.set_total_bytes(plan_.layer_bytes * (item.end - item.begin));
        // A chunk fetched ahead from the shared tier into RAM came from there.
        const bool ahead = item.key < remote_ahead_.size() && remote_ahead_[item.key];
        frame.set_tier(*r == Tier::kRam && ahead
                           ? v1::TIER_REMOTE
                           : static_cast<v1::Tier>(static_cast<int>(*r)));
      }
      const std::string bytes = frame.SerializeAsString();
      grpc::Slice slice(bytes);
      frame_ = grpc::ByteBuffer(&slice, 1);
      writing_ = write = true;
      // The last frame, every copy landed: it goes with the call's status, saving the
      // client a round of the event loop (OnWriteDone, then Finish).
      if (next_write_ == plan_.items.size() && copies_ == 0 && issue.empty()) {
        finished_ = write_and_finish = true;
        ReturnEvents();
      }
    }
    // The end: every frame written, or an error; either way only once no copy is still
    // writing into the worker's memory (which it may reuse as soon as the call ends).
    if (!writing_ && copies_ == 0 && (!error_.ok() || next_write_ == plan_.items.size())) {
      finished_ = finish = true;
      finish_status = error_;
      ReturnEvents();
    }
  }
  for (const auto& [i, check] : issue) {
    const GetPlan::Item& item = plan_.items[i];
    const DevicePtr key_dst = target_.dest[item.key];
    std::vector<TieredStore::DeviceRange> ranges{
        {item.begin * plan_.layer_bytes, (item.end - item.begin) * plan_.layer_bytes,
         key_dst + (item.begin - plan_.first_layer) * plan_.layer_bytes,
         record_events_ ? target_.region->events()[i] : 0}};
    std::function<void(Tier)> enqueued;
    if (record_events_) enqueued = [this, i = i](Tier from) { OnEnqueued(i, from); };
    store_->ReadToDeviceAsync(
        plan_.ids[item.key], std::move(ranges),
        [this, i = i](absl::StatusOr<Tier> r) { OnDelivered(i, std::move(r)); }, check,
        std::move(enqueued), &pins_[item.key]);
  }
  if (write_and_finish) {
    stall_.WaitingOnClient(true);  // Until OnDone: a client that stops reading is reaped.
    place_ = StreamLimiter::Ticket();
    StartWriteAndFinish(&frame_, grpc::WriteOptions(), scope_.Done(grpc::Status::OK));
  } else if (write) {
    stall_.WaitingOnClient(true);
    StartWrite(&frame_);
  }
  if (finish) {
    place_ = StreamLimiter::Ticket();  // Free before the client sees the status.
    Finish(scope_.Done(ToGrpcStatus(finish_status)));
  }
}

void DeviceGetReactor::OnEnqueued(size_t item, Tier from) {
  const uint32_t key = plan_.items[item].key;
  const bool first = FirstItemOfKey(item);
  // Later passes start now, reading the chunk from RAM unchecked: hold it from here.
  std::optional<ChunkView> hold;
  if (first && plan_.layer_major) hold = store_->HoldInRam(plan_.ids[key]);
  {
    absl::MutexLock lock(&mu_);
    enqueued_[item] = from;
    if (first) found_[key] = true;
    if (hold) held_.push_back(*std::move(hold));
  }
  // Runs before the item's OnDelivered (TieredStore::ReadToDeviceAsync), which is what
  // keeps the reactor alive here.
  Pump();
}

std::optional<Tier> DeviceGetReactor::FirstPassTier(uint32_t key) const {
  if (results_[key].has_value() && results_[key]->ok()) return **results_[key];
  return enqueued_[key];
}

void DeviceGetReactor::ReturnEvents() {
  if (!events_lent_) return;
  events_lent_ = false;
  target_.region->ReturnEvents();
}

bool DeviceGetReactor::FirstItemOfKey(size_t item) const {
  return !plan_.layer_major || plan_.items[item].begin == plan_.first_layer;
}

void DeviceGetReactor::OnDelivered(size_t item, absl::StatusOr<Tier> result) {
  const uint32_t key = plan_.items[item].key;
  const bool first = FirstItemOfKey(item);
  // A chunk found by its first pass is held in RAM for the later ones (with
  // record_events, since it was queued: OnEnqueued).
  std::optional<ChunkView> hold;
  if (first && result.ok() && plan_.layer_major && !record_events_) {
    hold = store_->HoldInRam(plan_.ids[key]);
  }
  {
    absl::MutexLock lock(&mu_);
    --copies_;
    if (first && result.ok()) found_[key] = true;
    if (hold) held_.push_back(*std::move(hold));
    // Absent is no error, but an item whose frame already said "in flight" that fails
    // in any way is: the worker was told to wait for bytes that did not land.
    const bool sent = enqueued_[item].has_value();
    if (!result.ok() && (sent || !absl::IsNotFound(result.status())) && error_.ok()) {
      error_ = absl::Status(result.status().code(),
                            absl::StrCat("keys[", key, "]: ", result.status().message()));
    }
    results_[item] = std::move(result);
  }
  Pump();
  // Counted out only after its last use of the reactor: OnDone (which may run as soon
  // as Pump has finished the call) deletes it only once no callback is left.
  bool last;
  {
    absl::MutexLock lock(&mu_);
    last = --in_flight_ == 0 && done_;
  }
  if (last) delete this;
}

void DeviceGetReactor::OnCancel() {
  // A call waiting on nothing in flight (no write, no copy) learns of it only here.
  Pump();
}

void DeviceGetReactor::OnWriteDone(bool ok) {
  stall_.WaitingOnClient(false);
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && error_.ok()) error_ = absl::CancelledError("client went away");
  }
  Pump();
}

void DeviceGetReactor::OnDone() {
  stall_.Reset();  // Before the context goes; deliveries may still be completing.
  bool last;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    last = in_flight_ == 0;
    ReturnEvents();  // Finishing returned them; a call that ended otherwise does here.
  }
  if (last) delete this;
}

}  // namespace kvtier
