// Prefetcher: runs a queue of chunk fetches (the hint window's chunks that sit only on
// SSD) on its own threads, nearest first, one chunk per thread at a time. Replace()
// swaps in a new queue: what a scheduler no longer expects is not fetched. Kept apart
// from the store's read threads so that prefetching never delays a request's read.
//
// Thread-safety: every method is thread-safe. `fetch` runs on the prefetch threads and
// must not call back into this object.
#ifndef KVTIER_STORAGE_PREFETCHER_H_
#define KVTIER_STORAGE_PREFETCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "storage/chunk_id.h"

namespace kvtier {

class Prefetcher {
 public:
  Prefetcher(int threads, std::function<void(const ChunkId&)> fetch);
  // Drops what is queued, waits for fetches in progress, joins the threads.
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Replaces the queue (nearest first).
  void Replace(std::vector<ChunkId> queue);
  // Drops the queue and waits until no fetch runs; later Replace calls do nothing.
  void Stop();
  // Waits until the queue is empty and no fetch runs (tests, benchmarks).
  void WaitIdle();
  uint64_t fetched() const;  // Fetches run since start.
  size_t queued() const;

 private:
  void Loop();

  const std::function<void(const ChunkId&)> fetch_;
  mutable absl::Mutex mu_;
  std::deque<ChunkId> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fetched_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // Last: started after the state above exists.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PREFETCHER_H_
