// HintedPolicy: wraps a tier's eviction policy so that eviction spares the chunks
// schedulers said they will need (HintWindow): the victim is the inner policy's choice
// among chunks no hint mentions; only when none of those can go is a hinted chunk
// evicted, the one needed last (farthest in the window) first. A hinted chunk that the
// inner policy offered and that was passed over counts as touched (it is about to be
// used), so a pick walks past each hinted chunk once, not on every eviction.
//
// Thread-safety: not thread-safe (see EvictionPolicy); the window is read through its
// lock-free snapshot.
#ifndef KVTIER_STORAGE_HINTED_POLICY_H_
#define KVTIER_STORAGE_HINTED_POLICY_H_

#include <memory>

#include "storage/eviction_policy.h"
#include "storage/hint_window.h"

namespace kvtier {

class HintedPolicy final : public EvictionPolicy {
 public:
  // `window` is not owned and must outlive the policy.
  HintedPolicy(std::unique_ptr<EvictionPolicy> inner, HintWindow* window)
      : inner_(std::move(inner)), window_(window) {}

  using EvictionPolicy::OnInsert;
  void OnInsert(const ChunkId& id, const ChunkLineage& lineage) override {
    inner_->OnInsert(id, lineage);
  }
  void OnAccess(const ChunkId& id) override { inner_->OnAccess(id); }
  void OnRemove(const ChunkId& id) override { inner_->OnRemove(id); }
  std::optional<ChunkId> PickVictim(
      absl::FunctionRef<bool(const ChunkId&)> evictable) override;
  size_t size() const override { return inner_->size(); }

 private:
  const std::unique_ptr<EvictionPolicy> inner_;
  HintWindow* const window_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_HINTED_POLICY_H_
