#include "storage/hint_window.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status HintWindowOptions::Validate() const {
  if (max_bytes == 0 || max_keys == 0 || max_clients == 0) {
    return absl::InvalidArgumentError(
        "hint window: max_bytes, max_keys and max_clients must be at least 1");
  }
  if (ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("hint window: ttl must be positive");
  }
  return absl::OkStatus();
}

HintWindow::HintWindow(HintWindowOptions options)
    : options_(std::move(options)), snapshot_(std::make_shared<Snapshot>()) {}

absl::StatusOr<HintWindow::Accepted> HintWindow::Set(const std::string& client,
                                                     const std::vector<Request>& requests) {
  Accepted out;
  absl::flat_hash_set<ChunkId> seen;
  uint64_t bytes = 0;
  for (const Request& r : requests) {
    bool whole = true;
    for (const ChunkKey& key : r.keys) {
      const ChunkId id{r.ns, key};
      const bool is_new = !seen.contains(id);
      if (out.keys == options_.max_keys ||
          (is_new && bytes + r.chunk_bytes > options_.max_bytes)) {
        whole = false;
        break;
      }
      ++out.keys;
      if (is_new) {
        seen.insert(id);
        bytes += r.chunk_bytes;
        out.window.push_back(id);
        out.window_bytes.push_back(r.chunk_bytes);
      }
    }
    if (!whole) {
      out.truncated = true;
      break;
    }
    ++out.requests;
  }
  absl::MutexLock lock(&mu_);
  DropExpiredLocked();
  auto it = clients_.find(client);
  if (out.window.empty()) {
    if (it != clients_.end()) {
      clients_.erase(it);
      RebuildLocked();
    }
    return out;
  }
  if (it == clients_.end()) {
    if (clients_.size() >= options_.max_clients) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "hint: ", clients_.size(), " clients hold live hints (max_hint_clients); a hint "
          "not renewed expires, retry later"));
    }
    it = clients_.emplace(client, ClientHint{}).first;
    it->second.order = next_order_++;
  }
  it->second.window = out.window;
  it->second.updated = options_.now();
  RebuildLocked();
  return out;
}

void HintWindow::DropExpiredLocked() {
  const absl::Time cutoff = options_.now() - options_.ttl;
  bool dropped = false;
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (it->second.updated <= cutoff) {
      clients_.erase(it++);
      dropped = true;
    } else {
      ++it;
    }
  }
  if (dropped) RebuildLocked();
}

void HintWindow::RebuildLocked() {
  auto snap = std::make_shared<Snapshot>();
  // Order clients by arrival so that equal ranks break the same way every time.
  std::vector<const ClientHint*> hints;
  for (const auto& [name, h] : clients_) hints.push_back(&h);
  std::sort(hints.begin(), hints.end(),
            [](const ClientHint* a, const ClientHint* b) { return a->order < b->order; });
  // Interleave by rank: every client's rank-0 chunk, then rank 1, and so on.
  size_t longest = 0;
  for (const ClientHint* h : hints) longest = std::max(longest, h->window.size());
  for (size_t r = 0; r < longest; ++r) {
    for (const ClientHint* h : hints) {
      if (r >= h->window.size()) continue;
      if (snap->rank.try_emplace(h->window[r], r).second) snap->by_rank.push_back(h->window[r]);
    }
  }
  snapshot_ = std::move(snap);
}

std::shared_ptr<const HintWindow::Snapshot> HintWindow::snapshot() const {
  absl::MutexLock lock(&mu_);
  return snapshot_;
}

size_t HintWindow::clients() const {
  absl::MutexLock lock(&mu_);
  return clients_.size();
}

}  // namespace kvtier
