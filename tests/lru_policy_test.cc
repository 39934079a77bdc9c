// LruPolicy: victim order, access refresh, removal, and skipping what the tier cannot
// evict.
#include "storage/lru_policy.h"

#include <gtest/gtest.h>

#include <deque>
#include <random>

#include "absl/container/flat_hash_set.h"

namespace kvtier {
namespace {

ChunkId Id(uint64_t n, uint64_t ns = 1) { return ChunkId{ns, ChunkKey{n, ~n}}; }

bool Any(const ChunkId&) { return true; }

TEST(LruPolicy, EmptyHasNoVictim) {
  LruPolicy lru;
  EXPECT_EQ(lru.size(), 0u);
  EXPECT_FALSE(lru.PickVictim(Any).has_value());
}

TEST(LruPolicy, VictimIsLeastRecentlyInserted) {
  LruPolicy lru;
  for (uint64_t i = 1; i <= 3; ++i) lru.OnInsert(Id(i));
  EXPECT_EQ(lru.size(), 3u);
  EXPECT_EQ(lru.PickVictim(Any), Id(1));
  // PickVictim does not remove: the tier must call OnRemove.
  EXPECT_EQ(lru.PickVictim(Any), Id(1));
  EXPECT_EQ(lru.size(), 3u);
  lru.OnRemove(Id(1));
  EXPECT_EQ(lru.PickVictim(Any), Id(2));
  lru.OnRemove(Id(2));
  EXPECT_EQ(lru.PickVictim(Any), Id(3));
  lru.OnRemove(Id(3));
  EXPECT_FALSE(lru.PickVictim(Any).has_value());
  EXPECT_EQ(lru.size(), 0u);
}

TEST(LruPolicy, AccessMakesMostRecentlyUsed) {
  LruPolicy lru;
  for (uint64_t i = 1; i <= 3; ++i) lru.OnInsert(Id(i));
  lru.OnAccess(Id(1));
  EXPECT_EQ(lru.PickVictim(Any), Id(2));
  lru.OnAccess(Id(2));
  EXPECT_EQ(lru.PickVictim(Any), Id(3));
  // Access of an unknown id is ignored and does not start tracking it.
  lru.OnAccess(Id(99));
  EXPECT_EQ(lru.size(), 3u);
}

TEST(LruPolicy, ReinsertRefreshesInsteadOfDuplicating) {
  LruPolicy lru;
  lru.OnInsert(Id(1));
  lru.OnInsert(Id(2));
  lru.OnInsert(Id(1));
  EXPECT_EQ(lru.size(), 2u);
  EXPECT_EQ(lru.PickVictim(Any), Id(2));
  lru.OnRemove(Id(2));
  lru.OnRemove(Id(1));
  EXPECT_EQ(lru.size(), 0u);
  EXPECT_FALSE(lru.PickVictim(Any).has_value());
}

TEST(LruPolicy, RemoveOfUnknownIsHarmless) {
  LruPolicy lru;
  lru.OnInsert(Id(1));
  lru.OnRemove(Id(2));
  lru.OnRemove(Id(1));
  lru.OnRemove(Id(1));
  EXPECT_EQ(lru.size(), 0u);
}

TEST(LruPolicy, SkipsWhatCannotBeEvicted) {
  LruPolicy lru;
  for (uint64_t i = 1; i <= 5; ++i) lru.OnInsert(Id(i));
  const absl::flat_hash_set<ChunkId> pinned = {Id(1), Id(2), Id(4)};
  auto evictable = [&](const ChunkId& id) { return !pinned.contains(id); };
  EXPECT_EQ(lru.PickVictim(evictable), Id(3));
  lru.OnRemove(Id(3));
  EXPECT_EQ(lru.PickVictim(evictable), Id(5));
  lru.OnRemove(Id(5));
  EXPECT_FALSE(lru.PickVictim(evictable).has_value());
  EXPECT_EQ(lru.size(), 3u);
}

TEST(LruPolicy, NamespacesAreDistinct) {
  LruPolicy lru;
  lru.OnInsert(Id(1, /*ns=*/1));
  lru.OnInsert(Id(1, /*ns=*/2));
  EXPECT_EQ(lru.size(), 2u);
  EXPECT_EQ(lru.PickVictim(Any), Id(1, 1));
}

// Against a simple model: a deque with the most recent at the back.
TEST(LruPolicy, MatchesModelUnderRandomOperations) {
  LruPolicy lru;
  std::deque<ChunkId> model;
  std::mt19937 rng(7);
  auto erase = [&](const ChunkId& id) {
    for (auto it = model.begin(); it != model.end(); ++it) {
      if (*it == id) {
        model.erase(it);
        return;
      }
    }
  };
  for (int step = 0; step < 5000; ++step) {
    const ChunkId id = Id(rng() % 40);
    switch (rng() % 4) {
      case 0:
      case 1:
        erase(id);
        model.push_back(id);
        lru.OnInsert(id);
        break;
      case 2: {
        bool known = false;
        for (const auto& m : model) known |= (m == id);
        if (known) {
          erase(id);
          model.push_back(id);
        }
        lru.OnAccess(id);
        break;
      }
      case 3:
        erase(id);
        lru.OnRemove(id);
        break;
    }
    ASSERT_EQ(lru.size(), model.size()) << "step " << step;
    auto victim = lru.PickVictim(Any);
    if (model.empty()) {
      ASSERT_FALSE(victim.has_value());
    } else {
      ASSERT_EQ(victim, model.front()) << "step " << step;
    }
  }
}

}  // namespace
}  // namespace kvtier
