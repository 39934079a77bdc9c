// Prefetcher: fetches nearest first, a new queue supersedes what was not started, Stop
// drops the queue and waits for the fetch in progress. Fetches block on notifications
// the test controls; nothing sleeps.
#include "storage/prefetcher.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace kvtier {
namespace {

ChunkId Id(uint64_t n) { return ChunkId{1, ChunkKey{n, n}}; }

// A fetch that records its chunk, then waits until the test releases it.
class GatedFetch {
 public:
  void operator()(const ChunkId& id) {
    {
      absl::MutexLock lock(&mu_);
      started_.push_back(id);
    }
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](GatedFetch* f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f->released_ >= f->started_.size(); },
        this));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    ++released_;
  }
  void ReleaseAll() {
    absl::MutexLock lock(&mu_);
    released_ = 1 << 30;
  }
  // Waits until `n` fetches have started; returns them.
  std::vector<ChunkId> WaitStarted(size_t n) {
    std::pair<GatedFetch*, size_t> arg(this, n);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::pair<GatedFetch*, size_t>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return a->first->started_.size() >= a->second;
        },
        &arg));
    return started_;
  }

 private:
  absl::Mutex mu_;
  std::vector<ChunkId> started_ ABSL_GUARDED_BY(mu_);
  size_t released_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(Prefetcher, FetchesNearestFirstAndANewQueueSupersedesTheOld) {
  GatedFetch gate;
  Prefetcher p(1, [&](const ChunkId& id) { gate(id); });
  p.Replace({Id(1), Id(2), Id(3)});
  EXPECT_EQ(gate.WaitStarted(1), std::vector<ChunkId>{Id(1)});
  // While 1 is being fetched, the scheduler's queue moves on: 2 and 3 are not wanted.
  p.Replace({Id(7), Id(8)});
  EXPECT_EQ(p.queued(), 2u);
  gate.Release();
  EXPECT_EQ(gate.WaitStarted(2), (std::vector<ChunkId>{Id(1), Id(7)}));
  gate.ReleaseAll();
  p.WaitIdle();
  EXPECT_EQ(gate.WaitStarted(3), (std::vector<ChunkId>{Id(1), Id(7), Id(8)}));
  EXPECT_EQ(p.fetched(), 3u);
  EXPECT_EQ(p.queued(), 0u);
}

TEST(Prefetcher, StopDropsTheQueueWaitsForTheFetchInProgressAndIgnoresLaterQueues) {
  GatedFetch gate;
  Prefetcher p(1, [&](const ChunkId& id) { gate(id); });
  p.Replace({Id(1), Id(2), Id(3)});
  gate.WaitStarted(1);
  absl::Notification stopped;
  std::thread stopper([&] {
    p.Stop();
    stopped.Notify();
  });
  // Stop clears the queue at once, then waits for fetch 1, which the gate holds.
  while (p.queued() != 0) std::this_thread::yield();
  EXPECT_FALSE(stopped.HasBeenNotified());
  gate.ReleaseAll();
  stopper.join();
  EXPECT_EQ(p.fetched(), 1u);  // 2 and 3 were dropped.
  p.Replace({Id(9)});
  EXPECT_EQ(p.queued(), 0u);
}

}  // namespace
}  // namespace kvtier
