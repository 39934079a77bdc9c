#include "server/stream_limiter.h"

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace kvtier {

StreamLimiter::Ticket& StreamLimiter::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = other.owner_;
    other.owner_ = nullptr;
  }
  return *this;
}

void StreamLimiter::Ticket::Release() {
  if (owner_ != nullptr) owner_->Release();
  owner_ = nullptr;
}

StreamLimiter::StreamLimiter(uint32_t max_streams, prometheus::Registry* registry,
                             const std::string& what)
    : max_(max_streams) {
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
}

std::optional<StreamLimiter::Ticket> StreamLimiter::TryAcquire() {
  uint32_t n = open_.load(std::memory_order_relaxed);
  do {
    if (max_ != 0 && n >= max_) {
      if (refused_metric_ != nullptr) refused_metric_->Increment();
      return std::nullopt;
    }
  } while (!open_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  if (open_metric_ != nullptr) open_metric_->Increment();
  return Ticket(this);
}

void StreamLimiter::Release() {
  open_.fetch_sub(1, std::memory_order_relaxed);
  if (open_metric_ != nullptr) open_metric_->Decrement();
}

}  // namespace kvtier
