#include "storage/event_log.h"

#include <algorithm>
#include <utility>

namespace kvtier {

EventLog::EventLog(size_t capacity, uint64_t instance_id)
    : capacity_(std::max<size_t>(1, capacity)),
      instance_id_(instance_id),
      ring_(capacity_),
      notifier_([this] { Notify(); }) {}

EventLog::~EventLog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  notifier_.join();
}

void EventLog::Append(ChunkEventKind kind, const ChunkId& id, Tier tier) {
  absl::MutexLock lock(&mu_);
  ++last_;
  ring_[(last_ - 1) % ring_.size()] = ChunkEvent{last_, kind, id, tier};
  ReadyAllLocked();
}

void EventLog::ReadyAllLocked() {
  for (auto& [handle, wake] : wakes_) ready_.push_back(std::move(wake));
  wakes_.clear();
}

void EventLog::Notify() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](EventLog* log) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return log->stopping_ || !log->ready_.empty();
        },
        this));
    if (stopping_) return;
    std::vector<std::function<void()>> run;
    run.swap(ready_);
    mu_.Unlock();
    for (auto& wake : run) wake();
    mu_.Lock();
  }
}

EventLog::ReadResult EventLog::Read(uint64_t after, uint64_t ns, size_t max) const {
  ReadResult out;
  absl::MutexLock lock(&mu_);
  out.closed = closed_;
  const uint64_t first_kept = last_ > ring_.size() ? last_ - ring_.size() + 1 : 1;
  out.first_kept = first_kept;
  if (after > last_) {
    // A cursor from another run of the daemon: what it saw says nothing about now.
    out.gap = true;
    after = first_kept - 1;
  } else if (after + 1 < first_kept) {
    out.gap = true;
    after = first_kept - 1;
  }
  uint64_t s = after + 1;
  for (; s <= last_ && out.events.size() < max; ++s) {
    const ChunkEvent& e = ring_[(s - 1) % ring_.size()];
    if (ns == 0 || e.id.ns == ns) out.events.push_back(e);
  }
  out.next_after = s - 1;
  return out;
}

uint64_t EventLog::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

uint64_t EventLog::WakeAfter(uint64_t after, std::function<void()> wake) {
  absl::MutexLock lock(&mu_);
  if (last_ > after || closed_) return 0;
  const uint64_t handle = ++next_wake_;
  wakes_.emplace(handle, std::move(wake));
  return handle;
}

void EventLog::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  ReadyAllLocked();
}

bool EventLog::CancelWake(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  return wakes_.erase(handle) > 0;
}

}  // namespace kvtier
