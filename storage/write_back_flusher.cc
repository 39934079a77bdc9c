#include "storage/write_back_flusher.h"

#include <utility>

#include "absl/time/time.h"

namespace kvtier {

WriteBackFlusher::WriteBackFlusher(int threads, std::function<bool()> flush_one,
                                   std::function<void()> after_pass)
    : flush_one_(std::move(flush_one)), after_pass_(std::move(after_pass)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { Loop(i == 0); });
}

void WriteBackFlusher::Notify() {
  absl::MutexLock lock(&mu_);
  ++generation_;
}

void WriteBackFlusher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void WriteBackFlusher::Loop(bool first) {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      // Wakes on new dirty chunks, at stop, and every second to retry failed writes.
      const auto wake = [this, &seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || generation_ != seen;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Seconds(1));
      if (stopping_) return;
      seen = generation_;
    }
    while (flush_one_()) {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;  // After the current chunk, as Stop promises.
    }
    if (first && after_pass_) after_pass_();
  }
}

}  // namespace kvtier
