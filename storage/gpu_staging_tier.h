// GpuStagingTier: the GPU staging buffers (L0). A bounded amount of device memory,
// allocated once at start-up and cut into fixed-size slots like the host pool, holding
// copies of chunks that are likely to be read next by a worker on this GPU (what a
// Lookup leased, a Get asked for, a Prefill session will stream). A worker's load is
// then a device-to-device copy instead of a trip over PCIe.
//
// Every chunk here is a copy of one in the host pool: staging never holds the only copy,
// so evicting or losing a staged chunk loses nothing and a failed copy just leaves the
// chunk unstaged. Eviction goes through an EvictionPolicy; a chunk is evictable once it
// has landed and no copy out of it is in flight.
//
// States of a staged chunk: loading (its host-to-device copy is in flight; invisible)
// -> ready (Find, CopyToDevice, CopyToHost see it) -> gone. Remove of a chunk that is
// loading or being read takes it out of the index at once; its slots go back to the free
// list when the last copy touching them completes, never while the device may still
// write or read them.
//
// Thread-safety: thread-safe (one mutex, never held while submitting copies). `done`
// callbacks run on the backend's completion thread, after the mutex is released. The
// destructor waits for copies in flight; the backend must outlive this object.
#ifndef KVTIER_STORAGE_GPU_STAGING_TIER_H_
#define KVTIER_STORAGE_GPU_STAGING_TIER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "storage/chunk_id.h"
#include "storage/device_backend.h"
#include "storage/eviction_policy.h"

namespace kvtier {

struct GpuStagingOptions {
  // Device memory for staging buffers, in bytes; rounded down to whole slots, at least
  // one. Allocated in one piece at start-up (no cudaMalloc, which synchronises the
  // device, on the request path).
  uint64_t capacity_bytes = 1ull << 30;
  // Bytes per slot; a multiple of 4096. Larger than the host pool's 64 KiB: every slot
  // boundary inside a chunk splits a copy out of it in two.
  uint64_t slot_bytes = 2ull << 20;

  absl::Status Validate() const;
};

struct GpuStagingStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;    // Slots taken, including chunks still loading.
  uint64_t chunk_bytes = 0;   // Payload bytes of ready chunks.
  uint64_t chunks = 0;        // Ready chunks.
  uint64_t loading = 0;       // Chunks whose copy in is in flight.
  uint64_t hits = 0;          // CopyToDevice / CopyToHost that found the chunk.
  uint64_t misses = 0;
  uint64_t staged = 0;        // Copies in that completed.
  uint64_t stage_failures = 0;
  uint64_t no_room = 0;       // Stage calls refused for room.
  uint64_t evictions = 0;
  uint64_t copy_failures = 0;  // Copies out that failed.
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
};

class GpuStagingTier {
 public:
  using Done = std::function<void(absl::Status)>;

  // Allocates the device memory. Returns: Ok, InvalidArgument (options),
  // ResourceExhausted (not enough device memory), Unavailable.
  static absl::StatusOr<std::unique_ptr<GpuStagingTier>> Create(
      const GpuStagingOptions& options, DeviceBackend* backend,
      std::unique_ptr<EvictionPolicy> policy);
  ~GpuStagingTier();
  GpuStagingTier(const GpuStagingTier&) = delete;
  GpuStagingTier& operator=(const GpuStagingTier&) = delete;

  // Copies a chunk into staging from host memory: `pieces` in order cover its
  // meta.size bytes and stay valid while `keep_alive` is held, which is until `done`
  // has run. Evicts evictable chunks for room (nothing, if that is not enough).
  // `done`: Ok (staged, or already staged or loading), InvalidArgument (pieces do not
  // add up to meta.size, or larger than the tier), ResourceExhausted (no room: the rest
  // is loading or being read), the backend's error (the copy failed; nothing staged),
  // or DataLoss (`verify` said the host bytes are not the chunk's; nothing staged).
  // `verify` (may be empty) runs once the copy has landed, on a completion thread, and
  // answers whether the host bytes are sound; the chunk is served only after it said
  // so. It must keep what it reads alive itself.
  using Verify = std::function<void(std::function<void(bool)>)>;
  void Stage(const ChunkId& id, const ChunkMeta& meta, std::vector<absl::string_view> pieces,
             std::shared_ptr<const void> keep_alive, Done done, Verify verify = nullptr);

  // A ready chunk's meta, without counting a hit or touching recency.
  std::optional<ChunkMeta> Find(const ChunkId& id) const;

  // Bytes [offset, offset + len) of a staged chunk go to device address `dst`.
  struct Range {
    uint64_t offset = 0;
    uint64_t len = 0;
    DevicePtr dst = 0;
    // An event (DeviceBackend::OpenIpcEvent) recorded on the copy's stream right after
    // this range's bytes, for the worker's streams to wait on; 0: none.
    uint64_t record_event = 0;
  };
  // Copies the ranges device-to-device, in order, as one submission; counts a hit or a
  // miss. The chunk cannot be evicted until `done` has run. `done`: Ok, NotFound (not
  // staged, or still loading), InvalidArgument (a range outside the chunk, or a
  // destination the backend rejects), Unavailable (device error). `enqueued`, if set,
  // runs once the copies (and their event records) were submitted to the device's
  // stream, before `done`, and only then: not when the chunk was not found.
  void CopyToDevice(const ChunkId& id, std::vector<Range> ranges, Done done,
                    std::function<void()> enqueued = nullptr);
  // The whole chunk into host memory `dst` (expected.size bytes, valid until `done`),
  // if the chunk staged under `id` is `expected` (as Find described it): one removed
  // and staged again since may be larger than `dst`. `done`: Ok, NotFound (not staged,
  // still loading, or staged as another chunk), Unavailable (device error).
  void CopyToHost(const ChunkId& id, const ChunkMeta& expected, char* dst, Done done);

  // Returns whether the chunk was staged or loading.
  bool Remove(const ChunkId& id);
  uint64_t RemoveNamespace(uint64_t ns);

  GpuStagingStats GetStats() const;
  uint64_t capacity_bytes() const { return num_slots_ * options_.slot_bytes; }

 private:
  struct Entry {
    ChunkMeta meta;
    std::vector<uint32_t> slots;
    bool loading = true;
    bool removed = false;  // Out of the index; slots freed when no copy uses them.
    int readers = 0;       // Copies out in flight.
  };

  GpuStagingTier(const GpuStagingOptions& options, DeviceBackend* backend, DevicePtr base,
                 uint64_t num_slots, std::unique_ptr<EvictionPolicy> policy);
  DevicePtr SlotAddress(uint32_t slot) const { return base_ + slot * options_.slot_bytes; }
  // Device addresses of chunk bytes [offset, offset + len), split at slot boundaries,
  // passed to `fn(device_address, chunk_offset, bytes)`.
  template <typename Fn>
  void ForEachDeviceRange(const Entry& e, uint64_t offset, uint64_t len, Fn fn) const;
  // Frees `n` slots' worth of room by evicting, all or nothing.
  bool MakeRoomLocked(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnindexLocked(const ChunkId& id, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeIfIdleLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the copies `build` makes from a ready chunk (under the mutex), holding the
  // chunk as a reader until they complete.
  void CopyOut(const ChunkId& id,
               absl::FunctionRef<absl::StatusOr<std::vector<DeviceCopy>>(const Entry&)> build,
               Done done, std::function<void()> enqueued = nullptr);

  const GpuStagingOptions options_;
  DeviceBackend* const backend_;
  const DevicePtr base_;
  const uint64_t num_slots_;

  mutable absl::Mutex mu_;
  std::unique_ptr<EvictionPolicy> policy_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ChunkId, std::shared_ptr<Entry>> index_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // Submissions whose done has not run.
  GpuStagingStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_GPU_STAGING_TIER_H_
