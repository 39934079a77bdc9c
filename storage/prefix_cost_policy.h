// PrefixCostPolicy: eviction that knows key chains and what a miss costs to recompute.
//
// Keys are prefix-chained: chunk i is useful only while chunks 0..i-1 are cached too,
// so evicting a chain's early chunk strands the rest. The policy therefore evicts
// leaves first: a chunk none of whose cached children (chunks that named it as their
// prev_key when they were put) is still here. Chains are eaten from the tail, like a
// radix tree's leaf eviction. Among leaves (and, when no leaf is evictable, among all
// chunks) the victim is the one with the lowest priority
//
//   priority = last touch tick + cost_weight * cost_slope * position
//
// where a tick counts inserts and accesses, and 1 + cost_slope * i is what recomputing
// chunk i costs relative to chunk 0 (the Cake compute model's a + b*i over a). With
// cost_weight 0 this is a prefix-aware LRU; with a weight, a chunk deep in a chain
// (expensive to recompute) outlives a shallow one touched a little later. A chunk put
// without lineage counts as a root at position 0.
//
// A chunk counts as its parent's child whether it was inserted before or after the
// parent, and again after the parent was evicted and put back: the store's own traffic
// inserts chains out of order (write-back demotes a chain tail first, the SSD index is
// rebuilt oldest row first, a Get promotes in parallel), and a chain whose children were
// inserted first would otherwise be eaten from its head. A chunk naming itself has no
// parent; chunks naming each other in a cycle are simply not leaves.
//
// The recompute-cost bonus is bounded: positions past kMaxPosition (a 1M-token context
// in 16-token chunks) count as kMaxPosition, so a chunk_index claimed by a client buys
// at most what the deepest real chunk earns, not near-immortality.
//
// Cost: O(log n) per insert, access and removal; about 250 bytes per tracked chunk.
// Thread-safety: not thread-safe (see EvictionPolicy).
#ifndef KVTIER_STORAGE_PREFIX_COST_POLICY_H_
#define KVTIER_STORAGE_PREFIX_COST_POLICY_H_

#include <cstdint>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "storage/eviction_policy.h"

namespace kvtier {

struct PrefixCostOptions {
  // Recomputing chunk i costs 1 + cost_slope * i times chunk 0 (b / a of the compute
  // model). >= 0.
  double cost_slope = 0.1154;
  // Ticks of recency that one unit of relative recompute cost is worth. >= 0; 0 makes
  // the policy a prefix-aware LRU.
  double cost_weight = 16;
};

class PrefixCostPolicy final : public EvictionPolicy {
 public:
  explicit PrefixCostPolicy(PrefixCostOptions options) : options_(options) {}

  using EvictionPolicy::OnInsert;
  void OnInsert(const ChunkId& id, const ChunkLineage& lineage) override;
  void OnAccess(const ChunkId& id) override;
  void OnRemove(const ChunkId& id) override;
  std::optional<ChunkId> PickVictim(
      absl::FunctionRef<bool(const ChunkId&)> evictable) override;
  size_t size() const override { return entries_.size(); }

  // For tests: cached children of `id` (0 if untracked).
  uint32_t children(const ChunkId& id) const;

  static constexpr uint32_t kMaxPosition = 1u << 16;

 private:
  struct Rank {
    double priority;
    uint64_t seq;  // Unique per touch: breaks ties, oldest first.
    ChunkId id;
    bool operator<(const Rank& o) const {
      return priority != o.priority ? priority < o.priority : seq < o.seq;
    }
  };
  struct Entry {
    double priority = 0;
    uint64_t seq = 0;
    double cost_bonus = 0;  // cost_weight * cost_slope * min(position, kMaxPosition).
    bool has_parent = false;
    ChunkId parent;  // When has_parent; tracked or not.
    Rank rank() const { return {priority, seq, {}}; }
  };

  void Touch(const ChunkId& id, Entry& e);
  bool IsLeaf(const ChunkId& id) const;

  const PrefixCostOptions options_;
  uint64_t tick_ = 0;
  absl::flat_hash_map<ChunkId, Entry> entries_;
  // Tracked chunks by the parent they name (tracked or not): a chunk is a leaf when its
  // set is empty or absent. One element per tracked chunk with a parent.
  absl::flat_hash_map<ChunkId, absl::flat_hash_set<ChunkId>> kids_;
  std::set<Rank> all_;     // Every tracked chunk.
  std::set<Rank> leaves_;  // Tracked chunks no tracked chunk names as its parent.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PREFIX_COST_POLICY_H_
