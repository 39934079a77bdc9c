// PutAdmission: room at once is answered inline; otherwise puts wait in arrival order,
// with no thread of their own, until room appears, put_wait passes on the injected
// clock, they are cancelled, or the queue is destroyed.
#include "storage/put_admission.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "storage/slot_arena.h"
#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

using ::kvtier::testing::FakeClock;

constexpr uint64_t kSlot = 64 << 10;

// Room is one slot of a real arena; a put's room goes back when its PoolChunk dies.
class PutAdmissionTest : public ::testing::Test {
 protected:
  void Make(uint64_t slots) {
    SlotArenaOptions o;
    o.capacity_bytes = slots * kSlot;
    o.slot_bytes = kSlot;
    arena_ = *SlotArena::Create(o);
    PutAdmissionOptions a;
    a.wait = absl::Seconds(5);
    a.now = clock_.AsFunction();
    admission_ = std::make_unique<PutAdmission>(
        a, [this](uint64_t size, bool may_block, bool& noted) {
          return TryRoom(size, may_block, noted);
        });
  }

  PutAdmission::Room TryRoom(uint64_t size, bool may_block, bool& noted) {
    {
      absl::MutexLock lock(&mu_);
      ++tries_;
      if (!noted) ++noted_puts_;  // A put's first try, however often it is tried.
      noted = true;
      if (may_block) blocking_threads_.push_back(std::this_thread::get_id());
      if (!error_.ok()) return error_;
    }
    auto slots = arena_->Take(1);
    if (!slots.ok()) return slots.status();
    return std::make_shared<PoolChunk>(arena_, *std::move(slots), size);
  }

  // One put's answer, for a test thread to wait on.
  struct Answer {
    absl::Notification done;
    PutAdmission::Room room;
    std::thread::id thread;
    int order = -1;
  };
  PutAdmission::Done Into(Answer* a) {
    return [this, a](PutAdmission::Room room) {
      a->room = std::move(room);
      a->thread = std::this_thread::get_id();
      a->order = answered_.fetch_add(1);
      a->done.Notify();
    };
  }

  FakeClock clock_;
  std::shared_ptr<SlotArena> arena_;
  absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread::id> blocking_threads_ ABSL_GUARDED_BY(mu_);
  int tries_ ABSL_GUARDED_BY(mu_) = 0;
  int noted_puts_ ABSL_GUARDED_BY(mu_) = 0;  // Tries that found the put's flag unset.

  // Returns once the admission thread has finished an attempt begun after this call
  // (it has started the one after that).
  void WaitForAFullRetry() {
    absl::MutexLock lock(&mu_);
    const int target = tries_ + 2;
    const auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return tries_ >= target; };
    mu_.Await(absl::Condition(&reached));
  }
  std::atomic<int> answered_{0};
  std::unique_ptr<PutAdmission> admission_;  // Last: destroyed first.
};

TEST_F(PutAdmissionTest, RoomAtOnceIsAnsweredInline) {
  Make(2);
  Answer a;
  EXPECT_EQ(admission_->Admit(kSlot, Into(&a)), 0u);
  ASSERT_TRUE(a.done.HasBeenNotified()) << "answered before Admit returned";
  ASSERT_TRUE(a.room.ok()) << a.room.status();
  EXPECT_EQ(a.thread, std::this_thread::get_id());
  EXPECT_EQ(admission_->queued_total(), 0u);
  absl::MutexLock lock(&mu_);
  EXPECT_TRUE(blocking_threads_.empty()) << "the caller's thread only asks the quick way";
}

TEST_F(PutAdmissionTest, WaitersHoldNoThreadAndAreAnsweredInArrivalOrder) {
  Make(1);
  Answer first;
  admission_->Admit(kSlot, Into(&first));
  ASSERT_TRUE(first.room.ok());
  // Fifty puts find no room: each Admit returns at once, on this one thread.
  constexpr int kWaiters = 50;
  std::vector<Answer> waiters(kWaiters);
  for (Answer& w : waiters) EXPECT_NE(admission_->Admit(kSlot, Into(&w)), 0u);
  EXPECT_EQ(admission_->waiting(), static_cast<size_t>(kWaiters));
  EXPECT_EQ(admission_->queued_total(), static_cast<uint64_t>(kWaiters));
  // Room for one at a time: each freed slot goes to the next in line.
  first.room = absl::CancelledError("given back");
  for (int i = 0; i < kWaiters; ++i) {
    admission_->Notify();
    waiters[i].done.WaitForNotification();
    ASSERT_TRUE(waiters[i].room.ok()) << i << ": " << waiters[i].room.status();
    EXPECT_EQ(waiters[i].order, i + 1) << "answered out of arrival order";
    EXPECT_NE(waiters[i].thread, std::this_thread::get_id());
    waiters[i].room = absl::CancelledError("given back");
  }
  EXPECT_EQ(admission_->waiting(), 0u);
  absl::MutexLock lock(&mu_);
  for (std::thread::id t : blocking_threads_) {
    EXPECT_NE(t, std::this_thread::get_id()) << "only the admission thread may block";
  }
}

// TryRoom's per-put flag outlives the put's tries, so that a metric counted through it
// counts a put that waits once (its first try inline, then every retry_interval).
TEST_F(PutAdmissionTest, APutsFlagIsKeptAcrossItsTries) {
  Make(1);
  Answer held, a, b;
  admission_->Admit(kSlot, Into(&held));
  ASSERT_TRUE(held.room.ok());
  ASSERT_NE(admission_->Admit(kSlot, Into(&a)), 0u);
  ASSERT_NE(admission_->Admit(kSlot, Into(&b)), 0u);
  WaitForAFullRetry();
  WaitForAFullRetry();
  {
    absl::MutexLock lock(&mu_);
    EXPECT_GE(tries_, 5);  // held's, a's inline one, and at least three of the thread's.
    // held and a; b (queued behind a, never tried inline: a was waiting) not yet.
    EXPECT_EQ(noted_puts_, 2);
  }
  held.room = absl::CancelledError("given back");
  admission_->Notify();
  a.done.WaitForNotification();
  ASSERT_TRUE(a.room.ok());
  a.room = absl::CancelledError("given back");
  admission_->Notify();
  b.done.WaitForNotification();
  ASSERT_TRUE(b.room.ok());
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(noted_puts_, 3);
}

TEST_F(PutAdmissionTest, NewcomerDoesNotJumpTheQueue) {
  Make(1);
  Answer held, a, b;
  admission_->Admit(kSlot, Into(&held));
  ASSERT_NE(admission_->Admit(kSlot, Into(&a)), 0u);
  // Room appears and a newcomer arrives before anyone is told: it still queues behind a.
  held.room = absl::CancelledError("given back");
  EXPECT_NE(admission_->Admit(kSlot, Into(&b)), 0u);
  admission_->Notify();
  a.done.WaitForNotification();
  ASSERT_TRUE(a.room.ok()) << a.room.status();
  EXPECT_FALSE(b.done.HasBeenNotified()) << "b got room that a holds";
  a.room = absl::CancelledError("given back");
  admission_->Notify();
  b.done.WaitForNotification();
  EXPECT_TRUE(b.room.ok()) << b.room.status();
  EXPECT_LT(a.order, b.order);
}

TEST_F(PutAdmissionTest, WaitEndsResourceExhaustedOnTheInjectedClock) {
  Make(1);
  Answer held, a;
  admission_->Admit(kSlot, Into(&held));
  admission_->Admit(kSlot, Into(&a));
  clock_.Advance(absl::Seconds(4));
  WaitForAFullRetry();
  EXPECT_FALSE(a.done.HasBeenNotified()) << "answered before its deadline";
  EXPECT_EQ(admission_->timed_out_total(), 0u);
  clock_.Advance(absl::Seconds(1));
  admission_->Notify();
  a.done.WaitForNotification();
  EXPECT_EQ(a.room.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(a.room.status().message().find("waited 5s"), absl::string_view::npos)
      << a.room.status();
  EXPECT_EQ(admission_->timed_out_total(), 1u);
  EXPECT_EQ(admission_->waiting(), 0u);
}

TEST_F(PutAdmissionTest, CancelAnswersCancelledOnTheCallersThread) {
  Make(1);
  Answer held, a;
  admission_->Admit(kSlot, Into(&held));
  const uint64_t ticket = admission_->Admit(kSlot, Into(&a));
  ASSERT_NE(ticket, 0u);
  EXPECT_TRUE(admission_->Cancel(ticket));
  ASSERT_TRUE(a.done.HasBeenNotified());
  EXPECT_EQ(a.room.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(a.thread, std::this_thread::get_id());
  EXPECT_FALSE(admission_->Cancel(ticket)) << "answered already";
  EXPECT_EQ(admission_->waiting(), 0u);
}

TEST_F(PutAdmissionTest, OtherErrorsAreAnsweredAtOnce) {
  Make(1);
  {
    absl::MutexLock lock(&mu_);
    error_ = absl::InvalidArgumentError("larger than the pool");
  }
  Answer a;
  EXPECT_EQ(admission_->Admit(kSlot, Into(&a)), 0u);
  ASSERT_TRUE(a.done.HasBeenNotified());
  EXPECT_EQ(a.room.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PutAdmissionTest, DestroyingTheQueueAnswersWaitersUnavailable) {
  Make(1);
  Answer held, a, b;
  admission_->Admit(kSlot, Into(&held));
  admission_->Admit(kSlot, Into(&a));
  admission_->Admit(kSlot, Into(&b));
  admission_.reset();
  ASSERT_TRUE(a.done.HasBeenNotified() && b.done.HasBeenNotified());
  EXPECT_EQ(a.room.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(b.room.status().code(), absl::StatusCode::kUnavailable);
}

// Answers the admission thread gives run through answer_on (the store's commit threads),
// so a put's first-frame copy does not hold up the queue; inline answers stay inline.
TEST(PutAdmissionAnswerOnTest, ThreadAnswersGoThroughTheExecutor) {
  SlotArenaOptions ao;
  ao.capacity_bytes = kSlot;
  ao.slot_bytes = kSlot;
  std::shared_ptr<SlotArena> arena = *SlotArena::Create(ao);
  std::atomic<int> submitted{0};
  std::vector<std::thread> executor;
  absl::Mutex mu;
  PutAdmissionOptions o;
  o.answer_on = [&](std::function<void()> task) {
    submitted.fetch_add(1);
    absl::MutexLock lock(&mu);
    executor.emplace_back(std::move(task));
  };
  auto admission = std::make_unique<PutAdmission>(o, [&](uint64_t size, bool, bool&) -> PutAdmission::Room {
    auto slots = arena->Take(1);
    if (!slots.ok()) return slots.status();
    return std::make_shared<PoolChunk>(arena, *std::move(slots), size);
  });
  PutAdmission::Room held;
  EXPECT_EQ(admission->Admit(kSlot, [&](PutAdmission::Room r) { held = std::move(r); }), 0u);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(submitted.load(), 0) << "an inline answer runs on the caller's thread";
  absl::Notification answered;
  std::thread::id on;
  admission->Admit(kSlot, [&](PutAdmission::Room r) {
    EXPECT_TRUE(r.ok()) << r.status();
    on = std::this_thread::get_id();
    answered.Notify();
  });
  held = absl::CancelledError("given back");
  admission->Notify();
  answered.WaitForNotification();
  EXPECT_EQ(submitted.load(), 1);
  admission.reset();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(executor.size(), 1u);
  EXPECT_EQ(on, executor[0].get_id());
  for (std::thread& t : executor) t.join();
}

TEST(PutAdmissionOptionsTest, ValidateNamesTheBadOption) {
  PutAdmissionOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.wait = -absl::Seconds(1);
  EXPECT_NE(o.Validate().message().find("wait"), absl::string_view::npos);
  o = PutAdmissionOptions{};
  o.retry_interval = absl::ZeroDuration();
  EXPECT_NE(o.Validate().message().find("retry_interval"), absl::string_view::npos);
}

}  // namespace
}  // namespace kvtier
