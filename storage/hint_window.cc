#include "storage/hint_window.h"

#include <algorithm>
#include <utility>

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

bool HintWindow::TakeFairShareLocked(const std::string& group) {
  absl::flat_hash_map<std::string, size_t> held;
  for (const auto& [name, h] : clients_) ++held[h.group];
  const size_t groups = held.size() + (held.contains(group) ? 0 : 1);
  const size_t share = std::max<size_t>(1, options_.max_clients / groups);
  if (held[group] >= share) return false;
  const std::string* most = nullptr;
  size_t most_held = share;
  for (const auto& [g, n] : held) {
    if (n > most_held) {
      most = &g;
      most_held = n;
    }
  }
  if (most == nullptr) return false;
  auto victim = clients_.end();
  for (auto it = clients_.begin(); it != clients_.end(); ++it) {
    if (it->second.group != *most) continue;
    if (victim == clients_.end() || it->second.updated < victim->second.updated ||
        (it->second.updated == victim->second.updated &&
         it->second.order < victim->second.order)) {
      victim = it;
    }
  }
  clients_.erase(victim);
  return true;
}

absl::StatusOr<HintWindow::Accepted> HintWindow::Set(const std::string& client,
                                                     const std::vector<Request>& requests,
                                                     const std::string& group) {
  Accepted out;
  size_t keys = 0;
  for (const Request& r : requests) keys += r.keys.size();
  // The client's own window, built here, outside the lock: it is the merged snapshot
  // too while this client is the only one.
  auto own = std::make_shared<Snapshot>();
  own->position.reserve(std::min<size_t>(keys, options_.max_keys));
  uint64_t bytes = 0;
  for (const Request& r : requests) {
    bool whole = true;
    for (const ChunkKey& key : r.keys) {
      const ChunkId id{r.ns, key};
      const bool is_new = !own->position.contains(id);
      if (out.keys == options_.max_keys ||
          (is_new && bytes + r.chunk_bytes > options_.max_bytes)) {
        whole = false;
        break;
      }
      ++out.keys;
      if (is_new) {
        own->position.emplace(id, static_cast<uint32_t>(own->by_rank.size()));
        own->by_rank.push_back(id);
        bytes += r.chunk_bytes;
      }
    }
    if (!whole) {
      out.truncated = true;
      break;
    }
    ++out.requests;
  }
  out.window = own;
  absl::MutexLock lock(&mu_);
  DropExpiredLocked();
  auto it = clients_.find(client);
  if (own->by_rank.empty()) {
    if (it != clients_.end()) {
      clients_.erase(it);
      RebuildLocked();
    }
    return out;
  }
  if (it == clients_.end()) {
    if (clients_.size() >= options_.max_clients && !TakeFairShareLocked(group)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "hint: ", clients_.size(), " clients hold live hints (max_hint_clients), and "
          "this tenant holds its share of them or no tenant holds more than its share; a "
          "hint not renewed expires, retry later"));
    }
    it = clients_.emplace(client, ClientHint{}).first;
    it->second.order = next_order_++;
    it->second.group = group;
  }
  it->second.window = std::move(own);
  it->second.updated = options_.now();
  oldest_update_ = absl::InfiniteFuture();
  for (const auto& [name, h] : clients_) oldest_update_ = std::min(oldest_update_, h.updated);
  RebuildLocked();
  return out;
}

void HintWindow::DropExpiredLocked() {
  const absl::Time cutoff = options_.now() - options_.ttl;
  bool dropped = false;
  oldest_update_ = absl::InfiniteFuture();
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (it->second.updated <= cutoff) {
      clients_.erase(it++);
      dropped = true;
    } else {
      oldest_update_ = std::min(oldest_update_, it->second.updated);
      ++it;
    }
  }
  if (dropped) RebuildLocked();
}

void HintWindow::RebuildLocked() {
  if (clients_.empty()) {
    snapshot_ = std::make_shared<Snapshot>();
    return;
  }
  if (clients_.size() == 1) {
    snapshot_ = clients_.begin()->second.window;
    return;
  }
  auto snap = std::make_shared<Snapshot>();
  size_t total = 0;
  for (const auto& [name, h] : clients_) total += h.window->by_rank.size();
  snap->position.reserve(total);
  snap->by_rank.reserve(total);
  // Order clients by arrival so that equal ranks break the same way every time.
  std::vector<const ClientHint*> hints;
  for (const auto& [name, h] : clients_) hints.push_back(&h);
  std::sort(hints.begin(), hints.end(),
            [](const ClientHint* a, const ClientHint* b) { return a->order < b->order; });
  // Interleave by rank: every client's rank-0 chunk, then rank 1, and so on.
  size_t longest = 0;
  for (const ClientHint* h : hints) longest = std::max(longest, h->window->by_rank.size());
  for (size_t r = 0; r < longest; ++r) {
    for (const ClientHint* h : hints) {
      const std::vector<ChunkId>& w = h->window->by_rank;
      if (r >= w.size()) continue;
      const uint32_t at = static_cast<uint32_t>(snap->by_rank.size());
      if (snap->position.try_emplace(w[r], at).second) snap->by_rank.push_back(w[r]);
    }
  }
  snapshot_ = std::move(snap);
}

std::shared_ptr<const HintWindow::Snapshot> HintWindow::snapshot() {
  absl::MutexLock lock(&mu_);
  // A scheduler that died stops hinting: its window lapses here too, not only when
  // another client hints.
  if (!clients_.empty() && options_.now() - oldest_update_ >= options_.ttl) DropExpiredLocked();
  return snapshot_;
}

size_t HintWindow::clients() const {
  absl::MutexLock lock(&mu_);
  // Live ones only: a lapsed hint may not have been dropped yet (that waits for the
  // next Hint or snapshot).
  const absl::Time now = options_.now();
  return std::count_if(clients_.begin(), clients_.end(), [&](const auto& c) {
    return now - c.second.updated < options_.ttl;
  });
}

}  // namespace kvtier
