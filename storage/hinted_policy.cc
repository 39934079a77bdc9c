#include "storage/hinted_policy.h"

#include <vector>

namespace kvtier {

std::optional<ChunkId> HintedPolicy::PickVictim(
    absl::FunctionRef<bool(const ChunkId&)> evictable) {
  const std::shared_ptr<const HintWindow::Snapshot> hints = window_->snapshot();
  if (hints->by_rank.empty()) return inner_->PickVictim(evictable);
  // Hinted chunks the inner policy offers are passed over, then touched: left where
  // they were, they would pile up at the cold end and every later pick would walk past
  // all of them again.
  std::vector<ChunkId> passed;
  std::optional<ChunkId> victim = inner_->PickVictim([&](const ChunkId& id) {
    if (hints->position.contains(id)) {
      passed.push_back(id);
      return false;
    }
    return evictable(id);
  });
  for (const ChunkId& id : passed) inner_->OnAccess(id);
  if (victim) return victim;
  // Every unhinted chunk is held (or there is none): the hinted one needed last. The
  // tier's `evictable` also says whether it holds the chunk at all.
  for (auto it = hints->by_rank.rbegin(); it != hints->by_rank.rend(); ++it) {
    if (evictable(*it)) return *it;
  }
  return std::nullopt;
}

}  // namespace kvtier
