// WriteBackFlusher: its threads run flush_one while it reports work, and Stop ends
// them after their current chunk even while work keeps coming.
#include "storage/write_back_flusher.h"

#include <gtest/gtest.h>

#include <atomic>

#include "absl/synchronization/notification.h"

namespace kvtier {
namespace {

TEST(WriteBackFlusherTest, StopEndsThePassAfterTheCurrentChunk) {
  std::atomic<int> flushed{0};
  absl::Notification flushing;
  // Always more to write (commits arriving as fast as it flushes): a pass never ends
  // by running out of work.
  WriteBackFlusher flusher(/*threads=*/2, [&] {
    if (flushed.fetch_add(1) == 0) flushing.Notify();
    return true;
  }, /*after_pass=*/nullptr);
  flusher.Notify();
  flushing.WaitForNotification();
  flusher.Stop();  // It once returned only once flush_one reported nothing left: never.
  const int at_stop = flushed.load();
  EXPECT_GE(at_stop, 1);
  EXPECT_EQ(flushed.load(), at_stop) << "no chunk after Stop returned";
}

TEST(WriteBackFlusherTest, APassRunsUntilNothingIsLeft) {
  std::atomic<int> left{5};
  absl::Notification done;
  WriteBackFlusher flusher(/*threads=*/1, [&] {
    if (left.load() == 0) return false;
    if (left.fetch_sub(1) == 1) done.Notify();
    return true;
  }, /*after_pass=*/nullptr);
  flusher.Notify();
  done.WaitForNotification();
  EXPECT_EQ(left.load(), 0);
  flusher.Stop();
}

}  // namespace
}  // namespace kvtier
