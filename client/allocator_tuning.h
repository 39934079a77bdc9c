// The client process's allocator, tuned for bulk transfers over gRPC.
//
// gRPC reads a Get's bytes into buffers it mallocs per read and frees once the frame is
// consumed. Under glibc, a thread other than the main one allocates from an arena that
// gives the top of its heap back to the kernel as soon as it is free, so every frame
// maps fresh pages and faults them in again while the kernel copies the bytes in. On the
// VMs we measured, that cost the client 2-5 CPU-seconds per GB received and capped a
// 1-client Get of 2 MiB chunks at 0.4-0.6 GB/s (bench/RESULTS.md, optimisation log).
// Keeping a pad of free memory at the top of each arena (glibc's M_TOP_PAD) ends it.
//
// This is process-wide, so it is done at most once per process (by KvTierClient::Connect
// unless ClientOptions::malloc_top_pad_bytes is 0) and never when the process's
// environment already tunes glibc's malloc (GLIBC_TUNABLES naming glibc.malloc.*):
// the operator's choice wins. Setting the pad also fixes glibc's mmap threshold at its
// current value instead of letting it grow with freed blocks; so the threshold is set to
// the ceiling glibc's own adaptation reaches on 64-bit (32 MiB) at the same time.
#ifndef KVTIER_CLIENT_ALLOCATOR_TUNING_H_
#define KVTIER_CLIENT_ALLOCATOR_TUNING_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvtier {

enum class AllocatorTuning {
  kApplied,          // This call set the pad.
  kDisabled,         // top_pad_bytes is 0; nothing changed.
  kAlreadyApplied,   // An earlier call in this process did (its pad stays).
  kLeftToOperator,   // GLIBC_TUNABLES tunes malloc; nothing changed.
  kNotGlibc,         // Built against another C library; nothing changed.
  kFailed,           // mallopt refused (the threshold may have been set).
};

// Sets glibc's top pad to `top_pad_bytes` (and the mmap threshold as above), the first
// time it is called in the process with top_pad_bytes > 0. `glibc_tunables` is the
// process's GLIBC_TUNABLES (pass getenv's result, or "" when unset).
AllocatorTuning TuneAllocatorForTransfers(uint64_t top_pad_bytes,
                                          absl::string_view glibc_tunables);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_ALLOCATOR_TUNING_H_
