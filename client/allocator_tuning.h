// The client process's allocator, tuned for bulk transfers over gRPC.
//
// gRPC reads a Get's bytes into buffers it mallocs per read and frees once the frame is
// consumed. glibc gives the top of a malloc arena back to the kernel once the free space
// there passes its trim threshold, which a frame's worth of freed buffers does; so each
// frame maps fresh pages and faults them in again while the kernel copies the bytes in.
// That made the client, not the daemon, the limit of a Get: a 1-client Get of 2 MiB
// chunks ran at 0.36 GB/s, and 2.2 GB/s with the tuning (kv_bench RAM grid, A/B with
// --malloc-pad-mib; bench/RESULTS.md, optimisation log). Keeping a pad of free memory at
// the top of each arena (glibc's M_TOP_PAD) ends it.
//
// This is process-wide, so it is done at most once per process (by KvTierClient::Connect
// unless ClientOptions::malloc_top_pad_bytes is 0) and never when the process started
// with glibc's malloc already tuned (GLIBC_TUNABLES naming glibc.malloc.*): the
// operator's choice wins. Setting the pad also freezes glibc's mmap threshold at its
// current value (128 KiB in a fresh process) instead of letting it grow as large blocks
// are freed; so the threshold is set to the ceiling of glibc's own adaptation on 64-bit
// (32 MiB) at the same time. What the host process pays: blocks of 128 KiB to 32 MiB
// come from arenas instead of mmap (as they would anyway once glibc has adapted), and
// each arena keeps up to top_pad_bytes free at its top (glibc creates up to 8 arenas per
// core; a process uses as many as it has threads allocating at once). Fragmentation
// inside an arena is not bounded by the pad.
//
// Optionally (arena_max > 0) the same call also caps the number of arenas (glibc's
// M_ARENA_MAX), for processes that run many client threads: with an arena per thread,
// 64 client threads in one process spent 1.75x the CPU per GiB got of 4, and 2 arenas
// cut that by about 30% (kv_bench; bench/RESULTS.md, optimisation log). glibc applies
// the cap only to arenas made after it, and ignores it once the process has made more
// than 8, so it belongs before the process's threads start; KvTierClient::Connect calls
// this before it makes its channel, whose creation may start gRPC's threads.
//
// Thread-safety: thread-safe; the first call that gets past the checks wins, whether
// its mallopt succeeds or not (a failure is not retried).
#ifndef KVTIER_CLIENT_ALLOCATOR_TUNING_H_
#define KVTIER_CLIENT_ALLOCATOR_TUNING_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvtier {

enum class AllocatorTuning {
  kApplied,          // This call set the pad (and the arena cap, if asked).
  kDisabled,         // top_pad_bytes is 0; nothing changed.
  kAlreadyApplied,   // An earlier call in this process did (its pad stays).
  kLeftToOperator,   // GLIBC_TUNABLES tunes malloc; nothing changed.
  kNotGlibc,         // Built against another C library; nothing changed.
  kFailed,           // mallopt refused (the threshold, or the pad, may have been set).
};

// Sets glibc's top pad to `top_pad_bytes` (and the mmap threshold as above), and its
// arena cap to `arena_max` when that is > 0, the first time it is called in the process
// with top_pad_bytes > 0. `glibc_tunables` is the GLIBC_TUNABLES the process started
// with (StartupGlibcTunables()).
[[nodiscard]] AllocatorTuning TuneAllocatorForTransfers(uint64_t top_pad_bytes,
                                                        absl::string_view glibc_tunables,
                                                        uint32_t arena_max = 0);

// GLIBC_TUNABLES as the process started with it (from /proc/self/environ: glibc read its
// tunables then, so a value set later with setenv, or os.environ in Python, is not in
// effect and not returned); "" when it was unset or cannot be read.
std::string StartupGlibcTunables();

}  // namespace kvtier

#endif  // KVTIER_CLIENT_ALLOCATOR_TUNING_H_
