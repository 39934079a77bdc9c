#include "server/stream_limiter.h"

#include <algorithm>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace kvtier {

StreamLimiter::Ticket& StreamLimiter::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = other.owner_;
    tenant_ = std::move(other.tenant_);
    other.owner_ = nullptr;
  }
  return *this;
}

void StreamLimiter::Ticket::Release() {
  if (owner_ != nullptr) owner_->Release(tenant_);
  owner_ = nullptr;
}

StreamLimiter::StreamLimiter(uint32_t max_streams, prometheus::Registry* registry,
                             const std::string& what, Naming naming, LineOptions line)
    : max_(max_streams), naming_(std::move(naming)), line_options_(std::move(line)) {
  if (has_line() && line_options_.run_thread) expirer_ = std::thread([this] { ExpireLoop(); });
  if (registry == nullptr) return;
  if (has_line()) {
    waiting_metric_ = &prometheus::BuildGauge()
                           .Name("kvtier_" + what + "_waiting")
                           .Help("Calls waiting in line for a place among kvtier_" + what +
                                 "_open")
                           .Register(*registry)
                           .Add({});
    waited_metric_ = &prometheus::BuildCounter()
                          .Name("kvtier_" + what + "_waited_total")
                          .Help("Calls that waited in line and were given a place among "
                                "kvtier_" + what + "_open")
                          .Register(*registry)
                          .Add({});
  }
  const bool all = what == "streams";
  open_metric_ = &prometheus::BuildGauge()
                      .Name("kvtier_" + what + "_open")
                      .Help(all ? "Streaming calls (Put, Get, Prefill, Events) open now"
                                : "Calls counted by kvtier_" + what + " open now")
                      .Register(*registry)
                      .Add({});
  refused_metric_ = &prometheus::BuildCounter()
                         .Name("kvtier_" + what + "_refused_total")
                         .Help(all ? "Streaming calls answered RESOURCE_EXHAUSTED because "
                                     "max_streams were open"
                                   : "Calls answered RESOURCE_EXHAUSTED because the limit "
                                     "of kvtier_" + what + "_open was reached")
                         .Register(*registry)
                         .Add({});
  tenant_open_ = &prometheus::BuildGauge()
                      .Name("kvtier_tenant_" + what + "_open")
                      .Help("Of kvtier_" + what + "_open, a named tenant's")
                      .Register(*registry);
  tenant_refused_ = &prometheus::BuildCounter()
                         .Name("kvtier_tenant_" + what + "_refused_total")
                         .Help("Of kvtier_" + what + "_refused_total, a named tenant's (by "
                               "its own " + naming_.tenant_bound + " or the daemon's bound)")
                         .Register(*registry);
}

absl::StatusOr<StreamLimiter::Ticket> StreamLimiter::TryAcquire(const std::string& tenant,
                                                              uint32_t tenant_max) {
  if (tenant.empty()) return TakePlace(tenant);
  // The tenant's count is checked and taken under the mutex, the daemon's place inside
  // it, so that neither is taken without the other.
  absl::MutexLock lock(&mu_);
  if (tenant_max != 0) {
    auto it = by_tenant_.find(tenant);
    if (it != by_tenant_.end() && it->second >= tenant_max) {
      Refused(tenant);
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant ", tenant, " has its ", naming_.tenant_bound, " (", tenant_max, ") ",
          naming_.noun, " open; retry in 100ms"));
    }
  }
  absl::StatusOr<Ticket> place = TakePlace(tenant);
  if (place.ok()) {
    ++by_tenant_[tenant];
    if (tenant_open_ != nullptr) tenant_open_->Add({{"tenant", tenant}}).Increment();
  }
  return place;
}

bool StreamLimiter::TakeFreePlace() {
  uint32_t n = open_.load(std::memory_order_relaxed);
  do {
    if (max_ != 0 && n >= max_) return false;
  } while (!open_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  if (open_metric_ != nullptr) open_metric_->Increment();
  return true;
}

absl::StatusOr<StreamLimiter::Ticket> StreamLimiter::TakePlace(const std::string& tenant) {
  if (!TakeFreePlace()) {
    Refused(tenant);
    return absl::ResourceExhaustedError(absl::StrCat(
        "kvtierd has ", naming_.daemon_bound, " (", max_, ") ", naming_.noun,
        " open; retry in 100ms"));
  }
  return Ticket(this, tenant);
}

StreamLimiter::~StreamLimiter() {
  // Nobody waits: a waiter waits for a ticket, and every ticket is gone by now.
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    line_changed_.SignalAll();
  }
  if (expirer_.joinable()) expirer_.join();
}

absl::StatusOr<std::optional<StreamLimiter::Ticket>> StreamLimiter::TryAcquireOrWait(
    Waiter* waiter) {
  if (!has_line()) {
    absl::StatusOr<Ticket> place = TakePlace("");
    if (!place.ok()) return place.status();
    return std::optional<Ticket>(*std::move(place));
  }
  absl::MutexLock lock(&mu_);
  // Places are given back under mu_ while anyone waits, so an empty line with every
  // place taken stays so until this waiter is in it.
  if (line_.empty() && TakeFreePlace()) return std::optional<Ticket>(Ticket(this, ""));
  if (line_.size() >= line_options_.max_waiting) {
    Refused("");
    return absl::ResourceExhaustedError(absl::StrCat(
        "kvtierd has ", naming_.daemon_bound, " (", max_, ") ", naming_.noun, " open and ",
        line_.size(), " waiting, all ", naming_.line_bound, " allows; retry in 100ms"));
  }
  if (line_.empty()) line_changed_.Signal();
  line_.push_back({waiter, line_options_.clock() + line_options_.max_wait});
  if (waiting_metric_ != nullptr) waiting_metric_->Increment();
  return std::optional<Ticket>();
}

bool StreamLimiter::Leave(Waiter* waiter) {
  absl::MutexLock lock(&mu_);
  for (auto it = line_.begin(); it != line_.end(); ++it) {
    if (it->waiter != waiter) continue;
    line_.erase(it);
    if (waiting_metric_ != nullptr) waiting_metric_->Decrement();
    return true;
  }
  return false;
}

int StreamLimiter::ExpireWaits() {
  std::vector<Waiter*> expired;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = line_options_.clock();
    while (!line_.empty() && line_.front().deadline <= now) {
      expired.push_back(line_.front().waiter);
      line_.pop_front();
      if (waiting_metric_ != nullptr) waiting_metric_->Decrement();
      Refused("");
    }
  }
  for (Waiter* w : expired) {
    w->WaitRefused(absl::ResourceExhaustedError(absl::StrCat(
        "waited ", absl::FormatDuration(line_options_.max_wait), " (", naming_.wait_bound,
        ") in line and no place came free among ", naming_.daemon_bound, " (", max_, ") ",
        naming_.noun, "; retry in 100ms")));
  }
  return static_cast<int>(expired.size());
}

void StreamLimiter::ExpireLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      if (line_.empty()) {
        line_changed_.Wait(&mu_);
        continue;
      }
      // The front's deadline by the clock, waited for in real time (the thread runs
      // only with the real clock).
      const absl::Duration left = line_.front().deadline - line_options_.clock();
      if (left > absl::ZeroDuration() && !line_changed_.WaitWithTimeout(&mu_, left)) continue;
      if (stop_) return;
    }
    ExpireWaits();
  }
}

uint32_t StreamLimiter::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(line_.size());
}

bool StreamLimiter::Plentiful() const {
  if (max_ == 0) return true;
  // Defensive: a place given back goes to the line's first waiter, so a line means no
  // place is free, which the count below says too.
  if (has_line() && waiting() != 0) return false;
  const uint32_t open = open_.load(std::memory_order_relaxed);
  const uint32_t free = open >= max_ ? 0 : max_ - open;
  return free >= std::max<uint32_t>(2, (max_ + 3) / 4);
}

uint32_t StreamLimiter::open(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = by_tenant_.find(tenant);
  return it == by_tenant_.end() ? 0 : it->second;
}

void StreamLimiter::Refused(const std::string& tenant) {
  if (refused_metric_ != nullptr) refused_metric_->Increment();
  if (!tenant.empty() && tenant_refused_ != nullptr) {
    tenant_refused_->Add({{"tenant", tenant}}).Increment();
  }
}

void StreamLimiter::Release(const std::string& tenant) {
  if (!tenant.empty()) {
    absl::MutexLock lock(&mu_);
    auto it = by_tenant_.find(tenant);
    if (it != by_tenant_.end() && --it->second == 0) by_tenant_.erase(it);
    if (tenant_open_ != nullptr) tenant_open_->Add({{"tenant", tenant}}).Decrement();
  }
  if (has_line()) {
    Waiter* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (line_.empty()) {
        open_.fetch_sub(1, std::memory_order_relaxed);
      } else {
        next = line_.front().waiter;  // The place passes on; open_ stays.
        line_.pop_front();
        if (waiting_metric_ != nullptr) waiting_metric_->Decrement();
      }
    }
    if (next != nullptr) {
      if (waited_metric_ != nullptr) waited_metric_->Increment();
      next->PlaceGranted(Ticket(this, ""));
      return;
    }
  } else {
    open_.fetch_sub(1, std::memory_order_relaxed);
  }
  if (open_metric_ != nullptr) open_metric_->Decrement();
}

}  // namespace kvtier
