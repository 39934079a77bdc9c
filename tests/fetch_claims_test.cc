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
  claims.WaitForJobs();  // None: returns at once.
  claims.JobQueued();
  claims.JobQueued();
  absl::Notification done;
  std::thread waiter([&] {
    claims.WaitForJobs();
    done.Notify();
  });
  claims.JobDone();
  EXPECT_FALSE(done.HasBeenNotified());  // One job is still out.
  claims.JobDone();
  done.WaitForNotification();
  waiter.join();
}

}  // namespace
}  // namespace kvtier
