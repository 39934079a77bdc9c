// GpuTier: the tiered store's GPU level. With a device it page-locks the host pool (so
// copies between the pool and the GPU run at the link's speed without a bounce
// buffer), owns the staging buffers (GpuStagingTier, L0), and delivers chunks into
// device memory: device-to-device from staging when the chunk is staged, else
// host-to-device from the bytes the caller read from RAM or SSD.
//
// Degraded modes are loud and never fatal: a pool that cannot be page-locked is served
// unpinned (slower copies), staging buffers that cannot be allocated leave deliveries
// host-to-device only; each logs a warning once and shows in GpuTierStats (and so in
// the metrics).
//
// Checksums: a host-to-device delivery checks the chunk's CRC32C and answers DataLoss if
// it is wrong (the bytes may have landed; the worker must not use them). A whole chunk
// delivered into one place on a device that checks (DeviceBackend::ChecksCrc32c: the
// CUDA backend, once its kernels passed a self-test) is checked on the GPU after the
// copy, over the bytes that landed; otherwise the CPU checks the source while the DMA
// runs (in parallel parts for chunks of several MiB, see ParallelCrc). A
// caller that checked the same chunk earlier in one request, and held it since, may
// skip the check for its later ranges (a layer-major Get's later layers). A chunk is
// staged from RAM only if the pool's bytes pass the same check (on the CPU, once the
// copy has landed); the staged copy lives in ECC-protected device memory and is not
// checked again on its way to a worker's buffer (a GPU kernel would be needed to).
//
// Thread-safety: thread-safe. `done` callbacks run on the backend's completion threads,
// except DeliverFromHost's, which runs on the caller's thread or a CRC32C thread when
// its check finishes after the copy.
// The destructor waits for deliveries in flight; the device backend and the pool
// memory must outlive this object.
#ifndef KVTIER_STORAGE_GPU_TIER_H_
#define KVTIER_STORAGE_GPU_TIER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "storage/chunk_id.h"
#include "storage/device_backend.h"
#include "storage/gpu_staging_tier.h"
#include "storage/parallel_crc.h"
#include "storage/storage_tier.h"

namespace kvtier {

struct GpuTierStats {
  bool pool_pinned = false;
  bool staging_enabled = false;
  GpuStagingStats staging;
  // Deliveries into device memory that completed, by where the bytes came from.
  uint64_t deliveries_from_staging = 0;
  uint64_t deliveries_from_host = 0;
  uint64_t delivered_bytes = 0;
  uint64_t delivery_failures = 0;  // Device errors, and DataLoss found during the copy.
  // Stage requests that reached the staging tier, duplicates and refusals included
  // (staging.staged counts the copies in that completed).
  uint64_t stage_requests = 0;
  uint64_t crc_checked_bytes = 0;  // Host bytes whose CRC32C a delivery checked on the CPU.
  uint64_t stage_crc_checked_bytes = 0;  // Pool bytes checked on the CPU before staging.
  // Bytes a delivery checked on the GPU, where they landed (DeviceBackend::ChecksCrc32c).
  uint64_t device_crc_checked_bytes = 0;
};

class GpuTier final : public StorageTier {
 public:
  // `device` must outlive the tier; `pool`/`pool_bytes` is the host pool's memory to
  // page-lock (unlocked again by the destructor). Staging with capacity 0 is off.
  // `crc_threads` check CRC32Cs beside the delivering thread; 0: half the cores, at
  // most 16. Never fails: what cannot be set up is a degraded mode (see above).
  static std::unique_ptr<GpuTier> Create(DeviceBackend* device, const GpuStagingOptions& staging,
                                         void* pool, uint64_t pool_bytes, int crc_threads = 0);
  ~GpuTier();
  GpuTier(const GpuTier&) = delete;
  GpuTier& operator=(const GpuTier&) = delete;

  // StorageTier: the staging buffers (capacity 0 and every call refused with
  // FailedPrecondition when staging is off). Write stages a chunk and reports how the
  // copy went (DataLoss: the bytes given failed the chunk's CRC32C); Read copies a staged chunk back to the host and checks its CRC32C;
  // `done` runs on the backend's completion thread.
  Tier tier() const override { return Tier::kGpu; }
  Role role() const override { return Role::kCopy; }
  uint64_t capacity_bytes() const override;
  bool Contains(const ChunkId& id) const override;
  // The description of the chunk staged (ready) under `id`, if any.
  std::optional<ChunkMeta> StagedMeta(const ChunkId& id) const;
  void Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
             WriteDone done) override;
  void Read(const ChunkId& id, SinkFor sink_for, ReadDone done) override;
  absl::StatusOr<bool> Delete(const ChunkId& id) override;
  absl::StatusOr<uint64_t> DeleteNamespace(uint64_t ns,
                                           std::vector<ChunkId>* removed = nullptr) override;
  TierStats Stats() const override;

  using Range = GpuStagingTier::Range;
  using Done = std::function<void(absl::Status)>;
  // Each range's `record_event` is recorded on the copy's stream right after its bytes.
  // `enqueued`, if set, runs once the copies and those records were submitted to the
  // device's stream (an error there reaches `done`), and before `done`; not at all if
  // nothing was submitted (NotFound, a bad range).
  //
  // From staging. `done`: Ok, NotFound (not staged: deliver from host instead),
  // InvalidArgument, Unavailable.
  void DeliverFromStaging(const ChunkId& id, std::vector<Range> ranges, Done done,
                          std::function<void()> enqueued = nullptr);
  // From host bytes `pieces` covering meta.size, alive while `keep_alive` is held.
  // `check_crc` false: the caller checked these bytes earlier in the same request and
  // held them since, so the whole chunk's CRC32C is not checked again for a range.
  // `done`: Ok, DataLoss (CRC32C mismatch of the pool's copy), Aborted (what landed
  // differs from an intact pool copy: the destination changed during the copy),
  // InvalidArgument (a range outside the chunk or a destination the device refuses),
  // Unavailable (device error).
  void DeliverFromHost(const ChunkMeta& meta, std::vector<absl::string_view> pieces,
                       std::shared_ptr<const void> keep_alive, std::vector<Range> ranges,
                       Done done, bool check_crc = true,
                       std::function<void()> enqueued = nullptr);

  // Runs `copies` on the device (a put from a worker's GPU memory into the pool),
  // counted like a delivery for the destructor's wait. `done`: the backend's status.
  void Copy(std::vector<DeviceCopy> copies, Done done);

  void Remove(const ChunkId& id) { (void)Delete(id); }
  void RemoveNamespace(uint64_t ns) { (void)DeleteNamespace(ns); }

  GpuTierStats GetStats() const;

 private:
  GpuTier(DeviceBackend* device, void* pinned, std::unique_ptr<GpuStagingTier> staging,
          int crc_threads);
  // The CRC32C of `pieces` (alive while `keep_alive` is held) against `expected`, on the
  // CPU (ParallelCrc); the bytes count in `*checked` (a GpuTierStats field).
  void CheckOnCpu(std::vector<absl::string_view> pieces, uint32_t expected,
                  std::shared_ptr<const void> keep_alive, std::function<void(bool)> done,
                  uint64_t GpuTierStats::*checked = &GpuTierStats::crc_checked_bytes);
  void Begin();
  void End();

  DeviceBackend* const device_;
  void* const pinned_;  // The page-locked pool, or null.
  std::unique_ptr<GpuStagingTier> staging_;  // Null: staging off.

  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // Deliveries whose done has not run.
  GpuTierStats stats_ ABSL_GUARDED_BY(mu_);
  // Last: its threads may still be returning from a check whose delivery ended (End)
  // when the destructor stops waiting, so it is joined before the state above goes.
  ParallelCrc crc_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_GPU_TIER_H_
