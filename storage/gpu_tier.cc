#include "storage/gpu_tier.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "storage/crc32c.h"
#include "storage/enqueue_gate.h"
#include "storage/log.h"
#include "storage/lru_policy.h"

namespace kvtier {

std::unique_ptr<GpuTier> GpuTier::Create(DeviceBackend* device,
                                         const GpuStagingOptions& staging_options,
                                         void* pool, uint64_t pool_bytes, int crc_threads) {
  void* pinned = nullptr;
  if (absl::Status s = device->PinHost(pool, pool_bytes); s.ok()) {
    pinned = pool;
  } else {
    LogWarning("GPU: the host pool (", pool_bytes, " bytes) could not be page-locked: ",
               s.message(), "; copies to and from the GPU run unpinned, at a fraction of "
               "the link's speed (kvtier_gpu_pool_pinned 0). Raise RLIMIT_MEMLOCK "
               "(LimitMEMLOCK= in the unit) or shrink the pool.");
  }
  std::unique_ptr<GpuStagingTier> staging;
  if (staging_options.capacity_bytes > 0) {
    auto created = GpuStagingTier::Create(staging_options, device, std::make_unique<LruPolicy>());
    if (created.ok()) {
      staging = *std::move(created);
    } else {
      LogWarning("GPU: no staging buffers (", staging_options.capacity_bytes,
                 " bytes wanted): ", created.status().message(),
                 "; chunks go to workers' GPUs from the host pool only "
                 "(kvtier_gpu_staging_enabled 0)");
    }
  }
  return std::unique_ptr<GpuTier>(new GpuTier(device, pinned, std::move(staging), crc_threads));
}

GpuTier::GpuTier(DeviceBackend* device, void* pinned, std::unique_ptr<GpuStagingTier> staging,
                 int crc_threads)
    : device_(device),
      pinned_(pinned),
      staging_(std::move(staging)),
      // Half the cores by default. The check reads host memory at the same time as the
      // DMA; on an H200 host (a 16-core VM) one core checks 7-16 GB/s of a pool chunk,
      // so it takes about eight to keep up with the link's ~50 GB/s on a 32 MiB chunk.
      crc_(crc_threads > 0 ? crc_threads
                           : std::clamp<int>(
                                 static_cast<int>(std::thread::hardware_concurrency()) / 2, 1,
                                 16)) {
  stats_.pool_pinned = pinned_ != nullptr;
  stats_.staging_enabled = staging_ != nullptr;
}

GpuTier::~GpuTier() {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &in_flight_));
  }
  staging_.reset();  // Waits for its own copies, which may read the pinned pool.
  if (pinned_ != nullptr) device_->UnpinHost(pinned_);
}

void GpuTier::Begin() {
  absl::MutexLock lock(&mu_);
  ++in_flight_;
}

void GpuTier::End() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

bool GpuTier::Contains(const ChunkId& id) const { return StagedMeta(id).has_value(); }

std::optional<ChunkMeta> GpuTier::StagedMeta(const ChunkId& id) const {
  if (staging_ == nullptr) return std::nullopt;
  return staging_->Find(id);
}

void GpuTier::DeliverFromStaging(const ChunkId& id, std::vector<Range> ranges, Done done,
                                 std::function<void()> enqueued) {
  if (staging_ == nullptr) {
    device_->Submit({}, [done = std::move(done)](absl::Status) {
      done(absl::NotFoundError("no GPU staging buffers"));
    });
    return;
  }
  uint64_t bytes = 0;
  for (const Range& r : ranges) bytes += r.len;
  Begin();
  staging_->CopyToDevice(id, std::move(ranges),
                         [this, bytes, done = std::move(done)](absl::Status s) {
                           {
                             absl::MutexLock lock(&mu_);
                             if (s.ok()) {
                               ++stats_.deliveries_from_staging;
                               stats_.delivered_bytes += bytes;
                             } else if (!absl::IsNotFound(s)) {
                               ++stats_.delivery_failures;
                             }
                           }
                           done(std::move(s));
                           End();
                         },
                         std::move(enqueued));
}

void GpuTier::DeliverFromHost(const ChunkMeta& meta, std::vector<absl::string_view> pieces,
                              std::shared_ptr<const void> keep_alive,
                              std::vector<Range> ranges, Done done, bool check_crc,
                              std::function<void()> enqueued) {
  std::vector<DeviceCopy> copies;
  uint64_t bytes = 0;
  absl::Status bad;
  for (const Range& r : ranges) {
    if (r.offset > meta.size || r.len > meta.size - r.offset) {
      bad = absl::InvalidArgumentError(absl::StrCat("range [", r.offset, ", +", r.len,
                                                    ") is outside a chunk of ", meta.size,
                                                    " bytes"));
      break;
    }
    bytes += r.len;
    // Walk the pieces for [r.offset, r.offset + r.len).
    uint64_t at = 0;
    for (absl::string_view p : pieces) {
      const uint64_t lo = std::max(at, r.offset);
      const uint64_t hi = std::min(at + p.size(), r.offset + r.len);
      if (lo < hi) {
        copies.push_back(
            DeviceCopy::HostToDevice(r.dst + (lo - r.offset), p.data() + (lo - at), hi - lo));
      }
      at += p.size();
    }
    if (r.record_event != 0) copies.push_back(DeviceCopy::RecordEvent(r.record_event));
  }
  if (!bad.ok()) {
    device_->Submit({}, [bad, done = std::move(done)](absl::Status) { done(bad); });
    return;
  }
  // The copy and the CRC32C run at once; whichever finishes last answers.
  struct Join {
    std::atomic<int> left{2};
    absl::Status copy;
    bool crc_ok = false;
    Done done;
  };
  auto join = std::make_shared<Join>();
  join->done = std::move(done);
  auto finish = [this, join, bytes] {
    absl::Status s = join->copy;
    if (s.ok() && !join->crc_ok) {
      s = absl::DataLossError(
          "chunk failed its CRC32C check while being copied to the GPU; do not use the bytes");
    }
    {
      absl::MutexLock lock(&mu_);
      if (s.ok()) {
        ++stats_.deliveries_from_host;
        stats_.delivered_bytes += bytes;
      } else {
        ++stats_.delivery_failures;
      }
    }
    join->done(std::move(s));
    End();
  };
  Begin();
  // `enqueued` before anything of `done`, however fast the copies complete.
  auto gate = std::make_shared<EnqueueGate>();
  // A whole chunk into one aligned place, on a device that checks: the GPU checks what
  // landed (the largest multiple of 64 KiB of it; the CPU the source's tail), after the
  // copy, leaving the CPU out of the delivery's path. Should the device not run the
  // check, the CPU checks the source.
  const uint64_t device_bytes =
      meta.size / DeviceBackend::kDeviceCrcBlockBytes * DeviceBackend::kDeviceCrcBlockBytes;
  if (check_crc && device_->ChecksCrc32c() && ranges.size() == 1 && ranges[0].offset == 0 &&
      ranges[0].len == meta.size && ranges[0].dst % 16 == 0 && device_bytes > 0) {
    join->left.store(1, std::memory_order_relaxed);  // The callback below answers.
    const DevicePtr at = ranges[0].dst;
    device_->SubmitAndCrc32c(
        CoalesceCopies(std::move(copies)), at, device_bytes,
        [this, join, finish, keep_alive, pieces = std::move(pieces), device_bytes, gate,
         expected = meta.crc32c](DeviceBackend::CopiedAndChecked r) mutable {
          gate->AfterEnqueued([this, join, finish, keep_alive, pieces = std::move(pieces),
                               device_bytes, expected, r = std::move(r)]() mutable {
            join->copy = std::move(r.copy);
            if (!join->copy.ok()) return finish();
            if (!r.crc32c.has_value()) {
              CheckOnCpu(std::move(pieces), expected, keep_alive, [join, finish](bool ok) {
                join->crc_ok = ok;
                finish();
              });
              return;
            }
            // The tail past the last whole 64 KiB, from the source.
            uint32_t crc = *r.crc32c;
            uint64_t at = 0;
            for (absl::string_view p : pieces) {
              if (at + p.size() > device_bytes) {
                const uint64_t skip = at >= device_bytes ? 0 : device_bytes - at;
                crc = crc32c::Extend(crc, p.data() + skip, p.size() - skip);
              }
              at += p.size();
            }
            {
              absl::MutexLock lock(&mu_);
              stats_.device_crc_checked_bytes += device_bytes;
            }
            if (crc == expected) {
              join->crc_ok = true;
              return finish();
            }
            // What landed differs. The pool's copy decides whose fault: intact, the
            // worker's memory changed under the copy (a Prefill worker computing the same
            // chunk into the same place may do so), and the chunk stays; corrupt, DataLoss.
            CheckOnCpu(std::move(pieces), expected, keep_alive, [join, finish](bool source_ok) {
              join->crc_ok = true;
              join->copy = source_ok ? absl::AbortedError(
                                           "the bytes changed in GPU memory during the copy into "
                                           "it (another writer?); the stored chunk is intact")
                                     : absl::DataLossError(
                                           "chunk failed its CRC32C check while being copied to "
                                           "the GPU; do not use the bytes");
              finish();
            });
          });
        });
    gate->Enqueued(enqueued);
    return;
  }
  device_->Submit(CoalesceCopies(std::move(copies)),
                  [join, finish, keep_alive, gate](absl::Status s) {
                    gate->AfterEnqueued([join, finish, s] {
                      join->copy = s;
                      if (join->left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
                    });
                  });
  gate->Enqueued(enqueued);
  if (!check_crc) {
    join->crc_ok = true;
    if (join->left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
    return;
  }
  CheckOnCpu(std::move(pieces), meta.crc32c, std::move(keep_alive), [join, finish](bool ok) {
    join->crc_ok = ok;
    if (join->left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
  });
}

void GpuTier::CheckOnCpu(std::vector<absl::string_view> pieces, uint32_t expected,
                         std::shared_ptr<const void> keep_alive, std::function<void(bool)> done,
                         uint64_t GpuTierStats::*checked) {
  uint64_t bytes = 0;
  for (absl::string_view p : pieces) bytes += p.size();
  {
    absl::MutexLock lock(&mu_);
    stats_.*checked += bytes;
  }
  // The pieces stay alive until the last part is checked, whichever thread that is.
  crc_.Compute(std::move(pieces), [expected, keep_alive = std::move(keep_alive),
                                   done = std::move(done)](uint32_t crc) { done(crc == expected); });
}

void GpuTier::Copy(std::vector<DeviceCopy> copies, Done done) {
  Begin();
  device_->Submit(CoalesceCopies(std::move(copies)),
                  [this, done = std::move(done)](absl::Status s) {
                    done(std::move(s));
                    End();
                  });
}

uint64_t GpuTier::capacity_bytes() const {
  return staging_ == nullptr ? 0 : staging_->capacity_bytes();
}

namespace {

absl::Status StagingOff() { return absl::FailedPreconditionError("no GPU staging buffers"); }

}  // namespace

void GpuTier::Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
                    WriteDone done) {
  if (staging_ == nullptr) return done(StagingOff());
  {
    absl::MutexLock lock(&mu_);
    ++stats_.stage_requests;
  }
  Begin();
  // The pool's bytes are checked (after the copy, off the caller's thread: a Lookup
  // stages its hits) before the staged copy is served: they passed the check when they
  // were put, but a deliver from RAM checks them again, and a staged copy of bytes that
  // changed since would be served as sound for as long as it stays staged.
  GpuStagingTier::Verify verify = [this, pieces = bytes.pieces, expected = meta.crc32c,
                                   keep_alive = bytes.keep_alive](
                                      std::function<void(bool)> ok) mutable {
    CheckOnCpu(std::move(pieces), expected, std::move(keep_alive), std::move(ok),
               &GpuTierStats::stage_crc_checked_bytes);
  };
  staging_->Stage(id, meta, std::move(bytes.pieces), std::move(bytes.keep_alive),
                  [this, done = std::move(done)](absl::Status s) {
                    done(std::move(s));
                    End();
                  },
                  std::move(verify));
}

void GpuTier::Read(const ChunkId& id, SinkFor sink_for, ReadDone done) {
  if (staging_ == nullptr) return done(StagingOff());
  std::optional<ChunkMeta> meta = staging_->Find(id);
  if (!meta.has_value()) return done(absl::NotFoundError("chunk not staged on the GPU"));
  ChunkSink* sink = sink_for(*meta);
  if (sink == nullptr) {
    return done(NoSinkError());
  }
  auto buffer = std::shared_ptr<char[]>(new char[meta->size]);
  Begin();
  staging_->CopyToHost(
      id, *meta, buffer.get(),
      [this, id, meta = *meta, buffer, sink, done = std::move(done)](absl::Status s) {
        if (s.ok()) {
          sink->Write(0, absl::string_view(buffer.get(), meta.size));
          if (sink->Crc32c() != meta.crc32c) {
            staging_->Remove(id);
            s = absl::DataLossError(absl::StrCat("staged copy of ", id.DebugString(),
                                                 " failed its CRC32C; dropped"));
          }
        }
        if (s.ok()) {
          done(meta);
        } else {
          done(std::move(s));
        }
        End();
      });
}

absl::StatusOr<bool> GpuTier::Delete(const ChunkId& id) {
  return staging_ != nullptr && staging_->Remove(id);
}

absl::StatusOr<uint64_t> GpuTier::DeleteNamespace(uint64_t ns, std::vector<ChunkId>*) {
  // Staging holds copies of RAM's chunks: they are not named (nor counted by Clear).
  return staging_ == nullptr ? 0 : staging_->RemoveNamespace(ns);
}

TierStats GpuTier::Stats() const {
  TierStats t;
  t.tier = Tier::kGpu;
  if (staging_ == nullptr) return t;
  const GpuStagingStats s = staging_->GetStats();
  t.capacity_bytes = s.capacity_bytes;
  t.used_bytes = s.used_bytes;
  t.payload_bytes = s.chunk_bytes;
  t.chunks = s.chunks;
  t.hits = s.hits;
  t.misses = s.misses;
  t.evictions = s.evictions;
  return t;
}

GpuTierStats GpuTier::GetStats() const {
  GpuTierStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
  }
  if (staging_ != nullptr) s.staging = staging_->GetStats();
  return s;
}

}  // namespace kvtier
