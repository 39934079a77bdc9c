#include "storage/prefix_cost_policy.h"

#include <algorithm>

namespace kvtier {

bool PrefixCostPolicy::IsLeaf(const ChunkId& id) const {
  auto it = kids_.find(id);
  return it == kids_.end() || it->second.empty();
}

void PrefixCostPolicy::Touch(const ChunkId& id, Entry& e) {
  const Rank old = e.rank();
  all_.erase(old);
  const bool leaf = IsLeaf(id);
  if (leaf) leaves_.erase(old);
  e.seq = ++tick_;
  e.priority = static_cast<double>(e.seq) + e.cost_bonus;
  all_.insert({e.priority, e.seq, id});
  if (leaf) leaves_.insert({e.priority, e.seq, id});
}

void PrefixCostPolicy::OnInsert(const ChunkId& id, const ChunkLineage& lineage) {
  if (auto it = entries_.find(id); it != entries_.end()) {
    Touch(id, it->second);  // Already tracked: a re-put is an access.
    return;
  }
  Entry e;
  if (lineage.position != ChunkLineage::kUnknownPosition) {
    e.cost_bonus = options_.cost_weight * options_.cost_slope *
                   std::min<uint32_t>(lineage.position, kMaxPosition);
  }
  if (lineage.has_parent && lineage.parent != id.key) {
    e.has_parent = true;
    e.parent = ChunkId{id.ns, lineage.parent};
    absl::flat_hash_set<ChunkId>& siblings = kids_[e.parent];
    siblings.insert(id);
    // The parent's first cached child: the parent is no longer a leaf.
    if (siblings.size() == 1) {
      if (auto p = entries_.find(e.parent); p != entries_.end()) {
        leaves_.erase(p->second.rank());
      }
    }
  }
  Entry& placed = entries_.emplace(id, e).first->second;
  // Not yet in either set: Touch's erase of the default rank finds nothing. Children
  // inserted before it (kids_[id]) make it an inner chunk at once.
  placed.seq = 0;
  placed.priority = -1;
  Touch(id, placed);
}

void PrefixCostPolicy::OnAccess(const ChunkId& id) {
  if (auto it = entries_.find(id); it != entries_.end()) Touch(id, it->second);
}

void PrefixCostPolicy::OnRemove(const ChunkId& id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  const Entry e = it->second;
  entries_.erase(it);
  all_.erase(e.rank());
  if (IsLeaf(id)) leaves_.erase(e.rank());
  // Its own children stay under kids_[id], for the chunk put back.
  if (!e.has_parent) return;
  auto k = kids_.find(e.parent);
  k->second.erase(id);
  if (!k->second.empty()) return;
  kids_.erase(k);
  if (auto p = entries_.find(e.parent); p != entries_.end()) {
    leaves_.insert({p->second.priority, p->second.seq, e.parent});
  }
}

std::optional<ChunkId> PrefixCostPolicy::PickVictim(
    absl::FunctionRef<bool(const ChunkId&)> evictable) {
  for (const Rank& r : leaves_) {
    if (evictable(r.id)) return r.id;
  }
  // No leaf can go (pinned, held, or dirty where the tier skips dirty chunks): an inner
  // chunk, which strands its descendants, is still better than failing the put.
  for (const Rank& r : all_) {
    if (evictable(r.id)) return r.id;
  }
  return std::nullopt;
}

uint32_t PrefixCostPolicy::children(const ChunkId& id) const {
  if (!entries_.contains(id)) return 0;
  auto it = kids_.find(id);
  return it == kids_.end() ? 0 : static_cast<uint32_t>(it->second.size());
}

}  // namespace kvtier
