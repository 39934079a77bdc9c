// HostPool: the host-RAM tier (L1). An index from ChunkId to the chunk's slots in a
// SlotArena, pinning, dirty tracking for write-back, and eviction through an
// EvictionPolicy. A chunk is evictable when it is clean (its bytes are on SSD, or there
// is no SSD tier), not pinned, and no reader holds it. For a put, when the policy's
// victim is dirty, Allocate does not skip it for a more recently used chunk: it fails,
// and the caller writes that victim to SSD first (TakeDirtyVictim).
//
// Thread-safety: every method is thread-safe (one mutex). Returned PoolChunk pointers
// stay valid while held, even after the chunk leaves the index.
#ifndef KVTIER_STORAGE_HOST_POOL_H_
#define KVTIER_STORAGE_HOST_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/chunk_id.h"
#include "storage/eviction_policy.h"
#include "storage/pool_chunk.h"
#include "storage/slot_arena.h"
#include "storage/storage_tier.h"

namespace kvtier {

struct HostPoolOptions {
  SlotArenaOptions arena;
  // Largest share of the pool that pinned chunks may hold, in (0, 1]. Keeps pins from
  // starving puts.
  double max_pinned_fraction = 0.5;
  // Clock for pin expiry; tests inject a fake one.
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Called (without the pool's lock) for each chunk evicted for room.
  std::function<void(const ChunkId&)> on_evict;
  // Tests only: called by Fence when it is about to wait for a write of the chunk in
  // flight (a sync point), under the pool's lock: it must not call the pool.
  std::function<void(const ChunkId&)> before_fence_wait;

  absl::Status Validate() const;
};

struct HostPoolStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;     // Slots taken, including puts in flight.
  uint64_t chunk_bytes = 0;    // Payload bytes of indexed chunks.
  uint64_t chunks = 0;
  uint64_t pinned_bytes = 0;
  uint64_t dirty_chunks = 0;
  uint64_t dirty_bytes = 0;    // Payload bytes of the dirty chunks (write-back backlog).
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t prefaulted_bytes = 0;  // SlotArena::prefaulted_bytes().
};

class HostPool final : public StorageTier {
 public:
  static absl::StatusOr<std::unique_ptr<HostPool>> Create(
      HostPoolOptions options, std::unique_ptr<EvictionPolicy> policy);
  ~HostPool();

  // What Allocate does when the policy's next victim is dirty (write-back, not yet on
  // SSD). kWriteFirst (puts, which can wait): fail, evicting nothing, so that the caller
  // writes that victim first (TakeDirtyVictim) and eviction keeps the policy's order.
  // kSkip (promotions, which are opportunistic): pass over it to the next clean one.
  enum class DirtyVictim { kWriteFirst, kSkip };
  // Space for a chunk of `size` bytes, evicting evictable chunks as needed; on failure
  // nothing is evicted. The space is not indexed until Insert. Returns: Ok,
  // ResourceExhausted (what is left is pinned, dirty or being read), InvalidArgument
  // (larger than the whole pool).
  // `spare(id)` true: `id` is not evicted for this allocation (a hinted prefetch spares
  // the hinted chunks needed no later than the one it fetches).
  absl::StatusOr<std::shared_ptr<PoolChunk>> Allocate(
      uint64_t size, DirtyVictim dirty = DirtyVictim::kSkip,
      absl::FunctionRef<bool(const ChunkId&)> spare = [](const ChunkId&) { return false; });

  // Indexes a filled chunk. Returns false (and leaves the index alone) if `id` is
  // already present: puts are idempotent.
  bool Insert(const ChunkId& id, std::shared_ptr<PoolChunk> data, const ChunkMeta& meta,
              bool dirty);

  struct Hit {
    std::shared_ptr<PoolChunk> data;
    ChunkMeta meta;
  };
  // Looks a chunk up and marks it used; counts a hit or a miss.
  std::optional<Hit> Find(const ChunkId& id);
  // StorageTier. Write copies the bytes into fresh slots (evicting clean chunks for
  // room, never a dirty one) and indexes them clean, checking their CRC32C in the same
  // pass (InvalidArgument when it is wrong); Read copies a chunk out (counting a hit, as
  // Find does) and drops a copy found corrupt. Both run `done` on the caller's thread.
  // Contains: presence without touching recency or counters.
  Tier tier() const override { return Tier::kRam; }
  Role role() const override { return Role::kLocal; }
  uint64_t capacity_bytes() const override { return arena_->capacity_bytes(); }
  // The pool bytes a chunk of `size` payload bytes takes: whole slots.
  uint64_t Footprint(uint64_t size) const { return arena_->SlotsFor(size) * arena_->slot_bytes(); }
  bool Contains(const ChunkId& id) const override;
  void Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
             WriteDone done) override;
  void Read(const ChunkId& id, SinkFor sink_for, ReadDone done) override;
  absl::StatusOr<bool> Delete(const ChunkId& id) override { return Remove(id); }
  absl::StatusOr<uint64_t> DeleteNamespace(uint64_t ns,
                                           std::vector<ChunkId>* removed = nullptr) override {
    return RemoveNamespace(ns, removed);
  }
  TierStats Stats() const override;
  // Contains for many chunks under one lock.
  std::vector<bool> ContainsMany(absl::Span<const ChunkId> ids) const override;
  // A tenant's RAM quota through the StorageTier interface: BytesOf(ns).bytes (slot
  // bytes), and ShrinkTo.
  uint64_t NamespaceQuotaBytes(const absl::flat_hash_set<uint64_t>& ns) const override {
    return BytesOf(ns).bytes;
  }
  absl::StatusOr<uint64_t> ShrinkNamespaces(const absl::flat_hash_set<uint64_t>& ns,
                                            uint64_t keep) override {
    return ShrinkTo(ns, keep);
  }
  // The chunk, without touching recency or counters: a caller that holds the returned
  // data keeps the chunk from being evicted (a lease), but reads nothing.
  std::optional<Hit> Peek(const ChunkId& id) const;

  // A bound on the pinned bytes of a group of namespaces (a tenant's pinned quota).
  struct PinBudget {
    const absl::flat_hash_set<uint64_t>* namespaces = nullptr;
    uint64_t max_bytes = 0;
    const char* quota = "pinned_quota";  // What the bound is called, in errors.
  };
  // Pins until `until` (absl::InfiniteFuture() for no expiry). A chunk pinned already
  // only has its expiry extended. Returns: Ok, NotFound, ResourceExhausted (would exceed
  // max_pinned_fraction, or `budget`: slot bytes of the budget's namespaces pinned now,
  // this chunk included, checked under the same lock as the pin).
  absl::Status Pin(const ChunkId& id, absl::Time until, const PinBudget* budget = nullptr);
  // InvalidArgument if chunks of these sizes could not be pinned together even with
  // nothing else pinned (their slots exceed max_pinned_fraction of the pool); a retry
  // can never succeed. Lets a caller refuse before it promotes or pins anything.
  absl::Status CheckPinCanFit(absl::Span<const uint64_t> chunk_bytes) const;
  // Returns true if the chunk was pinned.
  bool Unpin(const ChunkId& id);
  // Unpins every chunk of the namespaces `ns`; returns how many were pinned.
  uint64_t UnpinNamespaces(const absl::flat_hash_set<uint64_t>& ns);
  // Returns true if the chunk was indexed.
  bool Remove(const ChunkId& id);
  uint64_t RemoveNamespace(uint64_t ns, std::vector<ChunkId>* removed = nullptr);

  // Slot bytes the namespaces `ns` take in the pool, and how many of them are pinned
  // now. O(namespaces), plus the pins that expired since the last look.
  struct NamespaceBytes {
    uint64_t bytes = 0;
    uint64_t pinned = 0;
  };
  NamespaceBytes BytesOf(const absl::flat_hash_set<uint64_t>& ns) const;
  // Evicts chunks of the namespaces `ns`, in the policy's order among their clean,
  // unpinned chunks that nobody reads, until they take at most `keep` slot bytes (a
  // tenant's RAM quota). Returns the bytes they hold afterwards (more than `keep` when
  // what is left cannot be evicted yet). Evictions count and call on_evict as usual.
  uint64_t ShrinkTo(const absl::flat_hash_set<uint64_t>& ns, uint64_t keep);

  // Write-back: hands out the oldest dirty chunk not already being flushed and marks it
  // flushing. The caller writes it to SSD, then calls FinishFlush.
  // One write of a chunk is in flight at a time: a chunk put again while its previous
  // copy's write is in flight, or fenced (below), is handed out once that ends.
  struct DirtyChunk {
    ChunkId id;
    std::shared_ptr<PoolChunk> data;
    ChunkMeta meta;
    uint64_t serial = 0;  // Which copy of `id` (a put after a Delete makes another).
  };
  std::optional<DirtyChunk> TakeDirty();
  // For a demotion: the first dirty chunk among Allocate's victims (kWriteFirst) in the
  // policy's order, marked flushing like TakeDirty's. None when that chunk is being
  // flushed already (wait for the write: taking the next dirty chunk would evict it out
  // of the policy's order), is fenced, or there is none.
  std::optional<DirtyChunk> TakeDirtyVictim();
  enum class FlushEnd {
    kFinished,  // `written`: the copy is clean now; otherwise dirty, handed out again.
    kGone,      // The copy left the pool while it was written (and no other copy of
                // the chunk is there): the caller removes what it wrote, so a removed
                // chunk does not come back from SSD.
    kReplaced,  // Another copy of the chunk (put again) is there now: left as it is,
                // and so is what the caller wrote.
  };
  // Ends the write of `d` (its `data` reference dropped first).
  FlushEnd FinishFlush(const DirtyChunk& d, bool written);
  // Drops `d`'s copy, whose write failed, to make room anyway; unless it was pinned
  // since it was handed out and `even_if_pinned` is false (then it stays, dirty, to be
  // written again). Returns whether it was dropped.
  bool DropFlushing(const DirtyChunk& d, bool even_if_pinned);
  // Fences a chunk's write-back for a Delete: waits until no write of `id` is in flight
  // and hands none out (TakeDirty, TakeDirtyVictim) until Unfence. A Delete removes the
  // chunk from RAM and then from SSD under a fence, so no write lands on SSD after its
  // SSD delete (bringing the deleted chunk back, or leaving an SSD copy that a put
  // would be answered "already stored" from and that the write's clean-up then
  // deletes). Fences nest.
  void Fence(const ChunkId& id);
  void Unfence(const ChunkId& id);
  // The same for every chunk of a namespace, for a Clear.
  void FenceNamespace(uint64_t ns);
  void UnfenceNamespace(uint64_t ns);
  uint64_t dirty_count() const;
  // Payload bytes of the dirty chunks (including those being flushed).
  uint64_t dirty_bytes() const;

  HostPoolStats GetStats() const;
  // The pool's memory, for page-locking it for a GPU.
  char* memory() const { return arena_->base(); }
  uint64_t memory_bytes() const { return arena_->mapped_bytes(); }

 private:
  struct Entry {
    std::shared_ptr<PoolChunk> data;
    ChunkMeta meta;
    bool dirty = false;
    bool flushing = false;
    absl::Time pinned_until = absl::InfinitePast();
    // Counted in the pin totals below (pinned when they were last brought up to date).
    mutable bool pin_counted = false;
    uint64_t serial = 0;  // Tells this copy from the chunk's earlier and later ones.
  };

  HostPool(HostPoolOptions options, std::unique_ptr<SlotArena> arena,
           std::unique_ptr<EvictionPolicy> policy);
  bool IsPinned(const Entry& e) const { return e.pinned_until > options_.now(); }
  // Not pinned, not being read or written to SSD: evictable once clean.
  bool Reclaimable(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A victim a put may take or wait for (Allocate with kWriteFirst): not pinned, and held
  // by nobody but the index, or being flushed (the write holds it).
  bool WriteFirstCandidate(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(const ChunkId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pin totals, kept as pins come and go so that no pin or quota check walks the
  // index (a tenant's Pin of many keys would otherwise hold the pool's lock for
  // keys x chunks steps). A pin that expires by time leaves them at the next look.
  void CountPinLocked(const ChunkId& id, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UncountPinLocked(const ChunkId& id, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a counted pin's bytes off the totals (not its expiry entry).
  void SubtractPinLocked(const ChunkId& id, const Entry& e) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes pins that expired by `now` out of the totals.
  void ExpirePinsLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Slot bytes max_pinned_fraction allows pinned at once.
  uint64_t PinLimitBytes() const;
  // No write of `id` may be handed out now: one is in flight, or it is fenced.
  bool WriteHeldLocked(const ChunkId& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a write of `id` and queues again the dirty chunks held back while it ran.
  void EndWriteLocked(const ChunkId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues again the held-back dirty chunks no write is held from now.
  void RequeueDeferredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const HostPoolOptions options_;
  // Declared before the index: entries hold PoolChunks that release into the arena.
  const std::shared_ptr<SlotArena> arena_;  // Shared with the PoolChunks it hands out.
  mutable absl::Mutex mu_;
  std::unique_ptr<EvictionPolicy> policy_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ChunkId, Entry> index_ ABSL_GUARDED_BY(mu_);
  // Dirty chunks in insertion order; may hold ids that are no longer dirty (skipped).
  std::deque<ChunkId> dirty_order_ ABSL_GUARDED_BY(mu_);
  // Chunks whose SSD write is in flight (which may outlive their copy in the index).
  absl::flat_hash_set<ChunkId> writing_ ABSL_GUARDED_BY(mu_);
  // Fence counts per chunk and per namespace.
  absl::flat_hash_map<ChunkId, uint32_t> fenced_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint32_t> fenced_ns_ ABSL_GUARDED_BY(mu_);
  // Dirty chunks TakeDirty passed over while a write of them was held; queued again
  // when that ends.
  std::vector<ChunkId> deferred_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dirty_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dirty_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t chunk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Slot bytes per namespace (entries removed at zero): what a tenant's ram_quota
  // counts, so that chunks smaller than a slot cannot take the pool past it.
  absl::flat_hash_map<uint64_t, uint64_t> ns_bytes_ ABSL_GUARDED_BY(mu_);
  // Counted pins by expiry, and their totals: slot bytes (max_pinned_fraction), payload
  // bytes, and slot bytes per namespace (entries removed at zero). Mutable: taking
  // expired pins out changes no state a caller sees, as IsPinned says the same.
  mutable absl::btree_multimap<absl::Time, ChunkId> pin_expiry_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t pinned_slot_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable uint64_t pinned_payload_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable absl::flat_hash_map<uint64_t, uint64_t> ns_pinned_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_HOST_POOL_H_
