#include "client/allocator_tuning.h"

#include <atomic>
#include <fstream>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "absl/strings/match.h"

namespace kvtier {

AllocatorTuning TuneAllocatorForTransfers(uint64_t top_pad_bytes,
                                          absl::string_view glibc_tunables,
                                          uint32_t arena_max) {
#if defined(__GLIBC__)
  static std::atomic<bool> applied{false};
  if (top_pad_bytes == 0) return AllocatorTuning::kDisabled;
  if (absl::StrContains(glibc_tunables, "glibc.malloc.")) {
    return AllocatorTuning::kLeftToOperator;
  }
  if (applied.exchange(true)) return AllocatorTuning::kAlreadyApplied;
  // mallopt takes an int; Validate bounds the pad well below INT_MAX.
  constexpr int kMmapThreshold = 32 << 20;  // glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit).
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 ||
      mallopt(M_TOP_PAD, static_cast<int>(top_pad_bytes)) != 1) {
    return AllocatorTuning::kFailed;
  }
  // Validate bounds the cap well below INT_MAX too.
  if (arena_max > 0 && mallopt(M_ARENA_MAX, static_cast<int>(arena_max)) != 1) {
    return AllocatorTuning::kFailed;
  }
  return AllocatorTuning::kApplied;
#else
  (void)top_pad_bytes;
  (void)glibc_tunables;
  (void)arena_max;
  return AllocatorTuning::kNotGlibc;
#endif
}

std::string StartupGlibcTunables() {
  std::ifstream in("/proc/self/environ", std::ios::binary);
  std::string entry;
  constexpr absl::string_view kName = "GLIBC_TUNABLES=";
  while (std::getline(in, entry, '\0')) {
    if (absl::StartsWith(entry, kName)) return entry.substr(kName.size());
  }
  return "";
}

}  // namespace kvtier
