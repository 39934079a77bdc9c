#include "server/stall_reaper.h"

#include <utility>

namespace kvtier {

StallReaper::StallReaper(StallReaperOptions options) : options_(std::move(options)) {
  if (options_.registry != nullptr) {
    reaped_metric_ = &prometheus::BuildCounter()
                          .Name("kvtier_client_stalls_cancelled_total")
                          .Help("Put, Get and Prefill calls cancelled because their client "
                                "sent or read nothing for client_idle_timeout")
                          .Register(*options_.registry)
                          .Add({});
  }
  if (options_.run_thread && options_.idle > absl::ZeroDuration()) {
    thread_ = std::thread([this] { Loop(); });
  }
}

StallReaper::~StallReaper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

uint64_t StallReaper::Watch(std::function<void()> cancel) {
  if (options_.idle <= absl::ZeroDuration()) return 0;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  const uint64_t handle = next_++;
  calls_[handle] = Entry{std::move(cancel), false, false, now};
  return handle;
}

void StallReaper::SetWaitingOnClient(uint64_t handle, bool waiting) {
  if (handle == 0) return;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(handle);
  if (it == calls_.end()) return;
  it->second.waiting = waiting;
  it->second.since = now;
}

void StallReaper::Unwatch(uint64_t handle) {
  if (handle == 0) return;
  absl::MutexLock lock(&mu_);
  calls_.erase(handle);
}

int StallReaper::Sweep() {
  const absl::Time now = options_.clock();
  int n = 0;
  absl::MutexLock lock(&mu_);
  for (auto& [handle, e] : calls_) {
    if (e.waiting && !e.cancelled && now - e.since > options_.idle) {
      e.cancelled = true;
      e.cancel();
      ++n;
    }
  }
  reaped_ += n;
  if (reaped_metric_ != nullptr && n > 0) reaped_metric_->Increment(n);
  return n;
}

uint64_t StallReaper::reaped() const {
  absl::MutexLock lock(&mu_);
  return reaped_;
}

StallReaper::Watched::Watched(StallReaper* reaper, std::function<void()> cancel)
    : reaper_(reaper), handle_(reaper != nullptr ? reaper->Watch(std::move(cancel)) : 0) {}

StallReaper::Watched::Watched(Watched&& other) noexcept
    : reaper_(std::exchange(other.reaper_, nullptr)), handle_(std::exchange(other.handle_, 0)) {}

StallReaper::Watched& StallReaper::Watched::operator=(Watched&& other) noexcept {
  if (this != &other) {
    Reset();
    reaper_ = std::exchange(other.reaper_, nullptr);
    handle_ = std::exchange(other.handle_, 0);
  }
  return *this;
}

void StallReaper::Watched::WaitingOnClient(bool waiting) const {
  if (reaper_ != nullptr) reaper_->SetWaitingOnClient(handle_, waiting);
}

void StallReaper::Watched::Reset() {
  if (reaper_ != nullptr) reaper_->Unwatch(handle_);
  reaper_ = nullptr;
  handle_ = 0;
}

void StallReaper::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.period)) return;
    }
    Sweep();
  }
}

}  // namespace kvtier
