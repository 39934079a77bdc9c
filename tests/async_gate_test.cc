// AsyncGate: byte budget, arrival order, oversized requests, and that nothing waits on a
// thread.
#include "storage/async_gate.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(AsyncGateTest, RunsInlineWithinTheBudgetAndQueuesBeyondIt) {
  AsyncGate gate(10);
  std::vector<int> ran;
  gate.Acquire(4, [&] { ran.push_back(1); });
  gate.Acquire(6, [&] { ran.push_back(2); });
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));  // Inline: the budget had room.
  EXPECT_EQ(gate.held_bytes(), 10u);
  gate.Acquire(1, [&] { ran.push_back(3); });
  EXPECT_EQ(ran.size(), 2u);  // Queued, and this thread was not blocked.
  EXPECT_EQ(gate.waiters(), 1u);
  gate.Release(4);
  EXPECT_EQ(ran, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(gate.held_bytes(), 7u);
  EXPECT_EQ(gate.waiters(), 0u);
}

TEST(AsyncGateTest, AdmitsInArrivalOrderEvenWhenALaterRequestWouldFit) {
  AsyncGate gate(10);
  std::vector<int> ran;
  gate.Acquire(8, [&] { ran.push_back(0); });
  gate.Acquire(5, [&] { ran.push_back(1); });  // Does not fit: waits.
  gate.Acquire(1, [&] { ran.push_back(2); });  // Would fit, but must not overtake.
  EXPECT_EQ(ran, (std::vector<int>{0}));
  gate.Release(8);  // Both fit now, in order.
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(gate.held_bytes(), 6u);
}

TEST(AsyncGateTest, OversizedRequestRunsAloneWhenTheGateIsEmpty) {
  AsyncGate gate(10);
  bool big = false, small = false;
  gate.Acquire(3, [] {});
  gate.Acquire(25, [&] { big = true; });
  gate.Acquire(1, [&] { small = true; });
  EXPECT_FALSE(big);
  gate.Release(3);
  EXPECT_TRUE(big);     // Alone: nothing else held.
  EXPECT_FALSE(small);  // Behind it.
  gate.Release(25);
  EXPECT_TRUE(small);
  EXPECT_EQ(gate.held_bytes(), 1u);
}

TEST(AsyncGateTest, ConcurrentUseNeverExceedsTheBudget) {
  // Each thread asks for a byte, waits until it is admitted (possibly on another
  // thread's Release), holds it briefly and gives it back.
  AsyncGate gate(3);
  std::atomic<int> inside{0}, peak{0}, ran{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        std::atomic<bool> admitted{false};
        gate.Acquire(1, [&] {
          const int now = ++inside;
          int p = peak.load();
          while (now > p && !peak.compare_exchange_weak(p, now)) {
          }
          admitted = true;
        });
        while (!admitted.load()) std::this_thread::yield();
        ++ran;
        --inside;
        gate.Release(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ran.load(), 8 * 500);
  EXPECT_LE(peak.load(), 3);
  EXPECT_EQ(gate.held_bytes(), 0u);
  EXPECT_EQ(gate.waiters(), 0u);
}

}  // namespace
}  // namespace kvtier
