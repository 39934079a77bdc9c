// StreamLimiter: bounds the streaming calls (Put, Get, Prefill, Events) the daemon holds
// open at once (option max_streams). Each costs buffers, a reactor or a thread; past the
// bound a new stream is answered RESOURCE_EXHAUSTED with a retry hint at once, instead
// of queueing without bound. Unary calls (Lookup, health) are not counted, so they keep
// answering under a flood of streams.
//
// Thread-safety: thread-safe; a Ticket is released on the thread that destroys it.
#ifndef KVTIER_SERVER_STREAM_LIMITER_H_
#define KVTIER_SERVER_STREAM_LIMITER_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

namespace prometheus {
class Registry;
class Counter;
class Gauge;
}  // namespace prometheus

namespace kvtier {

class StreamLimiter {
 public:
  // A held place; gives it back when destroyed. Empty (default) tickets hold nothing.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept : owner_(other.owner_) { other.owner_ = nullptr; }
    Ticket& operator=(Ticket&& other) noexcept;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { Release(); }

   private:
    friend class StreamLimiter;
    explicit Ticket(StreamLimiter* owner) : owner_(owner) {}
    void Release();
    StreamLimiter* owner_ = nullptr;
  };

  // `max_streams` 0: unbounded. `registry` (may be null) gets kvtier_<what>_open and
  // kvtier_<what>_refused_total (`what` names the streams counted, "streams" for all of
  // them, "put_streams" for puts). Must outlive every ticket.
  StreamLimiter(uint32_t max_streams, prometheus::Registry* registry,
                const std::string& what = "streams");

  // A place, or nullopt when max_streams are open (counted as refused).
  std::optional<Ticket> TryAcquire();

  uint32_t open() const { return open_.load(std::memory_order_relaxed); }
  uint32_t max_streams() const { return max_; }

 private:
  void Release();

  const uint32_t max_;
  std::atomic<uint32_t> open_{0};
  prometheus::Gauge* open_metric_ = nullptr;
  prometheus::Counter* refused_metric_ = nullptr;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_STREAM_LIMITER_H_
