// LruPolicy: least recently used first. O(1) insert, access and remove; PickVictim walks
// from the cold end past chunks the tier cannot evict (pinned, being read, dirty).
//
// Thread-safety: not thread-safe (see EvictionPolicy).
#ifndef KVTIER_STORAGE_LRU_POLICY_H_
#define KVTIER_STORAGE_LRU_POLICY_H_

#include <list>

#include "absl/container/flat_hash_map.h"
#include "storage/eviction_policy.h"

namespace kvtier {

class LruPolicy final : public EvictionPolicy {
 public:
  using EvictionPolicy::OnInsert;
  void OnInsert(const ChunkId& id, const ChunkLineage& lineage) override;
  void OnAccess(const ChunkId& id) override;
  void OnRemove(const ChunkId& id) override;
  std::optional<ChunkId> PickVictim(
      absl::FunctionRef<bool(const ChunkId&)> evictable) override;
  size_t size() const override { return order_.size(); }

 private:
  std::list<ChunkId> order_;  // Front: most recently used.
  absl::flat_hash_map<ChunkId, std::list<ChunkId>::iterator> where_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_LRU_POLICY_H_
