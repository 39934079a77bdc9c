// HintWindow: what schedulers said they will run next (the Hint RPC), merged into one
// look-ahead window that eviction and prefetch read.
//
// Each client's hint is its queue: requests in the order they will run, each the chunk
// keys of one request from chunk 0. A new hint from a client replaces its previous one;
// an empty one withdraws it; a hint not renewed within `ttl` is dropped (a scheduler that
// died must not pin the window). A client's hint is taken in queue order until its
// distinct chunks would exceed `max_bytes` or `max_keys` keys; the rest is cut.
//
// A chunk's rank is its position among its client's accepted distinct keys (0 = needed
// first); across clients the nearest rank wins. The merged window of all clients holds at
// most `max_bytes` (the RAM the daemon can spare for it): it takes every client's rank-0
// chunk, then rank 1, and so on, and stops at the first chunk that would not fit. A
// client's answer says what of its hint is in that window; the part past it is cut
// (`truncated`) and neither spared by eviction nor prefetched. A later client's nearer
// chunks can push an earlier client's farther ones out of the window (until they go);
// the earlier client's next hint says so. Readers get an immutable Snapshot,
// rebuilt on every change, so that a tier's eviction consults it without a lock.
//
// Thread-safety: every method is thread-safe. Lock order: a tier's lock may be held
// while calling snapshot(); this class calls out to nothing.
#ifndef KVTIER_STORAGE_HINT_WINDOW_H_
#define KVTIER_STORAGE_HINT_WINDOW_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/chunk_id.h"

namespace kvtier {

struct HintWindowOptions {
  uint64_t max_bytes = 512ull << 20;  // Distinct chunk bytes the merged window may hold.
  uint32_t max_keys = 65536;          // Keys of one client's hint past which it is cut.
  uint32_t max_clients = 64;          // Clients with a live hint.
  absl::Duration ttl = absl::Seconds(60);  // A hint not renewed for this long is dropped.
  std::function<absl::Time()> now = [] { return absl::Now(); };

  absl::Status Validate() const;
};

class HintWindow {
 public:
  struct Request {
    uint64_t ns = 0;
    uint64_t chunk_bytes = 0;  // The namespace's chunk size.
    std::vector<ChunkKey> keys;
  };
  // A window: `by_rank` lists its chunks, nearest first; `position` maps a chunk to its
  // index there. The merged one takes each client's rank-0 chunk, then rank 1, and so on.
  struct Snapshot {
    absl::flat_hash_map<ChunkId, uint32_t> position;
    std::vector<ChunkId> by_rank;
  };
  // What of a client's hint is in the merged window, as Set left it.
  struct Accepted {
    uint32_t requests = 0;  // Leading requests taken whole.
    uint32_t keys = 0;      // Keys taken (a cut request's leading keys included).
    bool truncated = false;
    std::shared_ptr<const Snapshot> window;  // The client's part: its distinct chunks.
  };

  explicit HintWindow(HintWindowOptions options);

  // Replaces `client`'s hint. `group` is whose client it is (a tenant): when
  // max_clients hold live hints, a new client of a group holding fewer than its equal
  // share (max_clients over the groups with hints, its own included) takes the place of
  // the least recently renewed client of the group holding the most, if that is over its
  // share; so one group cannot keep another's schedulers out. Returns: Ok,
  // ResourceExhausted (the window is full and `group` holds its share or more, or no
  // group holds more than its share; hints not renewed expire after ttl).
  absl::StatusOr<Accepted> Set(const std::string& client, const std::vector<Request>& requests,
                               const std::string& group = "");
  // The merged window now (dropping hints past their ttl first).
  std::shared_ptr<const Snapshot> snapshot();
  size_t clients() const;

 private:
  struct ClientHint {
    std::shared_ptr<const Snapshot> window;  // Cut to max_bytes and max_keys alone.
    std::vector<uint64_t> chunk_bytes;       // Of window->by_rank[i].
    size_t kept = 0;  // Leading chunks of `window` in the merged one (RebuildLocked).
    absl::Time updated;
    uint64_t order = 0;           // Arrival order of the client's first hint: ties.
    std::string group;
  };
  // Makes room for a new client of `group` in a full window by dropping another group's
  // least recently renewed client (see Set). Returns false if `group` may not have it.
  // A client's hint cut at max_keys keys, max_bytes of distinct chunks and `max_chunks`
  // distinct chunks, in queue order.
  struct Cut {
    Accepted accepted;
    std::vector<uint64_t> chunk_bytes;  // Of accepted.window->by_rank[i].
  };
  Cut CutHint(const std::vector<Request>& requests, size_t max_chunks) const;
  bool TakeFairShareLocked(const std::string& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropExpiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RebuildLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const HintWindowOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, ClientHint> clients_ ABSL_GUARDED_BY(mu_);
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  // The least recently renewed live hint's time (InfiniteFuture with none).
  absl::Time oldest_update_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::shared_ptr<const Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_HINT_WINDOW_H_
