// IoPool: a fixed set of threads running submitted tasks in FIFO order. The SSD tier
// uses one to read a chunk's segments in parallel (keeping several reads in flight, as
// an SSD wants), and the tiered store one to run whole-chunk SSD reads off gRPC's
// callback threads.
//
// Thread-safety: Submit is thread-safe. Tasks must not wait on tasks of the same pool.
#ifndef KVTIER_STORAGE_IO_POOL_H_
#define KVTIER_STORAGE_IO_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

class IoPool {
 public:
  explicit IoPool(int threads);
  // Runs the tasks already submitted, then joins the threads.
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  void Submit(std::function<void()> task);
  // Submits `task` unless `max_waiting` tasks already wait for a thread; returns
  // whether it did.
  bool TrySubmit(std::function<void()> task, size_t max_waiting);
  int size() const { return static_cast<int>(threads_.size()); }
  // Tasks submitted and not yet started.
  size_t waiting() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // Last: started after the state above exists.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_IO_POOL_H_
