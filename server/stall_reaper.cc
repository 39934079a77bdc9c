#include "server/stall_reaper.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace kvtier {

StallReaper::StallReaper(StallReaperOptions options) : options_(std::move(options)) {
  if (options_.registry != nullptr) {
    reaped_metric_ = &prometheus::BuildCounter()
                          .Name("kvtier_client_stalls_cancelled_total")
                          .Help("Put, Get and Prefill calls cancelled because their client "
                                "sent or read nothing for client_idle_timeout")
                          .Register(*options_.registry)
                          .Add({});
    reclaimed_metric_ = &prometheus::BuildCounter()
                             .Name("kvtier_put_places_reclaimed_total")
                             .Help("Put streams cancelled because they sent nothing for "
                                   "put_place_idle while other Puts waited in line for a "
                                   "place (also in kvtier_client_stalls_cancelled_total)")
                             .Register(*options_.registry)
                             .Add({});
  }
  if (options_.run_thread && Reaps()) {
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

bool StallReaper::Reaps() const {
  return options_.idle > absl::ZeroDuration() ||
         (options_.contended_idle > absl::ZeroDuration() && options_.waiting_for_place);
}

uint64_t StallReaper::Watch(std::function<void()> cancel, bool contendable) {
  if (!Reaps()) return 0;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  const uint64_t handle = next_++;
  calls_[handle] = Entry{std::move(cancel), contendable, false, false, now};
  return handle;
}

void StallReaper::SetWaitingOnClient(uint64_t handle, bool waiting, uint64_t frame_bytes) {
  if (handle == 0) return;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(handle);
  if (it == calls_.end()) return;
  Entry& e = it->second;
  if (e.contendable && e.waiting && !waiting && !e.cancelled &&
      frame_bytes * 4 >= options_.full_frame_bytes) {
    // A frame came: the time it took feeds the recent gap between frames.
    const absl::Duration gap = now - e.since;
    frame_gap_ = frame_gap_ == absl::ZeroDuration()
                     ? gap
                     : frame_gap_ + (gap - frame_gap_) / kFrameGapWeight;
  }
  e.waiting = waiting;
  e.since = now;
}

absl::Duration StallReaper::ContendedBound() const {
  absl::MutexLock lock(&mu_);
  return ContendedBoundLocked();
}

absl::Duration StallReaper::ContendedBoundLocked() const {
  return std::min(std::max(options_.contended_idle, kSlowFrameFactor * frame_gap_),
                  kMaxBoundFactor * options_.contended_idle);
}

void StallReaper::Unwatch(uint64_t handle) {
  if (handle == 0) return;
  absl::MutexLock lock(&mu_);
  calls_.erase(handle);
}

int StallReaper::Sweep() {
  const absl::Time now = options_.clock();
  const bool idle_on = options_.idle > absl::ZeroDuration();
  int n = 0;
  absl::MutexLock lock(&mu_);
  // Asked under the lock, so that a reclaimed holder still watched (counted on its way
  // below) has not yet handed its place to a waiter counted here: a holder gives its place
  // back before its call ends and it is unwatched. The line never calls into the reaper
  // with its own lock held.
  const uint32_t waiting_for_place =
      options_.contended_idle > absl::ZeroDuration() && options_.waiting_for_place
          ? options_.waiting_for_place()
          : 0;
  const absl::Duration contended_bound = ContendedBoundLocked();
  uint32_t on_their_way = 0;  // Contended places whose holders are cancelled already.
  std::vector<std::pair<absl::Time, Entry*>> idle_holders;
  for (auto& [handle, e] : calls_) {
    if (!e.cancelled && e.waiting && idle_on && now - e.since > options_.idle) {
      e.cancelled = true;
      e.cancel();
      ++n;
    }
    if (!e.contendable) continue;
    if (e.cancelled) {
      ++on_their_way;
    } else if (waiting_for_place > 0 && e.waiting && now - e.since > contended_bound) {
      idle_holders.emplace_back(e.since, &e);
    }
  }
  int reclaimed = 0;
  if (waiting_for_place > on_their_way && !idle_holders.empty()) {
    const size_t take = std::min<size_t>(waiting_for_place - on_their_way, idle_holders.size());
    std::partial_sort(idle_holders.begin(), idle_holders.begin() + take, idle_holders.end(),
                      [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < take; ++i) {
      idle_holders[i].second->cancelled = true;
      idle_holders[i].second->cancel();
      ++reclaimed;
    }
  }
  n += reclaimed;
  reaped_ += n;
  reclaimed_ += reclaimed;
  if (reaped_metric_ != nullptr && n > 0) reaped_metric_->Increment(n);
  if (reclaimed_metric_ != nullptr && reclaimed > 0) reclaimed_metric_->Increment(reclaimed);
  return n;
}

uint64_t StallReaper::reaped() const {
  absl::MutexLock lock(&mu_);
  return reaped_;
}

uint64_t StallReaper::reclaimed() const {
  absl::MutexLock lock(&mu_);
  return reclaimed_;
}

StallReaper::Watched::Watched(StallReaper* reaper, std::function<void()> cancel,
                              bool contendable)
    : reaper_(reaper),
      handle_(reaper != nullptr ? reaper->Watch(std::move(cancel), contendable) : 0) {}

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

void StallReaper::Watched::WaitingOnClient(bool waiting, uint64_t frame_bytes) const {
  if (reaper_ != nullptr) reaper_->SetWaitingOnClient(handle_, waiting, frame_bytes);
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
