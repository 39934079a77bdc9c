// AsyncGate: a byte budget shared by asynchronous work, admitted in arrival order without
// blocking any thread. Acquire(n, fn) runs `fn` once n bytes of the budget are the
// caller's: at once (inline) when they are free and nobody waits ahead, otherwise on the
// thread whose Release makes room. A request larger than the whole budget is admitted
// alone, when nothing else holds any, so it cannot wait forever.
//
// The tiered store bounds the buffers of streamed SSD reads with one: gRPC threads ask
// for a frame's buffer and must never wait for the SSD, or for each other.
//
// Thread-safety: thread-safe. `fn` runs without the gate's lock held; keep it short
// (the tiered store's only submits a read to its I/O threads).
#ifndef KVTIER_STORAGE_ASYNC_GATE_H_
#define KVTIER_STORAGE_ASYNC_GATE_H_

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

class AsyncGate {
 public:
  explicit AsyncGate(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  AsyncGate(const AsyncGate&) = delete;
  AsyncGate& operator=(const AsyncGate&) = delete;

  void Acquire(uint64_t bytes, std::function<void()> fn);
  // Gives back bytes taken by an earlier Acquire, and runs the waiters that now fit.
  void Release(uint64_t bytes);

  uint64_t held_bytes() const;
  size_t waiters() const;

 private:
  struct Waiter {
    uint64_t bytes;
    std::function<void()> fn;
  };
  bool FitsLocked(uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return held_ == 0 || held_ + bytes <= capacity_;
  }

  const uint64_t capacity_;
  mutable absl::Mutex mu_;
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Waiter> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_ASYNC_GATE_H_
