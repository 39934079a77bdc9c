#include "storage/fetch_claims.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

ChunkId Id(uint64_t n) { return ChunkId{1, ChunkKey{n, n}}; }

TEST(FetchClaimsTest, ClaimFreeTakesOnlyWhatNobodyHolds) {
  FetchClaims claims;
  const ChunkId first[] = {Id(1), Id(2)};
  EXPECT_EQ(claims.ClaimFree(first), (std::vector<ChunkId>{Id(1), Id(2)}));
  const ChunkId second[] = {Id(2), Id(3), Id(1), Id(3)};
  EXPECT_EQ(claims.ClaimFree(second), (std::vector<ChunkId>{Id(3)}));
  EXPECT_TRUE(claims.held(Id(1)));
  const ChunkId one[] = {Id(1)};
  claims.Release(one);
  EXPECT_FALSE(claims.held(Id(1)));
  EXPECT_EQ(claims.ClaimFree(second), (std::vector<ChunkId>{Id(1)}));
}

TEST(FetchClaimsTest, AWaiterGetsTheClaimOnlyAfterItsRelease) {
  FetchClaims claims;
  const ChunkId id[] = {Id(7)};
  ASSERT_EQ(claims.ClaimFree(id).size(), 1u);
  absl::Notification started, claimed;
  std::thread waiter([&] {
    started.Notify();
    claims.WaitAndClaim(Id(7));
    claimed.Notify();
  });
  started.WaitForNotification();
  // Whatever the waiter's progress, it cannot hold the claim while this side does.
  EXPECT_FALSE(claimed.HasBeenNotified());
  claims.Release(id);
  claimed.WaitForNotification();
  EXPECT_TRUE(claims.held(Id(7)));  // Now the waiter's.
  EXPECT_TRUE(claims.ClaimFree(id).empty());
  waiter.join();
}

TEST(FetchClaimsTest, WaitForJobsReturnsOnceEveryJobIsDone) {
  FetchClaims claims;
  // Notified on the waiter's thread when WaitForJobs is about to wait for jobs still out
  // (the sync point) or, had it not waited, when it returned: whichever is first.
  absl::Notification waits_or_returned;
  const auto waits_or_returned_now = [&] {
    if (!waits_or_returned.HasBeenNotified()) waits_or_returned.Notify();
  };
  claims.set_before_jobs_wait_for_testing(waits_or_returned_now);
  claims.WaitForJobs();  // None: returns at once, without waiting.
  EXPECT_FALSE(waits_or_returned.HasBeenNotified());
  claims.JobQueued();
  claims.JobQueued();
  claims.JobDone();  // One job is still out.
  absl::Notification done;
  std::thread waiter([&] {
    claims.WaitForJobs();
    done.Notify();
    waits_or_returned_now();
  });
  waits_or_returned.WaitForNotification();
  // Only this thread can end the last job, so a WaitForJobs that waits for it still is.
  EXPECT_FALSE(done.HasBeenNotified()) << "WaitForJobs returned with a job still out";
  claims.JobDone();
  done.WaitForNotification();
  waiter.join();
}

}  // namespace
}  // namespace kvtier
