// LeaseTable, over a real RAM-only TieredStore: a leased chunk is not evicted by puts
// that need its room, and is again once the lease ends (taken by a Get, released, or
// expired on an injected clock); the bounds on count and bytes refuse leases instead of
// failing; ids are per namespace.
#include "server/lease_table.h"

#include <gtest/gtest.h>

#include <string>

#include "storage/crc32c.h"
#include "tests/support/fake_clock.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

constexpr uint64_t kChunk = 1 << 20;  // LayoutOfMiB(1).
constexpr int kPoolChunks = 4;

class LeaseTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = kPoolChunks * kChunk;
    o.ram.arena.slot_bytes = kChunk;
    o.put_wait = absl::ZeroDuration();  // A full pool answers at once.
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
    auto r = store_->RegisterLayout(testing::LayoutOfMiB(1));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
  }

  LeaseTable MakeTable(uint32_t max_leases = 16, uint64_t max_bytes = 2 * kChunk) {
    LeaseTableOptions o;
    o.max_leases = max_leases;
    o.max_held_bytes = max_bytes;
    o.max_ttl = absl::Seconds(60);
    o.now = clock_.AsFunction();
    EXPECT_TRUE(o.Validate().ok());
    return LeaseTable(o);
  }

  ChunkId Id(uint64_t i) const { return ChunkId{ns_, testing::KeyOf(i)}; }

  absl::Status Put(uint64_t i) {
    auto w = store_->BeginPut(Id(i), 256);
    if (!w.ok()) return w.status();
    if (*w == nullptr) return absl::OkStatus();
    const std::string data = testing::PatternBytes(i, kChunk);
    if (absl::Status s = (*w)->Append(data); !s.ok()) return s;
    return store_->CommitPut(*std::move(w), crc32c::Value(data));
  }

  std::vector<LeasedChunk> Hold(std::initializer_list<uint64_t> ids) {
    std::vector<LeasedChunk> held;
    for (uint64_t i : ids) {
      auto v = store_->HoldInRam(Id(i));
      EXPECT_TRUE(v.has_value()) << i;
      if (v) held.push_back(LeasedChunk{Id(i), *std::move(v)});
    }
    return held;
  }
  uint64_t RamUsed() {
    for (const TierStats& t : store_->LocalTierStats()) {
      if (t.tier == Tier::kRam) return t.used_bytes;
    }
    return 0;
  }

  // Fills the pool with chunks 100.. (each put evicts the least recently used chunk
  // that is evictable).
  void Churn(uint64_t first) {
    for (uint64_t i = first; i < first + kPoolChunks; ++i) {
      ASSERT_TRUE(Put(i).ok()) << i;
    }
  }

  testing::FakeClock clock_;
  std::unique_ptr<TieredStore> store_;
  uint64_t ns_ = 0;
};

// A deleted chunk's bytes leave the pool though a lease held it: the lease once kept
// them (counted by no quota) for its life, so a tenant could lease, delete and put
// again past its ram_quota.
TEST_F(LeaseTableTest, DeletedChunksAreLetGoByTheLeasesHoldingThem) {
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(Put(i).ok());
  LeaseTable leases = MakeTable(16, 4 * kChunk);
  const uint64_t a = leases.Grant(ns_, Hold({1, 2}), absl::Seconds(30), "team-a");
  const uint64_t b = leases.Grant(ns_, Hold({2, 3}), absl::Seconds(30));
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);
  EXPECT_EQ(leases.GetStats().held_bytes, 4 * kChunk);
  for (uint64_t i : {1, 2}) ASSERT_TRUE(store_->Delete(Id(i)).ok());
  EXPECT_EQ(RamUsed(), 3 * kChunk);  // Still held.
  const ChunkId gone[] = {Id(1), Id(2)};
  leases.Forget(ns_, gone);
  EXPECT_EQ(RamUsed(), kChunk);
  EXPECT_EQ(leases.GetStats().held_bytes, kChunk);
  EXPECT_EQ(leases.held_bytes("team-a"), 0u);
  EXPECT_EQ(leases.live("team-a"), 1u);  // The lease stays, holding nothing.
  leases.ForgetNamespace(ns_ + 1);       // Another namespace's: nothing here.
  EXPECT_EQ(leases.GetStats().held_bytes, kChunk);
  leases.ForgetNamespace(ns_);
  EXPECT_EQ(leases.GetStats().held_bytes, 0u);
  auto taken = leases.Take(ns_, b);
  ASSERT_TRUE(taken.ok());
  EXPECT_TRUE(taken->empty());
}

TEST_F(LeaseTableTest, LeasedChunksSurviveChurnUntilTheGetTakesThem) {
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(Put(i).ok());
  LeaseTable leases = MakeTable();
  const uint64_t id = leases.Grant(ns_, Hold({1, 2}), absl::Seconds(30));
  ASSERT_NE(id, 0u);
  EXPECT_EQ(leases.GetStats().held_bytes, 2 * kChunk);
  Churn(100);  // Only two slots are evictable: 3 and the churn's own chunks go.
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kNone);

  // Another namespace cannot take it; the right one can, once.
  EXPECT_TRUE(absl::IsNotFound(leases.Take(ns_ + 1, id).status()));
  auto held = leases.Take(ns_, id);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->size(), 2u);
  EXPECT_TRUE(absl::IsNotFound(leases.Take(ns_, id).status()));
  EXPECT_EQ(leases.GetStats().live, 0u);
  EXPECT_EQ(leases.GetStats().held_bytes, 0u);
  // The Get still holds them while it runs; once it is done they are evictable.
  Churn(200);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  held->clear();
  Churn(300);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kNone);
}

TEST_F(LeaseTableTest, ReleaseAndExpiryEndLeases) {
  for (uint64_t i = 1; i <= 2; ++i) ASSERT_TRUE(Put(i).ok());
  LeaseTable leases = MakeTable();
  const uint64_t a = leases.Grant(ns_, Hold({1}), absl::Seconds(10));
  const uint64_t b = leases.Grant(ns_, Hold({2}), absl::Hours(1));  // Cut to 60 s.
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);
  EXPECT_NE(a, b);
  EXPECT_FALSE(leases.Release(ns_ + 1, a));
  EXPECT_TRUE(leases.Release(ns_, a));
  EXPECT_FALSE(leases.Release(ns_, a));
  clock_.Advance(absl::Seconds(59));
  EXPECT_EQ(leases.Expire(), 0u);
  Churn(100);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);  // Released: evicted.
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kRam);   // Still leased.
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(leases.Expire(), 1u);
  EXPECT_TRUE(absl::IsNotFound(leases.Take(ns_, b).status()));
  Churn(200);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kNone);
  const LeaseTableStats s = leases.GetStats();
  EXPECT_EQ(s.granted, 2u);
  EXPECT_EQ(s.released, 1u);
  EXPECT_EQ(s.expired, 1u);
  EXPECT_EQ(s.live, 0u);
}

// Shutdown ends every lease before the store goes (a held chunk gives its slots back to
// the pool when dropped, so it must not outlive the pool).
TEST_F(LeaseTableTest, ClearEndsEveryLeaseAndGivesTheChunksBack) {
  for (uint64_t i = 1; i <= 2; ++i) ASSERT_TRUE(Put(i).ok());
  LeaseTable leases = MakeTable();
  ASSERT_NE(leases.Grant(ns_, Hold({1}), absl::Seconds(30)), 0u);
  ASSERT_NE(leases.Grant(ns_, Hold({2}), absl::Seconds(30)), 0u);
  EXPECT_EQ(leases.Clear(), 2u);
  EXPECT_EQ(leases.GetStats().live, 0u);
  EXPECT_EQ(leases.GetStats().held_bytes, 0u);
  Churn(100);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kNone);
  EXPECT_EQ(leases.Clear(), 0u);
}

// A lease that outlives the store (any path that forgets to Clear first) still holds
// readable bytes, and dropping it afterwards is safe: chunks share the pool's memory.
TEST_F(LeaseTableTest, ALeaseOutlivingItsStoreIsSafe) {
  ASSERT_TRUE(Put(1).ok());
  LeaseTable leases = MakeTable();
  const uint64_t id = leases.Grant(ns_, Hold({1}), absl::Seconds(30));
  ASSERT_NE(id, 0u);
  store_.reset();
  auto held = leases.Take(ns_, id);
  ASSERT_TRUE(held.ok());
  ASSERT_EQ(held->size(), 1u);
  std::string bytes;
  (*held)[0].ForEachPiece(0, kChunk, [&](absl::string_view p) { bytes.append(p.data(), p.size()); });
  EXPECT_TRUE(bytes == testing::PatternBytes(1, kChunk));
}

TEST_F(LeaseTableTest, BoundsRefuseLeasesWithoutHoldingAnything) {
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(Put(i).ok());
  LeaseTable by_bytes = MakeTable(/*max_leases=*/16, /*max_bytes=*/2 * kChunk);
  EXPECT_NE(by_bytes.Grant(ns_, Hold({1, 2}), absl::Seconds(30)), 0u);
  EXPECT_EQ(by_bytes.Grant(ns_, Hold({3}), absl::Seconds(30)), 0u);  // 3 MiB > 2 MiB.
  EXPECT_EQ(by_bytes.GetStats().refused, 1u);
  EXPECT_EQ(by_bytes.GetStats().held_bytes, 2 * kChunk);
  Churn(100);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kNone);  // The refused lease held nothing.

  LeaseTable by_count = MakeTable(/*max_leases=*/1, /*max_bytes=*/8 * kChunk);
  EXPECT_NE(by_count.Grant(ns_, {}, absl::Seconds(30)), 0u);
  EXPECT_EQ(by_count.Grant(ns_, {}, absl::Seconds(30)), 0u);
  // An expired lease frees its place for the next Grant.
  clock_.Advance(absl::Seconds(31));
  EXPECT_NE(by_count.Grant(ns_, {}, absl::Seconds(30)), 0u);
}

// A tenant with a max_leases of its own is held to it; others (and the implicit
// tenant) are not, and an ended lease gives the tenant its place back.
TEST_F(LeaseTableTest, ATenantsOwnBoundRefusesOnlyThatTenant) {
  LeaseTable table = MakeTable(/*max_leases=*/16, /*max_bytes=*/8 * kChunk);
  const uint64_t a1 = table.Grant(ns_, {}, absl::Seconds(30), "team-a", 2);
  const uint64_t a2 = table.Grant(ns_, {}, absl::Seconds(30), "team-a", 2);
  EXPECT_NE(a1, 0u);
  EXPECT_NE(a2, 0u);
  EXPECT_EQ(table.Grant(ns_, {}, absl::Seconds(30), "team-a", 2), 0u);
  EXPECT_EQ(table.live("team-a"), 2u);
  EXPECT_EQ(table.GetStats().tenant_refused, 1u);
  EXPECT_NE(table.Grant(ns_, {}, absl::Seconds(30), "team-b", 2), 0u);
  EXPECT_NE(table.Grant(ns_, {}, absl::Seconds(30)), 0u);  // The implicit tenant.
  EXPECT_EQ(table.live("team-b"), 1u);
  // Released, taken or expired: the place is the tenant's again.
  EXPECT_TRUE(table.Release(ns_, a1));
  EXPECT_EQ(table.live("team-a"), 1u);
  EXPECT_NE(table.Grant(ns_, {}, absl::Seconds(30), "team-a", 2), 0u);
  ASSERT_TRUE(table.Take(ns_, a2).ok());
  clock_.Advance(absl::Seconds(31));
  table.Expire();
  EXPECT_EQ(table.live("team-a"), 0u);
  EXPECT_EQ(table.live("team-b"), 0u);
  EXPECT_EQ(table.GetStats().refused, 1u);
}

// A named tenant's leases hold at most its share of max_held_bytes (max_held_bytes /
// tenants); the implicit tenant is held only by the daemon-wide bound.
TEST_F(LeaseTableTest, ATenantHoldsAtMostItsShareOfTheBytes) {
  LeaseTable table = MakeTable(/*max_leases=*/16, /*max_bytes=*/2 * kChunk);
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(Put(i).ok()) << i;
  const uint64_t a = table.Grant(ns_, Hold({1}), absl::Seconds(30), "team-a", 0, 2);
  EXPECT_NE(a, 0u);
  EXPECT_EQ(table.held_bytes("team-a"), kChunk);
  EXPECT_EQ(table.Grant(ns_, Hold({2}), absl::Seconds(30), "team-a", 0, 2), 0u)
      << "a second chunk is past team-a's share (1 of 2)";
  EXPECT_EQ(table.GetStats().tenant_refused, 1u);
  EXPECT_NE(table.Grant(ns_, Hold({2}), absl::Seconds(30), "team-b", 0, 2), 0u);
  EXPECT_EQ(table.held_bytes("team-b"), kChunk);
  ASSERT_TRUE(table.Release(ns_, a));
  EXPECT_EQ(table.held_bytes("team-a"), 0u);
  const uint64_t a2 = table.Grant(ns_, Hold({3}), absl::Seconds(30), "team-a", 0, 2);
  EXPECT_NE(a2, 0u) << "a released lease gives its bytes back";
  ASSERT_TRUE(table.Take(ns_, a2).ok());
  EXPECT_EQ(table.held_bytes("team-a"), 0u);
  // One tenant sharing the bound with nobody may hold all of it.
  EXPECT_NE(table.Grant(ns_, Hold({1}), absl::Seconds(30), "solo", 0, 1), 0u);
  EXPECT_EQ(table.GetStats().refused, 1u);
}

TEST(LeaseTableOptionsTest, ValidateNamesTheBadOption) {
  LeaseTableOptions o;
  o.max_ttl = absl::ZeroDuration();
  EXPECT_NE(o.Validate().message().find("max_lease_seconds"), std::string::npos);
}

}  // namespace
}  // namespace kvtier
