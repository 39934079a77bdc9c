// EventLog: a bounded ring of chunk events (stored, promoted, evicted, deleted) with
// daemon-wide sequence numbers, for KV-aware routers (the Events RPC). Writers append
// from the tiers' hot paths; each subscriber only keeps a cursor, so memory is the
// ring's whatever the number or speed of subscribers. A subscriber that falls more
// than `capacity` events behind finds a gap and is told to resync.
//
// Thread-safety: every method is thread-safe. Wake-ups run on the log's own notifier
// thread, so an append (on a put's or a flush's thread) costs the same whatever the
// number of subscribers; a wake-up must not append.
#ifndef KVTIER_STORAGE_EVENT_LOG_H_
#define KVTIER_STORAGE_EVENT_LOG_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "storage/chunk_id.h"

namespace kvtier {

// Values match kvtier.v1.ChunkEventKind.
enum class ChunkEventKind { kStored = 1, kPromoted = 2, kEvicted = 3, kDeleted = 4 };

struct ChunkEvent {
  uint64_t sequence = 0;
  ChunkEventKind kind = ChunkEventKind::kStored;
  ChunkId id;            // A zero key with kDeleted: the whole namespace (Clear).
  Tier tier = Tier::kNone;
};

class EventLog {
 public:
  // A cursor past any sequence: Read treats it as stale (a gap).
  static constexpr uint64_t kStaleCursor = UINT64_MAX;

  // `instance_id` names this run of the daemon: sequences restart with each run, so a
  // subscriber keeps (instance_id, sequence) and resyncs when the instance changes.
  explicit EventLog(size_t capacity, uint64_t instance_id = 0);
  // Joins the notifier; wake-ups not run yet are dropped.
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;
  uint64_t instance_id() const { return instance_id_; }

  void Append(ChunkEventKind kind, const ChunkId& id, Tier tier);

  struct ReadResult {
    std::vector<ChunkEvent> events;  // Sequence order.
    // Events after `after` were overwritten before this read: the first one returned
    // (or the next to come) is `first_kept`, not after + 1.
    bool gap = false;
    uint64_t first_kept = 0;
    // Where the next Read should start (the last sequence this read looked at).
    uint64_t next_after = 0;
    bool closed = false;  // Close() was called: no more events will come.
  };
  // Up to `max` events with sequence > `after`, of namespace `ns` (0: all). An `after`
  // beyond the last sequence (a cursor from before a restart) is a gap too.
  ReadResult Read(uint64_t after, uint64_t ns, size_t max) const;
  uint64_t last_sequence() const;

  // Runs `wake` once (on the notifier thread), as soon as the last sequence exceeds
  // `after`. Returns a handle for CancelWake, or 0 without keeping `wake` when it
  // already does (read again instead).
  uint64_t WakeAfter(uint64_t after, std::function<void()> wake);
  // Forgets a pending wake. False when it already ran, runs or is about to.
  bool CancelWake(uint64_t handle);
  // At shutdown: runs every pending wake (soon, on the notifier); Reads say `closed`
  // and WakeAfter returns 0 from now on, so subscribers end their calls instead of
  // waiting for events.
  void Close();
  size_t capacity() const { return capacity_; }

 private:
  const size_t capacity_;
  const uint64_t instance_id_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<ChunkEvent> ring_ ABSL_GUARDED_BY(mu_);  // Sequence s at (s - 1) % size.
  uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_wake_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::function<void()>> wakes_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> ready_ ABSL_GUARDED_BY(mu_);  // For the notifier.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread notifier_;  // Last: started after the state above exists.

  void ReadyAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Notify();  // The notifier thread's loop.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_EVENT_LOG_H_
