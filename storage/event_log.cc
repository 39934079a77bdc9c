#include "storage/event_log.h"

#include <algorithm>
#include <utility>

namespace kvtier {

EventLog::EventLog(size_t capacity, uint64_t instance_id)
    : capacity_(std::max<size_t>(1, capacity)), instance_id_(instance_id), ring_(capacity_) {}

void EventLog::Append(ChunkEventKind kind, const ChunkId& id, Tier tier) {
  absl::flat_hash_map<uint64_t, std::function<void()>> wakes;
  {
    absl::MutexLock lock(&mu_);
    ++last_;
    ring_[(last_ - 1) % ring_.size()] = ChunkEvent{last_, kind, id, tier};
    wakes.swap(wakes_);
  }
  for (auto& [handle, wake] : wakes) wake();
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
  absl::flat_hash_map<uint64_t, std::function<void()>> wakes;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    wakes.swap(wakes_);
  }
  for (auto& [handle, wake] : wakes) wake();
}

bool EventLog::CancelWake(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  return wakes_.erase(handle) > 0;
}

}  // namespace kvtier
