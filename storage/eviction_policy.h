// EvictionPolicy: decides which chunk a tier gives up when it needs room. A tier owns
// one policy instance and tells it about every insert, access and removal; the policy
// never frees anything itself.
//
// Thread-safety: not thread-safe; the owning tier calls it under its own mutex.
#ifndef KVTIER_STORAGE_EVICTION_POLICY_H_
#define KVTIER_STORAGE_EVICTION_POLICY_H_

#include <optional>

#include "absl/functional/function_ref.h"
#include "storage/chunk_id.h"

namespace kvtier {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  // `lineage` is what the chunk's writer said of its place in a key chain (possibly
  // nothing); policies that do not use it ignore it.
  virtual void OnInsert(const ChunkId& id, const ChunkLineage& lineage) = 0;
  void OnInsert(const ChunkId& id) { OnInsert(id, ChunkLineage{}); }
  virtual void OnAccess(const ChunkId& id) = 0;
  virtual void OnRemove(const ChunkId& id) = 0;

  // The best victim for which `evictable` returns true, or nullopt if none is. The
  // victim stays tracked until the tier calls OnRemove.
  virtual std::optional<ChunkId> PickVictim(
      absl::FunctionRef<bool(const ChunkId&)> evictable) = 0;

  virtual size_t size() const = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_EVICTION_POLICY_H_
