#include "storage/hint_window.h"

#include <algorithm>
#include <limits>
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

HintWindow::Cut HintWindow::CutHint(const std::vector<Request>& requests,
                                    size_t max_chunks) const {
  Cut cut;
  size_t keys = 0;
  for (const Request& r : requests) keys += r.keys.size();
  auto own = std::make_shared<Snapshot>();
  own->position.reserve(std::min<size_t>(keys, options_.max_keys));
  uint64_t bytes = 0;
  for (const Request& r : requests) {
    bool whole = true;
    for (const ChunkKey& key : r.keys) {
      const ChunkId id{r.ns, key};
      const bool is_new = !own->position.contains(id);
      if (cut.accepted.keys == options_.max_keys ||
          (is_new && (bytes + r.chunk_bytes > options_.max_bytes ||
                      own->by_rank.size() == max_chunks))) {
        whole = false;
        break;
      }
      ++cut.accepted.keys;
      if (is_new) {
        own->position.emplace(id, static_cast<uint32_t>(own->by_rank.size()));
        own->by_rank.push_back(id);
        cut.chunk_bytes.push_back(r.chunk_bytes);
        bytes += r.chunk_bytes;
      }
    }
    if (!whole) {
      cut.accepted.truncated = true;
      break;
    }
    ++cut.accepted.requests;
  }
  cut.accepted.window = std::move(own);
  return cut;
}

absl::StatusOr<HintWindow::Accepted> HintWindow::Set(const std::string& client,
                                                     const std::vector<Request>& requests,
                                                     const std::string& group) {
  // The client's own window, built here, outside the lock: it is the merged snapshot
  // too while this client is the only one.
  Cut cut = CutHint(requests, std::numeric_limits<size_t>::max());
  const size_t chunks = cut.accepted.window->by_rank.size();
  size_t kept = chunks;
  {
    absl::MutexLock lock(&mu_);
    DropExpiredLocked();
    auto it = clients_.find(client);
    if (chunks == 0) {
      if (it != clients_.end()) {
        clients_.erase(it);
        RebuildLocked();
      }
      return std::move(cut.accepted);
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
    it->second.window = cut.accepted.window;
    it->second.chunk_bytes = std::move(cut.chunk_bytes);
    it->second.updated = options_.now();
    oldest_update_ = absl::InfiniteFuture();
    for (const auto& [name, h] : clients_) oldest_update_ = std::min(oldest_update_, h.updated);
    RebuildLocked();
    kept = it->second.kept;
  }
  if (kept == chunks) return std::move(cut.accepted);
  // Other clients' nearer chunks filled the merged window first: answer with what of
  // this hint is in it (its first `kept` distinct chunks), so that `truncated` and the
  // counts are true of the window eviction and prefetch use.
  Cut in_window = CutHint(requests, kept);
  in_window.accepted.truncated = true;
  return std::move(in_window.accepted);
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
    // One hint is already within max_bytes (CutHint).
    ClientHint& only = clients_.begin()->second;
    only.kept = only.window->by_rank.size();
    snapshot_ = only.window;
    return;
  }
  auto snap = std::make_shared<Snapshot>();
  size_t total = 0;
  for (const auto& [name, h] : clients_) total += h.window->by_rank.size();
  snap->position.reserve(total);
  snap->by_rank.reserve(total);
  // Order clients by arrival so that equal ranks break the same way every time.
  std::vector<ClientHint*> hints;
  for (auto& [name, h] : clients_) hints.push_back(&h);
  std::sort(hints.begin(), hints.end(),
            [](const ClientHint* a, const ClientHint* b) { return a->order < b->order; });
  // Interleave by rank: every client's rank-0 chunk, then rank 1, and so on, until the
  // next new chunk would take the merged window past max_bytes. The window stops there,
  // not at the next chunk that would still fit: so what each client keeps is a prefix
  // of its queue (its nearest chunks), and every chunk of a lower rank than the cut is in.
  size_t longest = 0;
  for (const ClientHint* h : hints) longest = std::max(longest, h->window->by_rank.size());
  uint64_t bytes = 0;
  // Where the window stopped: at rank `cut_rank` of hints[cut_client] (none: all fit).
  size_t cut_rank = longest;
  size_t cut_client = 0;
  for (size_t r = 0; r < longest && cut_rank == longest; ++r) {
    for (size_t c = 0; c < hints.size(); ++c) {
      const ClientHint& h = *hints[c];
      const std::vector<ChunkId>& w = h.window->by_rank;
      if (r >= w.size() || snap->position.contains(w[r])) continue;
      if (bytes + h.chunk_bytes[r] > options_.max_bytes) {
        cut_rank = r;
        cut_client = c;
        break;
      }
      bytes += h.chunk_bytes[r];
      snap->position.emplace(w[r], static_cast<uint32_t>(snap->by_rank.size()));
      snap->by_rank.push_back(w[r]);
    }
  }
  for (size_t c = 0; c < hints.size(); ++c) {
    // Clients before the one cut got their chunk of the cut rank in; the others did not.
    const size_t reached = cut_rank == longest ? longest : cut_rank + (c < cut_client ? 1 : 0);
    hints[c]->kept = std::min(hints[c]->window->by_rank.size(), reached);
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
