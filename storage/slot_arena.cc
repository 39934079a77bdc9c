#include "storage/slot_arena.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "storage/log.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C library headers lack the name.
#endif

namespace kvtier {

absl::Status SlotArenaOptions::Validate() const {
  if (slot_bytes == 0 || slot_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ram_slot_size must be a positive multiple of 4096, got ", slot_bytes));
  }
  if (capacity_bytes < slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ram_capacity (", capacity_bytes, ") must hold at least one slot of ", slot_bytes,
        " bytes"));
  }
  if (capacity_bytes / slot_bytes > UINT32_MAX) {
    return absl::InvalidArgumentError("ram_capacity / ram_slot_size exceeds 2^32 slots");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SlotArena>> SlotArena::Create(const SlotArenaOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  const uint64_t num_slots = options.capacity_bytes / options.slot_bytes;
  const uint64_t bytes = num_slots * options.slot_bytes;
  // MAP_NORESERVE: pages become resident as chunks are written, so an idle daemon with a
  // large pool stays small; the arena still never grows past `bytes`.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ram_capacity: mmap of ", bytes, " bytes failed: ", std::strerror(errno)));
  }
  // Before anything faults a page in: pages faulted since are 2 MiB where aligned.
  if (options.huge_pages && madvise(p, bytes, MADV_HUGEPAGE) != 0) {
    LogInfo("ram_huge_pages: madvise(MADV_HUGEPAGE): ", std::strerror(errno),
            "; the pool uses 4 KiB pages");
  }
  if (options.lock_memory && mlock(p, bytes) != 0) {
    int err = errno;
    munmap(p, bytes);
    return absl::FailedPreconditionError(absl::StrCat(
        "lock_memory: mlock of ", bytes, " bytes failed: ", std::strerror(err),
        " (raise LimitMEMLOCK or turn lock_memory off)"));
  }
  std::unique_ptr<SlotArena> arena(
      new SlotArena(static_cast<char*>(p), bytes, options.slot_bytes, num_slots));
  if (options.lock_memory) {
    arena->prefaulted_ = bytes;  // mlock faulted every page in.
    arena->prefault_done_.Notify();
  } else if (options.prefault) {
    arena->prefault_thread_ = std::thread([a = arena.get()] { a->Prefault(); });
  } else {
    arena->prefault_done_.Notify();
  }
  return arena;
}

void SlotArena::Prefault() {
  // Lowest CPU priority for this thread only (Linux: a thread id is a PRIO_PROCESS who).
  setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19);
  constexpr uint64_t kStep = 16ull << 20;
  // From the lowest slots up: the free list hands those out first.
  for (uint64_t off = 0; off < mapped_bytes_ && !stop_prefault_.load(); off += kStep) {
    const uint64_t n = std::min(kStep, mapped_bytes_ - off);
    if (madvise(base_ + off, n, MADV_POPULATE_WRITE) != 0) {
      // EINVAL: a kernel older than 5.14. ENOMEM/EFAULT: no memory for the pool now; the
      // first writes will fault (and fail) the same way without the prefault.
      LogWarning("ram_prefault: stopped after ", off, " of ", mapped_bytes_,
                 " bytes: madvise(MADV_POPULATE_WRITE): ", std::strerror(errno));
      break;
    }
    prefaulted_.store(off + n, std::memory_order_relaxed);
  }
  prefault_done_.Notify();
}

void SlotArena::WaitForPrefault() { prefault_done_.WaitForNotification(); }

SlotArena::SlotArena(char* base, uint64_t mapped_bytes, uint64_t slot_bytes,
                     uint64_t num_slots)
    : base_(base), mapped_bytes_(mapped_bytes), slot_bytes_(slot_bytes), num_slots_(num_slots) {
  free_.reserve(num_slots);
  for (uint64_t i = num_slots; i > 0; --i) free_.push_back(static_cast<uint32_t>(i - 1));
}

SlotArena::~SlotArena() {
  stop_prefault_ = true;
  if (prefault_thread_.joinable()) prefault_thread_.join();
  munmap(base_, mapped_bytes_);
}

absl::StatusOr<std::vector<uint32_t>> SlotArena::Take(size_t n) {
  absl::MutexLock lock(&mu_);
  if (n > free_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host pool has ", free_.size(), " free slots, need ", n));
  }
  // The top of the free stack holds the lowest slot of the last run released (see
  // Release), so taking from the top in reverse gives ascending slots: on a fresh arena
  // one run; after churn, ascending within each released run (runs released in between
  // may interleave). Adjacent slots are one copy for the GPU's DMA (512 copies of a 32
  // MiB chunk cost it 8x its link speed) and one memcpy for the CPU.
  std::vector<uint32_t> out(free_.rbegin(), free_.rbegin() + n);
  free_.resize(free_.size() - n);
  return out;
}

void SlotArena::Release(absl::Span<const uint32_t> slots) {
  absl::MutexLock lock(&mu_);
  // Highest first, so that the next Take of as many slots gets them back in order.
  free_.insert(free_.end(), slots.rbegin(), slots.rend());
}

uint64_t SlotArena::free_slots() const {
  absl::MutexLock lock(&mu_);
  return free_.size();
}

}  // namespace kvtier
