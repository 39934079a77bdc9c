#include "storage/slot_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

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
  if (options.lock_memory && mlock(p, bytes) != 0) {
    int err = errno;
    munmap(p, bytes);
    return absl::FailedPreconditionError(absl::StrCat(
        "lock_memory: mlock of ", bytes, " bytes failed: ", std::strerror(err),
        " (raise LimitMEMLOCK or turn lock_memory off)"));
  }
  return std::unique_ptr<SlotArena>(
      new SlotArena(static_cast<char*>(p), bytes, options.slot_bytes, num_slots));
}

SlotArena::SlotArena(char* base, uint64_t mapped_bytes, uint64_t slot_bytes,
                     uint64_t num_slots)
    : base_(base), mapped_bytes_(mapped_bytes), slot_bytes_(slot_bytes), num_slots_(num_slots) {
  free_.reserve(num_slots);
  for (uint64_t i = num_slots; i > 0; --i) free_.push_back(static_cast<uint32_t>(i - 1));
}

SlotArena::~SlotArena() { munmap(base_, mapped_bytes_); }

absl::StatusOr<std::vector<uint32_t>> SlotArena::Take(size_t n) {
  absl::MutexLock lock(&mu_);
  if (n > free_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host pool has ", free_.size(), " free slots, need ", n));
  }
  std::vector<uint32_t> out(free_.end() - n, free_.end());
  free_.resize(free_.size() - n);
  return out;
}

void SlotArena::Release(absl::Span<const uint32_t> slots) {
  absl::MutexLock lock(&mu_);
  free_.insert(free_.end(), slots.begin(), slots.end());
}

uint64_t SlotArena::free_slots() const {
  absl::MutexLock lock(&mu_);
  return free_.size();
}

}  // namespace kvtier
