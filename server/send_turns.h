// SendTurns: bounds how many Get calls send chunk bytes from the RAM pool at once
// (option get_send_turns); the others wait their turn, first come first served.
//
// Why: every byte a RAM Get sends is copied by the kernel from the pool into a socket
// buffer, then by the client out of it. With a few streams sending, those buffers are
// still in the CPU's cache when the client reads them; with 64 streams sending at once,
// each holding megabytes in flight, they are not, and every byte costs both ends more
// CPU (64 clients of 32 MiB chunks: 2.9-3.0 GB/s against 3.2-3.3 with 4, on one
// machine; 4 of 64 sending at a time: 3.33, as 4 clients; bench/RESULTS.md). Taking
// turns also halves the mean wait of a crowd: a chunk is sent whole in a short time
// instead of all chunks slowly together.
//
// A turn lasts one chunk (one item of a Get: a whole chunk, or one layer of one in
// layer-major order), from its first frame's write to its last frame's write done; then
// the call gives it back and, if others wait, goes behind them. A holder whose write has
// waited for longer than yield_after while others wait gives its turn up and sends the
// rest of its chunk without one: its client, or the link to it, sets its pace, not the
// daemon's CPUs (a 4 MiB frame takes a few milliseconds on loopback or a 25 Gb/s link),
// so it gains nothing from a turn and the line would only slow it down. A client that
// stops reading thus delays the others by yield_after, not client_idle_timeout, and a
// slow one is not made slower. Header-only frames, chunks streamed from SSD (paced by
// the reads) and region copies take no turn.
//
// Thread-safety: thread-safe. A waiter is told on whichever thread gave a turn back (or
// the sweeping thread), never under this object's lock; callers may hold their own lock
// around Take and Leave, never around Give or Sweep (which may call a waiter).
#ifndef KVTIER_SERVER_SEND_TURNS_H_
#define KVTIER_SERVER_SEND_TURNS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
}  // namespace prometheus

namespace kvtier {

struct SendTurnsOptions {
  uint32_t turns = 4;  // Calls sending at once; 0: no bound (Take always succeeds).
  // A holder whose write waits this long while others wait gives its turn up for the
  // rest of its chunk; zero: never.
  absl::Duration yield_after = absl::Milliseconds(20);
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  bool run_thread = true;  // False: turns are taken back only by Sweep (tests).
  // Gets kvtier_get_send_turns_waiting, kvtier_get_send_turns_waited_total and
  // kvtier_get_send_turns_yielded_total; may be null.
  prometheus::Registry* registry = nullptr;
};

class SendTurns {
 public:
  class Waiter {
   public:
    virtual ~Waiter() = default;
    // `this` holds a turn now. Called once per wait unless Leave took the waiter out.
    virtual void TurnGranted() = 0;
  };

  explicit SendTurns(SendTurnsOptions options);
  ~SendTurns();
  SendTurns(const SendTurns&) = delete;
  SendTurns& operator=(const SendTurns&) = delete;

  // `w` is about to write a frame. True: it holds a turn (it had one, or one was free),
  // and its write counts as started now, or it gave its turn up for the rest of its
  // chunk. False: it joined the line; TurnGranted follows.
  bool Take(Waiter* w);
  // The write `w` started is done (a no-op if `w` holds no turn).
  void WriteDone(Waiter* w);
  // `w` is done with its chunk: it gives its turn back (a no-op if it holds none), and
  // the line's first waiter gets it and is told on this thread.
  void Give(Waiter* w);
  // Takes `w` out of the line. True: it was waiting, and nothing will be called on it.
  bool Leave(Waiter* w);
  // Takes turns from holders whose write has waited longer than yield_after, the longest
  // first and no more than wait (each sends the rest of its chunk without one), and hands
  // them to the line. Returns how many.
  int Sweep();

  uint32_t waiting() const;
  uint32_t holding() const;
  uint64_t yielded() const;
  uint32_t turns() const { return options_.turns; }

 private:
  struct Holder {
    bool writing = false;
    absl::Time since;  // When the write started.
  };
  // Hands free turns to the line's first waiters; returns those to tell.
  std::vector<Waiter*> GrantLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const SendTurnsOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Waiter*, Holder> holders_ ABSL_GUARDED_BY(mu_);
  // Those that gave their turn up, until their chunk is sent (Give).
  absl::flat_hash_set<Waiter*> unmetered_ ABSL_GUARDED_BY(mu_);
  std::deque<Waiter*> line_ ABSL_GUARDED_BY(mu_);
  uint64_t yielded_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  prometheus::Gauge* waiting_metric_ = nullptr;
  prometheus::Counter* waited_metric_ = nullptr;
  prometheus::Counter* yielded_metric_ = nullptr;
  std::thread thread_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SEND_TURNS_H_
