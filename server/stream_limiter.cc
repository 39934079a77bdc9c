#include "server/stream_limiter.h"

#include <utility>

#include "absl/strings/str_cat.h"

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
                             const std::string& what, Naming naming)
    : max_(max_streams), naming_(std::move(naming)) {
  if (registry == nullptr) return;
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

absl::StatusOr<StreamLimiter::Ticket> StreamLimiter::TakePlace(const std::string& tenant) {
  uint32_t n = open_.load(std::memory_order_relaxed);
  do {
    if (max_ != 0 && n >= max_) {
      Refused(tenant);
      return absl::ResourceExhaustedError(absl::StrCat(
          "kvtierd has ", naming_.daemon_bound, " (", max_, ") ", naming_.noun,
          " open; retry in 100ms"));
    }
  } while (!open_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  if (open_metric_ != nullptr) open_metric_->Increment();
  return Ticket(this, tenant);
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
  open_.fetch_sub(1, std::memory_order_relaxed);
  if (open_metric_ != nullptr) open_metric_->Decrement();
}

}  // namespace kvtier
