#include "storage/remote_health.h"

#include <algorithm>

#include "storage/log.h"

namespace kvtier {

RemoteHealth::RemoteHealth(absl::Duration min_backoff, absl::Duration max_backoff,
                           std::function<absl::Time()> now)
    : min_backoff_(min_backoff), max_backoff_(max_backoff), now_(std::move(now)),
      backoff_(min_backoff) {}

bool RemoteHealth::Allow(absl::FunctionRef<absl::Status()> probe) {
  {
    absl::MutexLock l(&mu_);
    if (!degraded_) return true;
    const absl::Time now = now_();
    if (now < next_probe_) return false;
    next_probe_ = now + backoff_;
    probing_ = true;
  }
  if (absl::Status s = probe(); !s.ok()) {
    Failed(s);
    return false;
  }
  Succeeded();
  return true;
}

bool RemoteHealth::ProbeDue() const {
  absl::MutexLock l(&mu_);
  return !degraded_ || now_() >= next_probe_;
}

void RemoteHealth::Succeeded() {
  absl::MutexLock l(&mu_);
  if (!degraded_) return;
  degraded_ = false;
  probing_ = false;
  backoff_ = min_backoff_;
  LogInfo("remote tier: reachable again; reads and writes resume");
}

void RemoteHealth::Failed(const absl::Status& why) {
  absl::MutexLock l(&mu_);
  if (!degraded_) {
    degraded_ = true;
    ++degradations_;
    backoff_ = min_backoff_;
    LogWarning("remote tier: degraded (serving from local tiers only; retrying with backoff): ",
               why.message());
  } else if (probing_) {
    backoff_ = std::min(backoff_ * 2, max_backoff_);
  } else {
    return;  // Another reply of a failure already counted.
  }
  probing_ = false;
  next_probe_ = now_() + backoff_;
}

bool RemoteHealth::degraded() const {
  absl::MutexLock l(&mu_);
  return degraded_;
}

uint64_t RemoteHealth::degradations() const {
  absl::MutexLock l(&mu_);
  return degradations_;
}

absl::Duration RemoteHealth::backoff() const {
  absl::MutexLock l(&mu_);
  return backoff_;
}

}  // namespace kvtier
