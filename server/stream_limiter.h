// StreamLimiter: bounds the streaming calls (Put, Get, Prefill, Events) the daemon holds
// open at once (option max_streams). Each costs buffers, a reactor or a thread; past the
// bound a new stream is answered RESOURCE_EXHAUSTED with a retry hint at once, instead
// of queueing without bound. Unary calls (Lookup, health) are not counted, so they keep
// answering under a flood of streams.
//
// A tenant may also have a bound of its own (max_streams in the tenants file), so that
// one tenant cannot take every place: its streams count against both.
//
// Thread-safety: thread-safe; a Ticket is released on the thread that destroys it.
#ifndef KVTIER_SERVER_STREAM_LIMITER_H_
#define KVTIER_SERVER_STREAM_LIMITER_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
template <typename T>
class Family;
}  // namespace prometheus

namespace kvtier {

// How a StreamLimiter's refusals name what it counts: "kvtierd has <daemon_bound> (N)
// <noun> open" and "tenant T has its <tenant_bound> (N) <noun> open".
struct StreamLimiterNaming {
  std::string daemon_bound = "max_streams";
  std::string tenant_bound = "max_streams";
  std::string noun = "streaming calls";
};

class StreamLimiter {
 public:
  // A held place; gives it back when destroyed. Empty (default) tickets hold nothing.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept
        : owner_(other.owner_), tenant_(std::move(other.tenant_)) {
      other.owner_ = nullptr;
    }
    Ticket& operator=(Ticket&& other) noexcept;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { Release(); }

   private:
    friend class StreamLimiter;
    Ticket(StreamLimiter* owner, std::string tenant)
        : owner_(owner), tenant_(std::move(tenant)) {}
    void Release();
    StreamLimiter* owner_ = nullptr;
    std::string tenant_;  // "" for the implicit tenant, which is not counted apart.
  };

  // `max_streams` 0: unbounded. `registry` (may be null) gets kvtier_<what>_open and
  // kvtier_<what>_refused_total (`what` names the streams counted, "streams" for all of
  // them, "put_streams" for puts), and per named tenant kvtier_tenant_<what>_open and
  // kvtier_tenant_<what>_refused_total{tenant}. Must outlive every ticket.
  using Naming = StreamLimiterNaming;
  StreamLimiter(uint32_t max_streams, prometheus::Registry* registry,
                const std::string& what = "streams", Naming naming = Naming());

  // A place for a stream of `tenant` ("" for the implicit tenant), which may hold at
  // most `tenant_max` at once (0: no bound of its own). Returns: Ok, ResourceExhausted
  // naming the bound that refused (counted as refused).
  absl::StatusOr<Ticket> TryAcquire(const std::string& tenant = "", uint32_t tenant_max = 0);

  uint32_t open() const { return open_.load(std::memory_order_relaxed); }
  uint32_t open(const std::string& tenant) const;
  uint32_t max_streams() const { return max_; }

 private:
  // The daemon-wide place alone.
  absl::StatusOr<Ticket> TakePlace(const std::string& tenant);
  void Release(const std::string& tenant);
  void Refused(const std::string& tenant);

  const uint32_t max_;
  const Naming naming_;
  std::atomic<uint32_t> open_{0};
  mutable absl::Mutex mu_;
  // Named tenants' open streams; a tenant leaves the map when it has none.
  absl::flat_hash_map<std::string, uint32_t> by_tenant_ ABSL_GUARDED_BY(mu_);
  prometheus::Gauge* open_metric_ = nullptr;
  prometheus::Counter* refused_metric_ = nullptr;
  prometheus::Family<prometheus::Gauge>* tenant_open_ = nullptr;
  prometheus::Family<prometheus::Counter>* tenant_refused_ = nullptr;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_STREAM_LIMITER_H_
