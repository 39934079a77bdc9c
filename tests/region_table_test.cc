// RegionTable and AdmitPeer: real memfds, no daemon.
#include "server/region_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "server/mapped_region.h"
#include "server/region_socket.h"

namespace kvtier {
namespace {

int SealedMemfd(uint64_t bytes) {
  const int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  return fd;
}

TEST(RegionTableTest, TokensOwnersAndLimits) {
  RegionTable table(RegionTableOptions{2, 1 << 20});
  const int a_fd = SealedMemfd(4096), b_fd = SealedMemfd(8192), c_fd = SealedMemfd(4096);
  auto a = table.Add(1, a_fd, 4096);
  auto b = table.Add(2, b_fd, 8192);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->id, b->id);
  EXPECT_EQ(table.regions(), 2u);
  EXPECT_EQ(table.bytes(), 12288u);
  EXPECT_EQ(table.Add(1, c_fd, 4096).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(table.Find(a->id, a->token).ok());
  EXPECT_EQ(table.Find(a->id, a->token + 1).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Find(a->id ^ b->id ^ 1, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Only the owner removes its region.
  EXPECT_EQ(table.Remove(2, a->id).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Remove(1, a->id).ok());
  EXPECT_TRUE(table.Add(1, c_fd, 4096).ok());
  close(a_fd);
  close(b_fd);
  close(c_fd);
}

TEST(RegionTableTest, ATransferKeepsItsRegionMappedAfterTheOwnerGoes) {
  RegionTable table(RegionTableOptions{});
  const int fd = SealedMemfd(4096);
  auto added = table.Add(7, fd, 4096);
  ASSERT_TRUE(added.ok());
  close(fd);  // The daemon keeps only its mapping.
  auto region = table.Find(added->id, added->token);
  ASSERT_TRUE(region.ok());
  EXPECT_EQ(table.RemoveOwner(7), 1);
  EXPECT_EQ(table.regions(), 1u) << "forgotten, but mapped while the transfer holds it";
  EXPECT_EQ(table.Find(added->id, added->token).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto p = (*region)->Range(0, 4096, "x");
  ASSERT_TRUE(p.ok());
  std::memset(*p, 1, 4096);  // Still mapped: no fault.
  EXPECT_EQ((*region)->Range(1, 4096, "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*region)->Range(UINT64_MAX, 2, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  region->reset();  // The transfer ends: unmapped, no longer counted.
  EXPECT_EQ(table.regions(), 0u);
  EXPECT_EQ(table.bytes(), 0u);
}

// Closing the connection and registering again must not map more than max_regions:
// a forgotten region a transfer still holds keeps its place until the transfer ends.
TEST(RegionTableTest, AForgottenRegionATransferHoldsKeepsItsPlace) {
  RegionTable table(RegionTableOptions{2, 1 << 20});
  const int a_fd = SealedMemfd(4096), b_fd = SealedMemfd(8192), c_fd = SealedMemfd(4096);
  auto a = table.Add(1, a_fd, 4096);
  ASSERT_TRUE(a.ok());
  auto held = table.Find(a->id, a->token);  // A Prefill session writing into it, say.
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(table.RemoveOwner(1), 1);  // Its client's socket closed.
  ASSERT_TRUE(table.Add(2, b_fd, 8192).ok());
  EXPECT_EQ(table.regions(), 2u);
  EXPECT_EQ(table.bytes(), 12288u);
  const absl::Status full = table.Add(3, c_fd, 4096).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("1 of them forgotten but still in use"), std::string::npos)
      << full;
  held->reset();
  EXPECT_EQ(table.regions(), 1u);
  EXPECT_TRUE(table.Add(3, c_fd, 4096).ok()) << "its place is free once the transfer ends";
  close(a_fd);
  close(b_fd);
  close(c_fd);
}

// A remove answered OK means no transfer will touch the memory again: while one holds
// the region, the remove is refused and changes nothing.
TEST(RegionTableTest, ARemoveIsRefusedWhileATransferHoldsTheRegion) {
  RegionTable table(RegionTableOptions{});
  const int fd = SealedMemfd(4096);
  auto added = table.Add(7, fd, 4096);
  ASSERT_TRUE(added.ok());
  close(fd);
  auto transfer = table.Find(added->id, added->token);
  ASSERT_TRUE(transfer.ok());
  auto second = table.Find(added->id, added->token);
  ASSERT_TRUE(second.ok());
  const absl::Status busy = table.Remove(7, added->id);
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
  EXPECT_NE(busy.message().find("in use by 2 call(s)"), std::string::npos) << busy;
  EXPECT_EQ(table.regions(), 1u);
  EXPECT_TRUE(table.Find(added->id, added->token).ok()) << "still registered";
  second->reset();
  transfer->reset();
  EXPECT_TRUE(table.Remove(7, added->id).ok());
  EXPECT_EQ(table.regions(), 0u);
  EXPECT_EQ(table.Find(added->id, added->token).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(AdmitPeerTest, OwnUserRootAndTheAllowedGroup) {
  EXPECT_TRUE(AdmitPeer({1, 1000, 1000, {}}, 1000, std::nullopt).ok());
  EXPECT_TRUE(AdmitPeer({1, 0, 0, {}}, 1000, std::nullopt).ok());
  EXPECT_EQ(AdmitPeer({1, 1001, 1001, {}}, 1000, std::nullopt).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AdmitPeer({1, 1001, 1001, {5, 6}}, 1000, gid_t{7}).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(AdmitPeer({1, 1001, 7, {}}, 1000, gid_t{7}).ok());
  EXPECT_TRUE(AdmitPeer({1, 1001, 1001, {5, 7}}, 1000, gid_t{7}).ok());
}

TEST(MappedRegionTest, PopulateFaultsInExactlyTheRangeBeforeACopy) {
  constexpr uint64_t kPage = 4096, kBytes = 256 * kPage;
  const int fd = SealedMemfd(kBytes);  // Sparse: no page allocated yet.
  auto region = MappedRegion::Map(fd, kBytes, kBytes);
  ASSERT_TRUE(region.ok()) << region.status();
  auto p = (*region)->Range(16 * kPage, 32 * kPage, "x");
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*region)->Populate(*p, 32 * kPage, MappedRegion::Access::kWrite).ok());
  // The memfd now holds exactly the populated pages, and the daemon's mapping has them.
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
#if defined(MADV_POPULATE_WRITE)
  EXPECT_EQ(static_cast<uint64_t>(st.st_blocks) * 512, 32 * kPage);
  auto whole = (*region)->Range(0, kBytes, "x");
  ASSERT_TRUE(whole.ok());
  std::vector<unsigned char> resident(kBytes / kPage);
  ASSERT_EQ(mincore(*whole, kBytes, resident.data()), 0);
  for (uint64_t i = 0; i < resident.size(); ++i) {
    EXPECT_EQ(resident[i] & 1, i >= 16 && i < 48 ? 1 : 0) << "page " << i;
  }
#endif
  // Populating pages that are already there is a no-op, as is reading them.
  EXPECT_TRUE((*region)->Populate(*p, 32 * kPage, MappedRegion::Access::kWrite).ok());
  EXPECT_TRUE((*region)->Populate(*p, kPage, MappedRegion::Access::kRead).ok());
  close(fd);
}

}  // namespace
}  // namespace kvtier
