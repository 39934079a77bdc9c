// TieredStore with hints, eviction policies and events: Hint prefetches the window's
// SSD-only chunks into RAM nearest first within its byte budget and answers what it
// took; RAM eviction spares hinted chunks; a prefix policy keeps a chain's head; lineage
// survives the SSD and a restart; every store, promotion, eviction and delete is an
// event. Real RocksDB in a temp dir.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/tiered_store.h"
#include "tests/support/fake_clock.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using ::kvtier::testing::TempDir;

constexpr uint64_t kChunk = 1 << 20;
constexpr uint64_t kRamChunks = 4;

class TieredStoreHintTest : public ::testing::Test {
 protected:
  void SetUp() override { SetMinLogLevel(LogLevel::kError); }

  TieredStoreOptions Options(WriteMode mode, EvictionPolicyKind policy = EvictionPolicyKind::kLru) {
    TieredStoreOptions o;
    o.write_mode = mode;
    o.ram.arena.capacity_bytes = kRamChunks * kChunk;
    o.ram.arena.slot_bytes = kChunk;
    o.ssd.path = dir_.path() + "/db";
    o.ssd.capacity_bytes = 64 * kChunk;
    o.ssd.write_buffer_bytes = 16 << 20;
    o.put_wait = absl::Milliseconds(50);
    o.eviction.kind = policy;
    o.eviction.prefix_cost.cost_weight = 0;
    o.hints.max_bytes = 2 * kChunk;
    o.events = &events_;
    return o;
  }
  void Open(const TieredStoreOptions& o) {
    store_.reset();
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
    auto r = store_->RegisterLayout(testing::LayoutOfMiB(1));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
  }
  ChunkId Id(uint64_t n) const { return ChunkId{ns_, testing::KeyOf(n)}; }

  void Put(uint64_t n, ChunkLineage lineage = {}) {
    auto w = store_->BeginPut(Id(n), 256);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_NE(*w, nullptr);
    (*w)->set_lineage(lineage);
    const std::string data = testing::PatternBytes(n, (*w)->size());
    ASSERT_TRUE((*w)->Append(data).ok());
    ASSERT_TRUE(store_->CommitPut(*std::move(w), crc32c::Value(data)).ok());
  }
  // Puts chunks `from`..`to` as one chain (each the previous one's child).
  void PutChain(uint64_t from, uint64_t to) {
    for (uint64_t n = from; n <= to; ++n) {
      ChunkLineage l{static_cast<uint32_t>(n - from), n > from, n > from ? Id(n - 1).key : ChunkKey{}};
      Put(n, l);
    }
  }
  std::vector<ChunkEvent> Events(uint64_t after = 0) { return events_.Read(after, 0, 1000).events; }

  TempDir dir_;
  EventLog events_{1024};
  std::unique_ptr<TieredStore> store_;
  uint64_t ns_ = 0;
};

TEST_F(TieredStoreHintTest, HintPrefetchesTheWindowsSsdChunksNearestFirstWithinItsBudget) {
  Open(Options(WriteMode::kWriteThrough));
  for (uint64_t n = 1; n <= 8; ++n) Put(n);  // RAM keeps 5..8; 1..4 only on SSD.
  ASSERT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  const uint64_t promotions = store_->GetStats().promotions;
  // The window holds two chunks' worth: 2 and 6 (6 is in RAM already); 3 is cut.
  auto r = store_->Hint("sched", {{ns_, {Id(2).key, Id(6).key}}, {ns_, {Id(3).key}}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests_accepted, 1u);
  EXPECT_EQ(r->keys_accepted, 2u);
  EXPECT_TRUE(r->truncated);
  EXPECT_EQ(r->prefetching, 1u);
  EXPECT_EQ(r->cached, 1u);
  store_->WaitForPrefetch();
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kSsd);  // Cut from the window: not fetched.
  EXPECT_EQ(store_->GetStats().promotions, promotions + 1);
  EXPECT_EQ(store_->GetStats().hint_clients, 1u);
  bool promoted = false;
  for (const ChunkEvent& e : Events()) {
    promoted |= e.kind == ChunkEventKind::kPromoted && e.id == Id(2) && e.tier == Tier::kRam;
  }
  EXPECT_TRUE(promoted);
  // The promoted chunk is read from RAM.
  auto view = store_->Read(Id(2));
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->tier(), Tier::kRam);
}

// When only hinted chunks can make room (every other one pinned), a prefetch evicts
// none needed no later than the chunk it fetches. It once took the window's farthest
// chunk in RAM whatever the fetched one's rank: here 6 (rank 1) for 1 (rank 2), and the
// next Hint fetched 6 back by evicting 1, each Hint a wasted SSD read.
TEST_F(TieredStoreHintTest, APrefetchEvictsNoHintedChunkNeededSooner) {
  TieredStoreOptions o = Options(WriteMode::kWriteThrough);
  o.hints.max_bytes = 4 * kChunk;
  Open(o);
  for (uint64_t n = 1; n <= 6; ++n) Put(n);  // RAM keeps 3..6; 1 and 2 only on SSD.
  ASSERT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  ASSERT_TRUE(store_->Pin(Id(3), absl::Minutes(5)).ok());
  ASSERT_TRUE(store_->Pin(Id(4), absl::Minutes(5)).ok());
  auto r = store_->Hint("sched", {{ns_, {Id(5).key, Id(6).key, Id(1).key}}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefetching, 1u);
  store_->WaitForPrefetch();
  EXPECT_EQ(store_->Locate(Id(5)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(6)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd);  // No room that may be taken: not fetched.
  // Its rank ahead of 6: it may take 6's room now.
  ASSERT_TRUE(store_->Hint("sched", {{ns_, {Id(1).key, Id(5).key, Id(6).key}}}).ok());
  store_->WaitForPrefetch();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(5)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(6)), Tier::kSsd);
}

TEST_F(TieredStoreHintTest, UnknownNamespaceChangesNothing) {
  Open(Options(WriteMode::kWriteThrough));
  Put(1);
  ASSERT_TRUE(store_->Hint("sched", {{ns_, {Id(1).key}}}).ok());
  auto r = store_->Hint("sched", {{ns_, {Id(2).key}}, {ns_ + 1, {Id(3).key}}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->GetStats().hinted_chunks, 1u);  // The previous hint stands.
}

TEST_F(TieredStoreHintTest, RamEvictionSparesHintedChunks) {
  Open(Options(WriteMode::kRamOnly));
  for (uint64_t n = 1; n <= 4; ++n) Put(n);
  ASSERT_TRUE(store_->Hint("sched", {{ns_, {Id(1).key, Id(2).key}}}).ok());
  Put(5);  // Evicts 3, the least recently used chunk no hint names.
  Put(6);  // Then 4.
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kNone);
  EXPECT_EQ(store_->Locate(Id(4)), Tier::kNone);
  // Withdrawn: plain LRU again.
  ASSERT_TRUE(store_->Hint("sched", {}).ok());
  Put(7);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  std::vector<ChunkId> evicted;
  for (const ChunkEvent& e : Events()) {
    if (e.kind == ChunkEventKind::kEvicted) evicted.push_back(e.id);
  }
  EXPECT_EQ(evicted, (std::vector<ChunkId>{Id(3), Id(4), Id(1)}));
}

TEST_F(TieredStoreHintTest, PrefixLruEvictsAChainFromItsTailLruFromItsHead) {
  for (EvictionPolicyKind kind : {EvictionPolicyKind::kLru, EvictionPolicyKind::kPrefixLru}) {
    Open(Options(WriteMode::kRamOnly, kind));
    PutChain(1, 4);
    Put(10);
    const bool prefix = kind == EvictionPolicyKind::kPrefixLru;
    EXPECT_EQ(store_->Locate(Id(1)), prefix ? Tier::kRam : Tier::kNone) << EvictionPolicyName(kind);
    EXPECT_EQ(store_->Locate(Id(4)), prefix ? Tier::kNone : Tier::kRam) << EvictionPolicyName(kind);
    ASSERT_TRUE(store_->Clear(ns_).ok());
  }
}

TEST_F(TieredStoreHintTest, LineageSurvivesTheSsdAndARestart) {
  TieredStoreOptions o = Options(WriteMode::kWriteThrough, EvictionPolicyKind::kPrefixLru);
  o.ssd.capacity_bytes = 4 * kChunk;  // The SSD tier holds four chunks too.
  Open(o);
  PutChain(1, 4);
  ASSERT_TRUE(store_->Close().ok());
  Open(o);  // The SSD policy is rebuilt from the rows' lineage.
  Put(10);  // The SSD tier evicts the chain's tail, not its head.
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(4)), Tier::kNone);
  auto view = store_->Read(Id(1));
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->meta().lineage.position, 0u);
  auto second = store_->Read(Id(2));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->meta().lineage.position, 1u);
  EXPECT_TRUE(second->meta().lineage.has_parent);
  EXPECT_EQ(second->meta().lineage.parent, Id(1).key);
}

TEST_F(TieredStoreHintTest, StoresEvictionsAndDeletesAreEvents) {
  Open(Options(WriteMode::kRamOnly));
  const uint64_t start = events_.last_sequence();
  for (uint64_t n = 1; n <= 5; ++n) Put(n);
  ASSERT_TRUE(store_->Delete(Id(5)).ok());
  ASSERT_TRUE(store_->Clear(ns_).ok());
  std::vector<std::pair<ChunkEventKind, ChunkId>> got;
  for (const ChunkEvent& e : Events(start)) got.emplace_back(e.kind, e.id);
  const ChunkId whole{ns_, ChunkKey{}};
  EXPECT_EQ(got, (std::vector<std::pair<ChunkEventKind, ChunkId>>{
                     {ChunkEventKind::kStored, Id(1)},
                     {ChunkEventKind::kStored, Id(2)},
                     {ChunkEventKind::kStored, Id(3)},
                     {ChunkEventKind::kStored, Id(4)},
                     {ChunkEventKind::kEvicted, Id(1)},
                     {ChunkEventKind::kStored, Id(5)},
                     {ChunkEventKind::kDeleted, Id(5)},
                     {ChunkEventKind::kDeleted, whole}}));
}

}  // namespace
}  // namespace kvtier
