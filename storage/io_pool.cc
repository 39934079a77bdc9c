#include "storage/io_pool.h"

namespace kvtier {

IoPool::IoPool(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Loop(); });
}

IoPool::~IoPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void IoPool::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

bool IoPool::TrySubmit(std::function<void()> task, size_t max_waiting) {
  absl::MutexLock lock(&mu_);
  if (tasks_.size() >= max_waiting) return false;
  tasks_.push_back(std::move(task));
  return true;
}

size_t IoPool::waiting() {
  absl::MutexLock lock(&mu_);
  return tasks_.size();
}

void IoPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !tasks_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // Stopping, and nothing left to run.
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace kvtier
