// SendTurns with a fake clock: turns up to the bound, then a line served in arrival
// order; a waiter that leaves is never told; a holder whose write waits past
// yield_after gives its turn up for the rest of its chunk, but only while others wait,
// no more of them than wait, the longest first, and never between writes.
#include "server/send_turns.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

// A waiter that records the order turns reach it in.
struct Recorder : SendTurns::Waiter {
  Recorder(std::vector<Recorder*>* log, const char* name) : log(log), name(name) {}
  void TurnGranted() override { log->push_back(this); }
  std::vector<Recorder*>* log;
  const char* name;
};

class SendTurnsTest : public ::testing::Test {
 protected:
  std::unique_ptr<SendTurns> Make(uint32_t turns) {
    SendTurnsOptions o;
    o.turns = turns;
    o.yield_after = absl::Milliseconds(100);
    o.clock = clock_.AsFunction();
    o.run_thread = false;
    return std::make_unique<SendTurns>(o);
  }
  testing::FakeClock clock_;
  std::vector<Recorder*> granted_;
  Recorder a_{&granted_, "a"}, b_{&granted_, "b"}, c_{&granted_, "c"}, d_{&granted_, "d"};
};

TEST_F(SendTurnsTest, TurnsUpToTheBoundThenALineInArrivalOrder) {
  auto turns = Make(2);
  EXPECT_TRUE(turns->Take(&a_));
  EXPECT_TRUE(turns->Take(&b_));
  EXPECT_TRUE(turns->Take(&a_)) << "a holder's next frame keeps its turn";
  EXPECT_FALSE(turns->Take(&c_));
  EXPECT_FALSE(turns->Take(&d_));
  EXPECT_FALSE(turns->Take(&c_)) << "asking again does not queue twice";
  EXPECT_EQ(turns->waiting(), 2u);
  EXPECT_EQ(turns->holding(), 2u);
  turns->Give(&c_);  // Not a holder: nothing happens.
  EXPECT_TRUE(granted_.empty());
  turns->Give(&a_);
  ASSERT_EQ(granted_.size(), 1u);
  EXPECT_EQ(granted_[0], &c_);
  EXPECT_TRUE(turns->Take(&c_)) << "a granted waiter holds its turn";
  EXPECT_FALSE(turns->Take(&a_)) << "who gave its turn back goes behind the line";
  turns->Give(&b_);
  ASSERT_EQ(granted_.size(), 2u);
  EXPECT_EQ(granted_[1], &d_);
  turns->Give(&c_);
  ASSERT_EQ(granted_.size(), 3u);
  EXPECT_EQ(granted_[2], &a_);
  turns->Give(&d_);
  turns->Give(&a_);
  EXPECT_EQ(turns->holding(), 0u);
  EXPECT_EQ(turns->waiting(), 0u);
}

TEST_F(SendTurnsTest, AWaiterThatLeavesIsNeverTold) {
  auto turns = Make(1);
  EXPECT_TRUE(turns->Take(&a_));
  EXPECT_FALSE(turns->Take(&b_));
  EXPECT_FALSE(turns->Take(&c_));
  EXPECT_TRUE(turns->Leave(&b_));
  EXPECT_FALSE(turns->Leave(&b_)) << "no longer in line";
  EXPECT_FALSE(turns->Leave(&a_)) << "a holder is not in line";
  turns->Give(&a_);
  ASSERT_EQ(granted_.size(), 1u);
  EXPECT_EQ(granted_[0], &c_);
  EXPECT_FALSE(turns->Leave(&c_)) << "granted already";
  turns->Give(&c_);
  EXPECT_EQ(turns->holding(), 0u);
}

TEST_F(SendTurnsTest, AQuietHolderGivesItsTurnUpOnlyWhileOthersWait) {
  auto turns = Make(1);
  EXPECT_TRUE(turns->Take(&a_));  // Its write starts now and does not finish.
  clock_.Advance(absl::Seconds(5));
  EXPECT_EQ(turns->Sweep(), 0) << "nobody waits";
  EXPECT_FALSE(turns->Take(&b_));
  EXPECT_EQ(turns->Sweep(), 1);
  ASSERT_EQ(granted_.size(), 1u);
  EXPECT_EQ(granted_[0], &b_);
  EXPECT_EQ(turns->yielded(), 1u);
  // a sends the rest of its chunk without a turn: the line would only slow it down.
  turns->WriteDone(&a_);
  EXPECT_TRUE(turns->Take(&a_));
  EXPECT_EQ(turns->holding(), 1u) << "b's turn only";
  EXPECT_FALSE(turns->Take(&c_));
  turns->Give(&a_);  // a's chunk is sent; it held no turn, so none is handed on.
  EXPECT_EQ(granted_.size(), 1u);
  EXPECT_FALSE(turns->Take(&a_)) << "its next chunk waits its turn";
  EXPECT_TRUE(turns->Take(&b_));
  turns->Give(&b_);
  ASSERT_EQ(granted_.size(), 2u);
  EXPECT_EQ(granted_[1], &c_);
  turns->Give(&c_);
  ASSERT_EQ(granted_.size(), 3u);
  EXPECT_EQ(granted_[2], &a_);
}

TEST_F(SendTurnsTest, AWriteInsideTheYieldTimeOrFinishedKeepsItsTurn) {
  auto turns = Make(2);
  EXPECT_TRUE(turns->Take(&a_));
  EXPECT_TRUE(turns->Take(&b_));
  turns->WriteDone(&b_);  // b is between frames: not waiting on its client.
  EXPECT_FALSE(turns->Take(&c_));
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(turns->Sweep(), 0) << "exactly the yield time is not past it";
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(turns->Sweep(), 1);
  ASSERT_EQ(granted_.size(), 1u);
  EXPECT_EQ(granted_[0], &c_);
  EXPECT_EQ(turns->yielded(), 1u);
  // a gave its turn up, not b: a's chunk ending hands nothing on, b's does.
  EXPECT_FALSE(turns->Take(&d_));
  turns->Give(&a_);
  EXPECT_EQ(granted_.size(), 1u);
  turns->Give(&b_);
  ASSERT_EQ(granted_.size(), 2u);
  EXPECT_EQ(granted_[1], &d_);
}

TEST_F(SendTurnsTest, NoMoreTurnsTakenThanWaitTheLongestQuietFirst) {
  auto turns = Make(3);
  EXPECT_TRUE(turns->Take(&b_));
  clock_.Advance(absl::Milliseconds(10));
  EXPECT_TRUE(turns->Take(&a_));
  clock_.Advance(absl::Milliseconds(10));
  EXPECT_TRUE(turns->Take(&c_));
  EXPECT_FALSE(turns->Take(&d_));
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(turns->Sweep(), 1);
  EXPECT_EQ(turns->yielded(), 1u);
  EXPECT_EQ(turns->holding(), 3u) << "a, c and d";
  // b started its write first: it is the one that gave its turn up.
  turns->Give(&b_);
  EXPECT_EQ(turns->holding(), 3u);
  turns->Give(&a_);
  EXPECT_EQ(turns->holding(), 2u);
  EXPECT_EQ(turns->Sweep(), 0) << "nobody waits";
}

TEST_F(SendTurnsTest, ZeroTurnsIsNoBound) {
  auto turns = Make(0);
  for (Recorder* r : {&a_, &b_, &c_, &d_}) EXPECT_TRUE(turns->Take(r));
  EXPECT_EQ(turns->waiting(), 0u);
  EXPECT_EQ(turns->holding(), 0u);
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(turns->Sweep(), 0);
}

}  // namespace
}  // namespace kvtier
