#include "storage/lru_policy.h"

namespace kvtier {

void LruPolicy::OnInsert(const ChunkId& id, const ChunkLineage& /*lineage*/) {
  if (auto it = where_.find(id); it != where_.end()) {
    order_.splice(order_.begin(), order_, it->second);
    return;
  }
  order_.push_front(id);
  where_[id] = order_.begin();
}

void LruPolicy::OnAccess(const ChunkId& id) {
  if (auto it = where_.find(id); it != where_.end()) {
    order_.splice(order_.begin(), order_, it->second);
  }
}

void LruPolicy::OnRemove(const ChunkId& id) {
  if (auto it = where_.find(id); it != where_.end()) {
    order_.erase(it->second);
    where_.erase(it);
  }
}

std::optional<ChunkId> LruPolicy::PickVictim(
    absl::FunctionRef<bool(const ChunkId&)> evictable) {
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    if (evictable(*it)) return *it;
  }
  return std::nullopt;
}

}  // namespace kvtier
