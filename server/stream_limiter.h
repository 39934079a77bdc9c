// StreamLimiter: bounds the streaming calls (Put, Get, Prefill, Events) the daemon holds
// open at once (option max_streams). Each costs buffers, a reactor or a thread; past the
// bound a new stream is answered RESOURCE_EXHAUSTED with a retry hint at once, instead
// of queueing without bound. Unary calls (Lookup, health) are not counted, so they keep
// answering under a flood of streams.
//
// A tenant may also have a bound of its own (max_streams in the tenants file), so that
// one tenant cannot take every place: its streams count against both.
//
// A limiter may also keep a line (LineOptions::max_waiting > 0): a caller that finds
// every place taken waits in it, first come first served, and a place given back goes
// straight to the line's first waiter instead of to whoever asks next. Waiters hold no
// thread: each is told on whichever thread freed its place, or, past max_wait, by the
// limiter's own thread, which refuses it RESOURCE_EXHAUSTED with a retry hint. The line
// is bounded too; past it a caller is refused at once. The daemon puts its Put streams
// in such a line: refused puts backing off left places idle between one stream's end
// and the next retry (64 clients of 2 MiB write-through puts, 10 places: 0.77 GB/s
// against 1.15 with every stream admitted; bench/RESULTS.md).
//
// Thread-safety: thread-safe; a Ticket is released on the thread that destroys it, and
// a Waiter is told on that thread (or the limiter's), never under the limiter's lock.
#ifndef KVTIER_SERVER_STREAM_LIMITER_H_
#define KVTIER_SERVER_STREAM_LIMITER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "storage/steady_now.h"

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
  // The line's options, as a refusal from it names them.
  std::string line_bound = "its line";
  std::string wait_bound = "its wait";
};

struct StreamLineOptions {
  uint32_t max_waiting = 0;  // 0: no line (TryAcquireOrWait refuses as TryAcquire does).
  absl::Duration max_wait = absl::Seconds(5);  // A waiter is refused after this long.
  std::function<absl::Time()> clock = SteadyNow;  // Monotonic (see SteadyNow).
  bool run_thread = true;  // False: waits expire only through ExpireWaits (tests).
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

  // One that waits in the line. Exactly one of the two is called, once, unless Leave
  // took the waiter out first; never under the limiter's lock.
  class Waiter {
   public:
    virtual ~Waiter() = default;
    virtual void PlaceGranted(Ticket place) = 0;
    // ResourceExhausted: waited max_wait.
    virtual void WaitRefused(absl::Status refusal) = 0;
  };

  // `max_streams` 0: unbounded. `registry` (may be null) gets kvtier_<what>_open and
  // kvtier_<what>_refused_total (`what` names the streams counted, "streams" for all of
  // them, "put_streams" for puts), and per named tenant kvtier_tenant_<what>_open and
  // kvtier_tenant_<what>_refused_total{tenant}; with a line, kvtier_<what>_waiting and
  // kvtier_<what>_waited_total too. Must outlive every ticket and every waiter's wait.
  using Naming = StreamLimiterNaming;
  using LineOptions = StreamLineOptions;
  StreamLimiter(uint32_t max_streams, prometheus::Registry* registry,
                const std::string& what = "streams", Naming naming = Naming(),
                LineOptions line = LineOptions());
  ~StreamLimiter();
  StreamLimiter(const StreamLimiter&) = delete;
  StreamLimiter& operator=(const StreamLimiter&) = delete;

  // A place for a stream of `tenant` ("" for the implicit tenant), which may hold at
  // most `tenant_max` at once (0: no bound of its own). Returns: Ok, ResourceExhausted
  // naming the bound that refused (counted as refused).
  absl::StatusOr<Ticket> TryAcquire(const std::string& tenant = "", uint32_t tenant_max = 0);

  // A daemon-wide place now (a Ticket), or `waiter` joins the line (nullopt: its
  // PlaceGranted or WaitRefused follows), or ResourceExhausted when the line is full
  // (counted as refused). Tenants are not counted apart.
  absl::StatusOr<std::optional<Ticket>> TryAcquireOrWait(Waiter* waiter);
  // Takes `waiter` out of the line. True: it was waiting and nothing will be called on
  // it. False: it was not (its place was granted or refused, perhaps being told now).
  bool Leave(Waiter* waiter);
  // Refuses every waiter whose max_wait has passed (by the clock); returns how many.
  int ExpireWaits();
  uint32_t waiting() const;

  uint32_t open() const { return open_.load(std::memory_order_relaxed); }
  uint32_t open(const std::string& tenant) const;
  uint32_t max_streams() const { return max_; }
  // Whether places are plentiful now: no bound, or nobody waiting in the line and at
  // least a quarter of the places (and at least 2) free. The daemon tells Put clients
  // so on each Put's trailers (kvtier-put-places), and they skip waiting for a Put's
  // headers while it holds.
  bool Plentiful() const;

 private:
  // Counts a daemon-wide place as taken if one is free (no refusal counted).
  bool TakeFreePlace();
  // The daemon-wide place alone.
  absl::StatusOr<Ticket> TakePlace(const std::string& tenant);
  void Release(const std::string& tenant);
  void Refused(const std::string& tenant);
  bool has_line() const { return line_options_.max_waiting != 0; }
  void ExpireLoop();

  struct InLine {
    Waiter* waiter;
    absl::Time deadline;
  };

  const uint32_t max_;
  const Naming naming_;
  const LineOptions line_options_;
  std::atomic<uint32_t> open_{0};
  mutable absl::Mutex mu_;
  // Named tenants' open streams; a tenant leaves the map when it has none.
  absl::flat_hash_map<std::string, uint32_t> by_tenant_ ABSL_GUARDED_BY(mu_);
  // With a line, places are given back under mu_, so that one is never freed while
  // someone waits for it; deadlines ascend from the front (one max_wait for all).
  std::deque<InLine> line_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar line_changed_;
  prometheus::Gauge* waiting_metric_ = nullptr;
  prometheus::Counter* waited_metric_ = nullptr;
  prometheus::Gauge* open_metric_ = nullptr;
  prometheus::Counter* refused_metric_ = nullptr;
  prometheus::Family<prometheus::Gauge>* tenant_open_ = nullptr;
  prometheus::Family<prometheus::Counter>* tenant_refused_ = nullptr;
  std::thread expirer_;  // With a line and run_thread: runs ExpireLoop.
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_STREAM_LIMITER_H_
