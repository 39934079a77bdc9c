#include "storage/prefetcher.h"

#include <utility>

namespace kvtier {

Prefetcher::Prefetcher(int threads, std::function<void(const ChunkId&)> fetch)
    : fetch_(std::move(fetch)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

Prefetcher::~Prefetcher() {
  Stop();
  for (std::thread& t : threads_) t.join();
}

void Prefetcher::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  queue_.clear();
  mu_.Await(absl::Condition(
      +[](int* running) { return *running == 0; }, &running_));
}

void Prefetcher::Replace(std::vector<ChunkId> queue) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  queue_.assign(queue.begin(), queue.end());
}

void Prefetcher::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Prefetcher* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return p->queue_.empty() && p->running_ == 0;
      },
      this));
}

uint64_t Prefetcher::fetched() const {
  absl::MutexLock lock(&mu_);
  return fetched_;
}

size_t Prefetcher::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void Prefetcher::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](Prefetcher* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return p->stopping_ || !p->queue_.empty();
        },
        this));
    if (stopping_) return;
    const ChunkId id = queue_.front();
    queue_.pop_front();
    ++running_;
    mu_.Unlock();
    fetch_(id);
    mu_.Lock();
    --running_;
    ++fetched_;
  }
}

}  // namespace kvtier
