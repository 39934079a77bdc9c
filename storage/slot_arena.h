// SlotArena: the host-RAM pool's memory. One anonymous mapping made at start-up, cut into
// fixed-size slots. A chunk occupies ceil(size / slot_bytes) slots that need not be
// contiguous, so one arena serves every layout's chunk size with no per-size-class
// rebalancing, at a cost of at most one partly used slot per chunk. Memory use never
// exceeds capacity_bytes, whatever the load, because nothing else allocates chunk bytes.
//
// Thread-safety: Take and Release are thread-safe. Slot memory is owned by whoever
// took the slot; the arena never touches it.
#ifndef KVTIER_STORAGE_SLOT_ARENA_H_
#define KVTIER_STORAGE_SLOT_ARENA_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"

namespace kvtier {

struct SlotArenaOptions {
  // Total bytes of the arena; rounded down to a whole number of slots. Must hold at
  // least one slot.
  uint64_t capacity_bytes = 1ull << 30;
  // Bytes per slot; a multiple of 4096. 64 KiB: a chunk wastes less than one slot, so
  // chunks of 64 KiB and up waste at most 64 KiB each whatever their layout (with 1 MiB
  // slots a 64 KiB chunk took 16 times its size), and no per-layout size classes need
  // rebalancing. The cost is a longer slot list per chunk (2048 entries for 128 MiB) and
  // 64 KiB pieces for gets to send: no throughput difference measured against 1 MiB
  // slots (bench/RESULTS.md, optimisation log).
  uint64_t slot_bytes = 64ull << 10;
  // mlock() the arena so the kernel never swaps chunk bytes out. Needs CAP_IPC_LOCK or
  // a large enough RLIMIT_MEMLOCK; failure is a start-up error when set.
  bool lock_memory = false;
  // Fault the arena's pages in at start-up, on a background thread (lowest priority,
  // 16 MiB at a time, MADV_POPULATE_WRITE), so that puts do not pay a page fault per
  // 4 KiB of their first pass over the pool: on this project's VMs a fault costs about
  // as much as copying the page 20 times. The arena is usable meanwhile; populating a
  // page a put has already written leaves it alone. Off: pages are faulted in by the
  // first chunk written to them, and an idle daemon with a large pool stays small.
  bool prefault = false;
  // Ask for transparent huge pages on the arena (madvise MADV_HUGEPAGE; effective where
  // /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"). A 4 KiB page
  // that MADV_POPULATE_WRITE faulted in is still slow to write the first time on this
  // project's VMs (the host backs it on that write): a first pass of 2 MiB copies over a
  // prefaulted 512 MiB arena ran at 0.75 GB/s with 4 KiB pages, 19.4 GB/s with huge
  // pages (20.6 GB/s on the second pass either way). Huge pages also cut the pool's
  // page tables 512-fold and its TLB misses. A kernel without THP ignores this.
  bool huge_pages = true;

  absl::Status Validate() const;
};

class SlotArena {
 public:
  static absl::StatusOr<std::unique_ptr<SlotArena>> Create(const SlotArenaOptions& options);
  ~SlotArena();
  SlotArena(const SlotArena&) = delete;
  SlotArena& operator=(const SlotArena&) = delete;

  // Takes `n` free slots, all or none. Returns: Ok, ResourceExhausted.
  absl::StatusOr<std::vector<uint32_t>> Take(size_t n);
  void Release(absl::Span<const uint32_t> slots);

  char* SlotData(uint32_t slot) const { return base_ + uint64_t{slot} * slot_bytes_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // The whole mapping (for page-locking it for a GPU).
  char* base() const { return base_; }
  uint64_t mapped_bytes() const { return mapped_bytes_; }
  uint64_t num_slots() const { return num_slots_; }
  uint64_t capacity_bytes() const { return num_slots_ * slot_bytes_; }
  uint64_t free_slots() const;
  // Bytes the prefault thread has populated so far (capacity_bytes() once it is done,
  // and with lock_memory); 0 without prefault.
  uint64_t prefaulted_bytes() const { return prefaulted_.load(std::memory_order_relaxed); }
  // Blocks until the prefault thread has finished (at once without one).
  void WaitForPrefault();
  size_t SlotsFor(uint64_t bytes) const {
    return bytes / slot_bytes_ + (bytes % slot_bytes_ != 0);  // No overflow near 2^64.
  }

 private:
  SlotArena(char* base, uint64_t mapped_bytes, uint64_t slot_bytes, uint64_t num_slots);
  void Prefault();

  char* const base_;
  const uint64_t mapped_bytes_;
  const uint64_t slot_bytes_;
  const uint64_t num_slots_;
  mutable absl::Mutex mu_;
  // LIFO free list: recently freed slots are still warm in the page tables and caches.
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> prefaulted_{0};
  std::atomic<bool> stop_prefault_{false};
  absl::Notification prefault_done_;
  std::thread prefault_thread_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_SLOT_ARENA_H_
