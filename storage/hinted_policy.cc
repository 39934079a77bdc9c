#include "storage/hinted_policy.h"

namespace kvtier {

std::optional<ChunkId> HintedPolicy::PickVictim(
    absl::FunctionRef<bool(const ChunkId&)> evictable) {
  const std::shared_ptr<const HintWindow::Snapshot> hints = window_->snapshot();
  if (hints->by_rank.empty()) return inner_->PickVictim(evictable);
  std::optional<ChunkId> victim = inner_->PickVictim(
      [&](const ChunkId& id) { return !hints->rank.contains(id) && evictable(id); });
  if (victim) return victim;
  // Every unhinted chunk is held (or there is none): the hinted one needed last. The
  // tier's `evictable` also says whether it holds the chunk at all.
  for (auto it = hints->by_rank.rbegin(); it != hints->by_rank.rend(); ++it) {
    if (evictable(*it)) return *it;
  }
  return std::nullopt;
}

}  // namespace kvtier
