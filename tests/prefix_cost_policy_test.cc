// PrefixCostPolicy: leaves of key chains go first, recency among them, position bought
// with cost weight, fallback to inner chunks, link bookkeeping across removal and
// re-insert; and a randomized comparison against a brute-force model of the same rules.
#include "storage/prefix_cost_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "storage/eviction_policies.h"

namespace kvtier {
namespace {

ChunkId Id(uint64_t n, uint64_t ns = 1) { return ChunkId{ns, ChunkKey{n, ~n}}; }
ChunkLineage Child(uint64_t parent, uint32_t position) {
  return ChunkLineage{position, true, Id(parent).key};
}
ChunkLineage Root() { return ChunkLineage{0, false, {}}; }
bool Any(const ChunkId&) { return true; }

PrefixCostOptions NoCost() { return PrefixCostOptions{0.1, 0}; }

TEST(PrefixCostPolicy, AChainIsEatenFromItsTail) {
  PrefixCostPolicy p(NoCost());
  p.OnInsert(Id(1), Root());
  p.OnInsert(Id(2), Child(1, 1));
  p.OnInsert(Id(3), Child(2, 2));
  EXPECT_EQ(p.children(Id(1)), 1u);
  // Chunk 1 is the least recently used, but evicting it would strand 2 and 3.
  EXPECT_EQ(p.PickVictim(Any), Id(3));
  p.OnRemove(Id(3));
  EXPECT_EQ(p.PickVictim(Any), Id(2));
  p.OnRemove(Id(2));
  EXPECT_EQ(p.PickVictim(Any), Id(1));
  p.OnRemove(Id(1));
  EXPECT_FALSE(p.PickVictim(Any).has_value());
  EXPECT_EQ(p.size(), 0u);
}

TEST(PrefixCostPolicy, AmongLeavesTheLeastRecentlyUsedGoesFirst) {
  PrefixCostPolicy p(NoCost());
  p.OnInsert(Id(1), Root());
  p.OnInsert(Id(2), Child(1, 1));  // Leaf of chain one.
  p.OnInsert(Id(10), Root());      // A lone chunk: a leaf, newer than 2.
  EXPECT_EQ(p.PickVictim(Any), Id(2));
  p.OnAccess(Id(2));
  EXPECT_EQ(p.PickVictim(Any), Id(10));
  // A re-put of a tracked chunk is an access.
  p.OnInsert(Id(10), Root());
  EXPECT_EQ(p.PickVictim(Any), Id(2));
}

TEST(PrefixCostPolicy, InnerChunksGoOnlyWhenNoLeafCan) {
  PrefixCostPolicy p(NoCost());
  p.OnInsert(Id(1), Root());
  p.OnInsert(Id(2), Child(1, 1));
  p.OnInsert(Id(3), Child(2, 2));
  auto not3 = [](const ChunkId& id) { return !(id == Id(3)); };
  EXPECT_EQ(p.PickVictim(not3), Id(1));  // The oldest inner chunk.
  auto none = [](const ChunkId&) { return false; };
  EXPECT_FALSE(p.PickVictim(none).has_value());
}

TEST(PrefixCostPolicy, CostWeightKeepsDeepChunksLongerButNotForever) {
  // Chunk 100 sits at position 50: bonus 2 ticks * 0.1 * 50 = 10 ticks of recency.
  PrefixCostPolicy p(PrefixCostOptions{0.1, 2});
  p.OnInsert(Id(100), ChunkLineage{50, false, {}});  // Tick 1, priority 11.
  for (uint64_t i = 1; i <= 9; ++i) p.OnInsert(Id(i), Root());  // Ticks 2..10.
  EXPECT_EQ(p.PickVictim(Any), Id(1));  // Priority 2 < 11.
  for (uint64_t i = 1; i <= 9; ++i) p.OnRemove(Id(i));
  for (uint64_t i = 11; i <= 20; ++i) p.OnInsert(Id(i), Root());  // Ticks 11..20.
  // Tick 11 ties with 11 and loses on age: the deep chunk was touched first.
  EXPECT_EQ(p.PickVictim(Any), Id(100));
  // Unknown positions earn no bonus.
  PrefixCostPolicy q(PrefixCostOptions{0.1, 2});
  q.OnInsert(Id(1), ChunkLineage{});
  q.OnInsert(Id(2), Root());
  EXPECT_EQ(q.PickVictim(Any), Id(1));
}

TEST(PrefixCostPolicy, AChildInsertedBeforeItsParentCountsAndLinksStayInTheNamespace) {
  PrefixCostPolicy p(NoCost());
  p.OnInsert(Id(2), Child(1, 1));  // Parent 1 not here yet.
  p.OnInsert(Id(1), Root());
  EXPECT_EQ(p.children(Id(1)), 1u);
  EXPECT_EQ(p.PickVictim(Any), Id(2));
  // Same key bytes in another namespace are another chunk.
  p.OnInsert(Id(3, /*ns=*/2), Child(1, 1));
  EXPECT_EQ(p.children(Id(1)), 1u);
  // A chunk naming itself is no child of its own.
  p.OnInsert(Id(4), Child(4, 1));
  EXPECT_EQ(p.children(Id(4)), 0u);
}

// Write-back demotes a dirty chain A(0) <- B(1) <- C(2) tail first (the RAM policy offers
// leaves first), so the SSD tier's policy saw C, then B, then A. Links once formed only
// to a parent already present: the three were unlinked leaves, and A, the oldest with
// the smallest cost bonus, went first, stranding B and C.
TEST(PrefixCostPolicy, AChainInsertedTailFirstIsStillEatenFromItsTail) {
  PrefixCostPolicy p(PrefixCostOptions{0.1154, 16});
  p.OnInsert(Id(3), Child(2, 2));
  p.OnInsert(Id(2), Child(1, 1));
  p.OnInsert(Id(1), Root());
  EXPECT_EQ(p.PickVictim(Any), Id(3));
  p.OnRemove(Id(3));
  EXPECT_EQ(p.PickVictim(Any), Id(2));
  p.OnRemove(Id(2));
  EXPECT_EQ(p.PickVictim(Any), Id(1));
}

TEST(PrefixCostPolicy, AReinsertedParentCountsTheChildrenStillCached) {
  PrefixCostPolicy p(NoCost());
  p.OnInsert(Id(1), Root());
  p.OnInsert(Id(2), Child(1, 1));
  p.OnRemove(Id(1));  // Deleted (or evicted by fallback) with its child still here.
  EXPECT_EQ(p.children(Id(1)), 0u);  // Untracked.
  p.OnInsert(Id(1), Root());  // Put back: 2 is its child again.
  EXPECT_EQ(p.children(Id(1)), 1u);
  p.OnInsert(Id(3), Child(1, 1));
  EXPECT_EQ(p.children(Id(1)), 2u);
  p.OnRemove(Id(2));
  EXPECT_EQ(p.children(Id(1)), 1u);
  EXPECT_EQ(p.PickVictim(Any), Id(3));
  p.OnRemove(Id(3));
  EXPECT_EQ(p.children(Id(1)), 0u);
  EXPECT_EQ(p.PickVictim(Any), Id(1));
}

// A client's chunk_index is not trusted with an unbounded bonus: one put at index 4e9
// once outranked every other chunk for billions of operations without being read. It
// buys at most kMaxPosition's bonus, and LRU churn then evicts it.
TEST(PrefixCostPolicy, AClaimedPositionBuysABoundedBonus) {
  PrefixCostPolicy p(PrefixCostOptions{1, 1});  // Bonus = position, in ticks.
  p.OnInsert(Id(0), ChunkLineage{4'000'000'000u, false, {}});
  constexpr int kResident = 4;
  bool evicted = false;
  uint64_t inserts = 0;
  for (uint64_t n = 1; !evicted && n < 2 * PrefixCostPolicy::kMaxPosition; ++n) {
    p.OnInsert(Id(n), Root());
    ++inserts;
    if (p.size() > kResident) {
      const std::optional<ChunkId> victim = p.PickVictim(Any);
      ASSERT_TRUE(victim.has_value());
      evicted = *victim == Id(0);
      p.OnRemove(*victim);
    }
  }
  EXPECT_TRUE(evicted);
  EXPECT_LE(inserts, PrefixCostPolicy::kMaxPosition + kResident + 1);
}

TEST(EvictionPolicies, NamesParseAndBuildTheirPolicies) {
  for (const char* name : {"lru", "prefix-lru", "prefix-cost"}) {
    auto kind = ParseEvictionPolicy(name);
    ASSERT_TRUE(kind.ok()) << name;
    EXPECT_STREQ(EvictionPolicyName(*kind), name);
  }
  auto bad = ParseEvictionPolicy("belady");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("prefix-cost"), std::string::npos);
  EvictionPolicyOptions o;
  o.prefix_cost.cost_weight = -1;
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o.prefix_cost.cost_weight = 1;
  o.prefix_cost.cost_slope = std::nan("");
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  // lru evicts the oldest chunk; prefix-lru spares a parent.
  for (auto [kind, victim] : {std::pair{EvictionPolicyKind::kLru, 1},
                              std::pair{EvictionPolicyKind::kPrefixLru, 2}}) {
    EvictionPolicyOptions opts;
    opts.kind = kind;
    auto p = MakeEvictionPolicy(opts);
    p->OnInsert(Id(1), Root());
    p->OnInsert(Id(2), Child(1, 1));
    EXPECT_EQ(p->PickVictim(Any), Id(victim)) << EvictionPolicyName(kind);
  }
}

// The same rules, by brute force: every pick scans every chunk.
class ModelPolicy {
 public:
  explicit ModelPolicy(PrefixCostOptions o) : o_(o) {}
  void Insert(const ChunkId& id, const ChunkLineage& l) {
    if (auto it = e_.find(Key(id)); it != e_.end()) return Touch(it->second);
    E e;
    e.id = id;
    e.bonus = l.position == ChunkLineage::kUnknownPosition
                  ? 0
                  : o_.cost_weight * o_.cost_slope *
                        std::min<uint32_t>(l.position, PrefixCostPolicy::kMaxPosition);
    if (l.has_parent) {
      const ChunkId parent{id.ns, l.parent};
      if (!(parent == id)) e.parent = Key(parent);
    }
    Touch(e_[Key(id)] = e);
  }
  void Access(const ChunkId& id) {
    if (auto it = e_.find(Key(id)); it != e_.end()) Touch(it->second);
  }
  void Remove(const ChunkId& id) { e_.erase(Key(id)); }
  std::optional<ChunkId> Pick(absl::FunctionRef<bool(const ChunkId&)> ok) const {
    for (bool leaves_only : {true, false}) {
      const E* best = nullptr;
      for (const auto& [k, e] : e_) {
        if (leaves_only && HasChild(k)) continue;
        if (!ok(e.id)) continue;
        if (best == nullptr || e.prio < best->prio || (e.prio == best->prio && e.seq < best->seq)) {
          best = &e;
        }
      }
      if (best != nullptr) return best->id;
    }
    return std::nullopt;
  }

 private:
  using K = std::pair<uint64_t, uint64_t>;
  struct E {
    ChunkId id;
    uint64_t seq = 0;
    double bonus = 0, prio = 0;
    std::optional<K> parent;  // Whether tracked or not.
  };
  static K Key(const ChunkId& id) { return {id.ns, id.key.hi}; }
  void Touch(E& e) {
    e.seq = ++tick_;
    e.prio = static_cast<double>(e.seq) + e.bonus;
  }
  // A leaf has no tracked chunk naming it as its parent.
  bool HasChild(const K& k) const {
    for (const auto& [ck, c] : e_) {
      if (c.parent == k) return true;
    }
    return false;
  }
  PrefixCostOptions o_;
  uint64_t tick_ = 0;
  std::map<K, E> e_;
};

TEST(PrefixCostPolicy, MatchesABruteForceModelUnderRandomOperations) {
  for (double weight : {0.0, 3.0}) {
    const PrefixCostOptions o{0.25, weight};
    PrefixCostPolicy p(o);
    ModelPolicy m(o);
    std::mt19937_64 rng(weight == 0 ? 7 : 8);
    auto id_of = [](uint64_t n) { return Id(n, 1 + n % 2); };
    for (int step = 0; step < 20000; ++step) {
      const uint64_t n = rng() % 64;
      const int op = static_cast<int>(rng() % 10);
      if (op < 4) {
        ChunkLineage l;
        if (rng() % 4 != 0) {
          const uint64_t parent = rng() % 64;
          l = ChunkLineage{static_cast<uint32_t>(rng() % 40), true, id_of(parent).key};
        }
        p.OnInsert(id_of(n), l);
        m.Insert(id_of(n), l);
      } else if (op < 7) {
        p.OnAccess(id_of(n));
        m.Access(id_of(n));
      } else if (op < 9) {
        const uint64_t skip = rng() % 64;
        auto ok = [&](const ChunkId& id) { return !(id == id_of(skip)); };
        const auto want = m.Pick(ok);
        ASSERT_EQ(p.PickVictim(ok), want) << "step " << step;
        if (want.has_value() && rng() % 2 == 0) {
          p.OnRemove(*want);
          m.Remove(*want);
        }
      } else {
        p.OnRemove(id_of(n));
        m.Remove(id_of(n));
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
