// WriteBackFlusher: the background threads that write dirty RAM chunks to SSD in
// write-back mode. Each sleeps until Notify() reports new dirty chunks (or a second has
// passed, to retry writes that failed), then calls `flush_one` until it returns false
// (nothing left to take). Several threads run at once so that several chunks are on
// their way to the SSD together (the SSD tier batches them into its device writes). The
// first thread also calls `after_pass` after each pass (the SSD tier's TTL expiry).
//
// Thread-safety: Notify and Stop are thread-safe. `flush_one` runs on every flusher
// thread at once and must be thread-safe.
#ifndef KVTIER_STORAGE_WRITE_BACK_FLUSHER_H_
#define KVTIER_STORAGE_WRITE_BACK_FLUSHER_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

class WriteBackFlusher {
 public:
  WriteBackFlusher(int threads, std::function<bool()> flush_one,
                   std::function<void()> after_pass);
  ~WriteBackFlusher() { Stop(); }
  WriteBackFlusher(const WriteBackFlusher&) = delete;
  WriteBackFlusher& operator=(const WriteBackFlusher&) = delete;

  // New dirty chunks: every sleeping flusher wakes.
  void Notify();
  // Stops the threads after their current chunk and joins them. Idempotent.
  void Stop();

 private:
  void Loop(bool first);

  const std::function<bool()> flush_one_;
  const std::function<void()> after_pass_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Bumped by Notify: a flusher that has not seen the latest value wakes.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;  // Last: started after the state above exists.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_WRITE_BACK_FLUSHER_H_
