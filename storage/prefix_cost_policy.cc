#include "storage/prefix_cost_policy.h"

namespace kvtier {

void PrefixCostPolicy::Touch(const ChunkId& id, Entry& e) {
  const Rank old = e.rank();
  all_.erase(old);
  const bool leaf = e.children == 0;
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
  e.generation = ++generations_;
  if (lineage.position != ChunkLineage::kUnknownPosition) {
    e.cost_bonus = options_.cost_weight * options_.cost_slope * lineage.position;
  }
  if (lineage.has_parent) {
    const ChunkId parent{id.ns, lineage.parent};
    // `id` itself is not tracked yet, so a chunk naming itself finds no parent.
    if (auto p = entries_.find(parent); p != entries_.end()) {
      Entry& pe = p->second;
      if (pe.children++ == 0) leaves_.erase(pe.rank());
      e.linked = true;
      e.parent = parent;
      e.parent_generation = pe.generation;
    }
  }
  Entry& placed = entries_.emplace(id, e).first->second;
  // Not yet in either set: Touch's erase of the default rank finds nothing.
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
  if (e.children == 0) leaves_.erase(e.rank());
  if (!e.linked) return;
  auto p = entries_.find(e.parent);
  if (p == entries_.end() || p->second.generation != e.parent_generation) return;
  Entry& pe = p->second;
  if (--pe.children == 0) leaves_.insert({pe.priority, pe.seq, e.parent});
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
  auto it = entries_.find(id);
  return it == entries_.end() ? 0 : it->second.children;
}

}  // namespace kvtier
