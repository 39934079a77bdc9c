#include "storage/async_gate.h"

#include <utility>
#include <vector>

namespace kvtier {

void AsyncGate::Acquire(uint64_t bytes, std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (!waiting_.empty() || !FitsLocked(bytes)) {
      waiting_.push_back(Waiter{bytes, std::move(fn)});
      return;
    }
    held_ += bytes;
  }
  fn();
}

void AsyncGate::Release(uint64_t bytes) {
  std::vector<std::function<void()>> admitted;
  {
    absl::MutexLock lock(&mu_);
    held_ -= bytes;
    while (!waiting_.empty() && FitsLocked(waiting_.front().bytes)) {
      held_ += waiting_.front().bytes;
      admitted.push_back(std::move(waiting_.front().fn));
      waiting_.pop_front();
    }
  }
  for (auto& fn : admitted) fn();
}

uint64_t AsyncGate::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

size_t AsyncGate::waiters() const {
  absl::MutexLock lock(&mu_);
  return waiting_.size();
}

}  // namespace kvtier
