#include "server/send_turns.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace kvtier {

SendTurns::SendTurns(SendTurnsOptions options) : options_(std::move(options)) {
  if (options_.registry != nullptr) {
    waiting_metric_ = &prometheus::BuildGauge()
                           .Name("kvtier_get_send_turns_waiting")
                           .Help("Get calls waiting for a turn to send RAM chunk bytes "
                                 "(get_send_turns)")
                           .Register(*options_.registry)
                           .Add({});
    waited_metric_ = &prometheus::BuildCounter()
                          .Name("kvtier_get_send_turns_waited_total")
                          .Help("Chunks whose Get waited for a turn before sending them")
                          .Register(*options_.registry)
                          .Add({});
    yielded_metric_ = &prometheus::BuildCounter()
                           .Name("kvtier_get_send_turns_yielded_total")
                           .Help("Turns given up by Gets whose frame write waited longer "
                                 "than the yield time while others waited (each sent the "
                                 "rest of its chunk without one)")
                           .Register(*options_.registry)
                           .Add({});
  }
  if (options_.run_thread && options_.turns != 0 && options_.yield_after > absl::ZeroDuration()) {
    thread_ = std::thread([this] { Loop(); });
  }
}

SendTurns::~SendTurns() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool SendTurns::Take(Waiter* w) {
  if (options_.turns == 0) return true;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  if (unmetered_.contains(w)) return true;
  auto it = holders_.find(w);
  if (it == holders_.end() && holders_.size() < options_.turns && line_.empty()) {
    it = holders_.emplace(w, Holder{}).first;
  }
  if (it != holders_.end()) {
    it->second = Holder{true, now};
    return true;
  }
  if (std::find(line_.begin(), line_.end(), w) == line_.end()) {
    line_.push_back(w);
    if (waited_metric_ != nullptr) waited_metric_->Increment();
    if (waiting_metric_ != nullptr) waiting_metric_->Set(static_cast<double>(line_.size()));
  }
  return false;
}

void SendTurns::WriteDone(Waiter* w) {
  if (options_.turns == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = holders_.find(w);
  if (it != holders_.end()) it->second.writing = false;
}

std::vector<SendTurns::Waiter*> SendTurns::GrantLocked() {
  std::vector<Waiter*> granted;
  while (!line_.empty() && holders_.size() < options_.turns) {
    Waiter* next = line_.front();
    line_.pop_front();
    holders_.emplace(next, Holder{false, options_.clock()});
    granted.push_back(next);
  }
  if (waiting_metric_ != nullptr) waiting_metric_->Set(static_cast<double>(line_.size()));
  return granted;
}

void SendTurns::Give(Waiter* w) {
  if (options_.turns == 0) return;
  std::vector<Waiter*> granted;
  {
    absl::MutexLock lock(&mu_);
    if (unmetered_.erase(w) != 0 || holders_.erase(w) == 0) return;
    granted = GrantLocked();
  }
  for (Waiter* next : granted) next->TurnGranted();
}

bool SendTurns::Leave(Waiter* w) {
  if (options_.turns == 0) return false;
  absl::MutexLock lock(&mu_);
  auto it = std::find(line_.begin(), line_.end(), w);
  if (it == line_.end()) return false;
  line_.erase(it);
  if (waiting_metric_ != nullptr) waiting_metric_->Set(static_cast<double>(line_.size()));
  return true;
}

int SendTurns::Sweep() {
  if (options_.turns == 0 || options_.yield_after <= absl::ZeroDuration()) return 0;
  const absl::Time now = options_.clock();
  std::vector<Waiter*> granted;
  {
    absl::MutexLock lock(&mu_);
    if (line_.empty()) return 0;
    std::vector<std::pair<absl::Time, Waiter*>> quiet;
    for (const auto& [w, h] : holders_) {
      if (h.writing && now - h.since > options_.yield_after) quiet.emplace_back(h.since, w);
    }
    const size_t take = std::min(quiet.size(), line_.size());
    std::partial_sort(quiet.begin(), quiet.begin() + take, quiet.end(),
                      [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < take; ++i) {
      holders_.erase(quiet[i].second);
      unmetered_.insert(quiet[i].second);
    }
    yielded_ += take;
    if (yielded_metric_ != nullptr && take > 0) yielded_metric_->Increment(static_cast<double>(take));
    granted = GrantLocked();
  }
  for (Waiter* next : granted) next->TurnGranted();
  return static_cast<int>(granted.size());
}

uint32_t SendTurns::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(line_.size());
}

uint32_t SendTurns::holding() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(holders_.size());
}

uint64_t SendTurns::yielded() const {
  absl::MutexLock lock(&mu_);
  return yielded_;
}

void SendTurns::Loop() {
  const absl::Duration period = std::max(options_.yield_after / 2, absl::Milliseconds(1));
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), period)) return;
    }
    Sweep();
  }
}

}  // namespace kvtier
