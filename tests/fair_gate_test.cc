// FairGate::EnterUnless: a waiter that gives up leaves the line, and its turn passes to
// the next in line; a holder's Enter and TryEnter never wait for an abandoned ticket.
#include "storage/fair_gate.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

// Polls a condition the gate exposes (bounded; nothing to wait on).
bool WaitForWaiting(const FairGate& gate, uint64_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (gate.waiting() != n) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST(FairGateCancelTest, AWaiterThatGivesUpPassesItsTurnOn) {
  FairGate gate(1);
  gate.Enter();  // The one place, held.
  std::atomic<bool> give_up{false};
  std::atomic<int> b_result{-1};
  std::thread b([&] {
    b_result = gate.EnterUnless([&] { return give_up.load(); }, absl::Milliseconds(1)) ? 1 : 0;
  });
  ASSERT_TRUE(WaitForWaiting(gate, 1));
  absl::Notification c_entered;
  std::thread c([&] {
    gate.Enter();  // Behind b.
    c_entered.Notify();
  });
  ASSERT_TRUE(WaitForWaiting(gate, 2));
  give_up = true;
  b.join();
  EXPECT_EQ(b_result.load(), 0);
  EXPECT_EQ(gate.waiting(), 1u);  // c only.
  EXPECT_FALSE(c_entered.HasBeenNotified());  // The place is still held.
  gate.Leave();
  ASSERT_TRUE(c_entered.WaitForNotificationWithTimeout(absl::Seconds(30)))
      << "c waits for the ticket b abandoned";
  EXPECT_EQ(gate.waiting(), 0u);
  EXPECT_FALSE(gate.TryEnter());  // c holds the place.
  gate.Leave();
  c.join();
  EXPECT_TRUE(gate.TryEnter());  // No one in line: the abandoned ticket is not waited for.
  gate.Leave();
}

TEST(FairGateCancelTest, AWaiterNotCalledOffEntersInTurn) {
  FairGate gate(1);
  gate.Enter();
  std::atomic<int> result{-1};
  std::thread b([&] { result = gate.EnterUnless([] { return false; }, absl::Milliseconds(1)) ? 1 : 0; });
  ASSERT_TRUE(WaitForWaiting(gate, 1));
  gate.Leave();
  b.join();
  EXPECT_EQ(result.load(), 1);
  EXPECT_FALSE(gate.TryEnter());
  gate.Leave();
  EXPECT_TRUE(gate.TryEnter());
  gate.Leave();
}

}  // namespace
}  // namespace kvtier
