// GPU tier bandwidth, against the device's own baseline in the same run:
//   baseline   cudaMemcpyAsync host-to-device from a cudaHostAlloc'd buffer, one call;
//   host       the store's GPU path from a RAM chunk: TieredStore::ReadToDeviceAsync of
//              a chunk in the page-locked pool (64 KiB slots, coalesced copies, CRC32C
//              checked on the CPU during the DMA) into device memory;
//   staging    the same for a chunk in the GPU staging buffers (device to device).
// In-process: this measures the daemon's data path without the RPC that names a
// worker's IPC-mapped memory. Medians of --reps transfers per chunk size.
//
//   build/bench/gpu_bench --sizes-mib=32,128 --reps=20 [--json=FILE]
//
// Without a GPU it prints why and exits 0 (nothing to measure).
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "bench/bench_flags.h"
#include "bench/json_line.h"
#include "storage/crc32c.h"
#include "storage/cuda/cuda_device_backend.h"
#ifdef KVTIER_HAVE_CUDA_KERNELS
#include "storage/crc32c_gf2.h"
#include "storage/cuda/crc32c_kernels.h"
#endif
#include "storage/log.h"
#include "storage/parallel_crc.h"
#include "storage/tiered_store.h"

namespace kvtier::bench {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double BaselineSeconds(uint64_t bytes, void* dst) {
  void* host = nullptr;
  if (cudaHostAlloc(&host, bytes, cudaHostAllocDefault) != cudaSuccess) return 0;
  std::memset(host, 7, bytes);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  std::vector<double> t;
  for (uint64_t r = 0; r < Flag("reps", 20); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
    t.push_back(Seconds(t0));
  }
  cudaStreamDestroy(stream);
  cudaFreeHost(host);
  return Pct(t, 50);
}

double StoreSeconds(TieredStore& store, const ChunkId& id, uint64_t bytes, DevicePtr dst,
                    Tier want) {
  std::vector<double> t;
  for (uint64_t r = 0; r < Flag("reps", 20); ++r) {
    absl::Notification done;
    absl::StatusOr<Tier> from;
    const auto t0 = std::chrono::steady_clock::now();
    store.ReadToDeviceAsync(id, {{0, bytes, dst}}, [&](absl::StatusOr<Tier> s) {
      from = s;
      done.Notify();
    });
    done.WaitForNotification();
    t.push_back(Seconds(t0));
    if (!from.ok() || *from != want) {
      std::fprintf(stderr, "delivery from %s failed: %s\n", TierName(want),
                   from.ok() ? TierName(*from) : std::string(from.status().message()).c_str());
      return 0;
    }
  }
  return Pct(t, 50);
}

// Exploration for the host path (--explore): DMA from registered 4 KiB-page and
// transparent-huge-page host memory, and the CRC32C check split over more threads.
void Explore(uint64_t bytes, DevicePtr dst) {
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  auto dma = [&](void* src) {
    std::vector<double> t;
    for (int r = 0; r < 10; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      cudaMemcpyAsync(reinterpret_cast<void*>(dst), src, bytes, cudaMemcpyHostToDevice, stream);
      cudaStreamSynchronize(stream);
      t.push_back(Seconds(t0));
    }
    return bytes / Pct(t, 50) / 1e9;
  };
  JsonLine line;
  line.S("bench", "gpu_explore").N("chunk_mib", bytes >> 20);
  for (bool huge : {false, true}) {
    void* p = mmap(nullptr, bytes + (2 << 20), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    char* a = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + (2 << 20) - 1) &
                                      ~uintptr_t{(2 << 20) - 1});
    madvise(a, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    std::memset(a, 3, bytes);
    const bool reg = cudaHostRegister(a, bytes, cudaHostRegisterDefault) == cudaSuccess;
    line.N(huge ? "dma_thp_registered_gbps" : "dma_4k_registered_gbps", reg ? dma(a) : 0);
    if (reg) cudaHostUnregister(a);
    munmap(p, bytes + (2 << 20));
  }
  std::string data(bytes, 'q');
  for (int threads : {1, 2, 4, 8, 12}) {
    ParallelCrc crc(threads, 1 << 20);
    std::vector<double> t;
    for (int r = 0; r < 10; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::Notification done;
      crc.Compute({data}, [&](uint32_t) { done.Notify(); });
      done.WaitForNotification();
      t.push_back(Seconds(t0));
    }
    line.N("crc_" + std::to_string(threads) + "_helpers_gbps", bytes / Pct(t, 50) / 1e9);
  }
  line.Emit();
  cudaStreamDestroy(stream);
}

// Where a host delivery's fixed cost goes (in `line`): the two CRC32C kernels alone,
// timed on the device; a 4 KiB copy through a copy lane (its hand-offs and the wait on
// its event); the pool chunk's copies through a lane, without and with the check.
void Breakdown(DeviceBackend& backend, const std::vector<absl::string_view>& pieces,
               DevicePtr dst, uint64_t bytes, JsonLine& line) {
  const uint64_t reps = Flag("reps", 20);
  auto lane = [&](std::vector<DeviceCopy> copies, bool check) {
    std::vector<double> t;
    for (uint64_t r = 0; r < reps; ++r) {
      absl::Notification done;
      const auto t0 = std::chrono::steady_clock::now();
      if (check) {
        backend.SubmitAndCrc32c(copies, dst, bytes,
                                [&](DeviceBackend::CopiedAndChecked) { done.Notify(); });
      } else {
        backend.Submit(copies, [&](absl::Status) { done.Notify(); });
      }
      done.WaitForNotification();
      t.push_back(Seconds(t0));
    }
    return Pct(t, 50);
  };
  std::vector<DeviceCopy> copies;
  uint64_t at = 0;
  for (absl::string_view p : pieces) {
    copies.push_back(DeviceCopy::HostToDevice(dst + at, p.data(), p.size()));
    at += p.size();
  }
  line.N("lane_4k_us", lane({DeviceCopy::HostToDevice(dst, pieces[0].data(), 4096)}, false) * 1e6)
      .N("lane_copy_gbps", bytes / lane(copies, false) / 1e9);
  if (backend.ChecksCrc32c()) line.N("lane_copy_crc_gbps", bytes / lane(copies, true) / 1e9);
#ifdef KVTIER_HAVE_CUDA_KERNELS
  crc32c_gf2::Tables host_tables;
  crc32c_gf2::MakeTables(&host_tables);
  void* tables = nullptr;
  void* scratch = nullptr;
  cudaMalloc(&tables, sizeof(host_tables));
  cudaMalloc(&scratch, (bytes / crc32c_gf2::kBlockBytes + 1) * sizeof(uint32_t));
  cudaMemcpy(tables, &host_tables, sizeof(host_tables), cudaMemcpyHostToDevice);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> kernel_t;
  for (uint64_t r = 0; r < reps; ++r) {
    cudaEventRecord(a, stream);
    cuda::EnqueueRawCrc32c(stream, static_cast<const crc32c_gf2::Tables*>(tables),
                           reinterpret_cast<const void*>(dst), bytes,
                           static_cast<uint32_t*>(scratch), static_cast<uint32_t*>(scratch) +
                                                                bytes / crc32c_gf2::kBlockBytes);
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    kernel_t.push_back(ms / 1e3);
  }
  line.N("crc_kernels_us", Pct(kernel_t, 50) * 1e6);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(stream);
  cudaFree(scratch);
  cudaFree(tables);
#endif
}

int Main() {
  SetMinLogLevel(LogLevel::kWarning);
  auto backend = OpenCudaBackend({});
  if (!backend.ok()) {
    std::fprintf(stderr, "gpu_bench: no GPU (%s); nothing to measure\n",
                 std::string(backend.status().message()).c_str());
    return 0;
  }
  std::fprintf(stderr, "gpu_bench on %s\n", (*backend)->Describe().c_str());
  for (uint64_t mib : ListFlag("sizes-mib", "32,128")) {
    const uint64_t bytes = mib << 20;
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 2 * bytes + (64 << 20);
    o.ram.arena.prefault = true;
    o.max_chunk_bytes = bytes;
    o.device = backend->get();
    o.gpu_staging.capacity_bytes = bytes + (2 << 20);
    o.gpu_crc_threads = static_cast<int>(Flag("crc-threads", 0));  // 0: the store's default.
    auto store = TieredStore::Open(o);
    if (!store.ok()) {
      std::fprintf(stderr, "store: %s\n", std::string(store.status().message()).c_str());
      return 1;
    }
    LayoutSpec layout;
    layout.model_id = "bench/gpu";
    layout.model_revision = "r1";
    layout.dtype = LayoutSpec::DType::kFloat16;
    layout.num_layers = static_cast<uint32_t>(mib);  // 1 MiB per layer.
    layout.num_kv_heads = 8;
    layout.head_dim = 128;
    layout.tokens_per_chunk = 256;
    layout.key_position = LayoutSpec::KeyPosition::kPostRope;
    auto reg = (*store)->RegisterLayout(layout);
    if (!reg.ok()) {
      std::fprintf(stderr, "layout: %s\n", std::string(reg.status().message()).c_str());
      return 1;
    }
    const std::string data(bytes, 'x');
    const uint32_t crc = crc32c::Value(data);
    auto put = [&](const ChunkId& id) {
      auto w = (*store)->BeginPut(id, 256);
      if (!w.ok() || *w == nullptr || !(*w)->Append(data).ok()) return false;
      return (*store)->CommitPut(*std::move(w), crc).ok();
    };
    auto dst = (*backend)->Allocate(bytes);
    if (!dst.ok()) return 1;

    if (Flag("explore", 0) != 0) Explore(bytes, *dst);
    const double base = BaselineSeconds(bytes, reinterpret_cast<void*>(*dst));
    // Host path: a fresh chunk each rep, so that it is never staged.
    std::vector<double> host_t;
    for (uint64_t r = 0; r < Flag("reps", 20); ++r) {
      const ChunkId id{reg->namespace_id, ChunkKey{r + 1, mib}};
      if (!put(id)) return 1;
      absl::Notification done;
      absl::StatusOr<Tier> from;
      const auto t0 = std::chrono::steady_clock::now();
      (*store)->ReadToDeviceAsync(id, {{0, bytes, *dst}}, [&](absl::StatusOr<Tier> s) {
        from = s;
        done.Notify();
      });
      done.WaitForNotification();
      host_t.push_back(Seconds(t0));
      if (!from.ok()) return 1;
      // The delivery staged the chunk in the background; let that copy finish before the
      // next rep is timed, then drop the chunk.
      cudaDeviceSynchronize();
      (*store)->Delete(id).IgnoreError();
    }
    const double host = Pct(host_t, 50);
    // Where a host delivery's time goes, on a chunk in the pool: the DMA alone from the
    // pool's page-locked slots (one copy per run of adjacent slots), and the CRC32C
    // check alone, on one thread and split as the GPU tier splits it.
    const ChunkId probe{reg->namespace_id, ChunkKey{999, mib}};
    if (!put(probe)) return 1;
    std::vector<double> dma_t, crc1_t, crcn_t, gpu_crc_t;
    size_t runs = 0;
    JsonLine line;
    {
      std::optional<ChunkView> view = (*store)->HoldInRam(probe);
      if (!view.has_value()) return 1;
      std::vector<absl::string_view> pieces;
      view->ForEachPiece(0, bytes, [&](absl::string_view p) {
        if (!pieces.empty() && pieces.back().data() + pieces.back().size() == p.data()) {
          pieces.back() = absl::string_view(pieces.back().data(), pieces.back().size() + p.size());
        } else {
          pieces.push_back(p);
        }
      });
      runs = pieces.size();
      cudaStream_t stream;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      ParallelCrc crc(std::clamp<int>(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 16));
      for (uint64_t r = 0; r < Flag("reps", 20); ++r) {
        auto t0 = std::chrono::steady_clock::now();
        uint64_t at = 0;
        for (absl::string_view p : pieces) {
          cudaMemcpyAsync(reinterpret_cast<void*>(*dst + at), p.data(), p.size(),
                          cudaMemcpyHostToDevice, stream);
          at += p.size();
        }
        cudaStreamSynchronize(stream);
        dma_t.push_back(Seconds(t0));
        t0 = std::chrono::steady_clock::now();
        uint32_t c = 0;
        for (absl::string_view p : pieces) c = crc32c::Extend(c, p.data(), p.size());
        crc1_t.push_back(Seconds(t0));
        t0 = std::chrono::steady_clock::now();
        absl::Notification crc_done;
        crc.Compute(pieces, [&](uint32_t) { crc_done.Notify(); });
        crc_done.WaitForNotification();
        crcn_t.push_back(Seconds(t0));
        if ((*backend)->ChecksCrc32c()) {  // The check on the GPU alone, over device memory.
          t0 = std::chrono::steady_clock::now();
          absl::Notification gpu_done;
          (*backend)->SubmitAndCrc32c({}, *dst, bytes, [&](DeviceBackend::CopiedAndChecked) {
            gpu_done.Notify();
          });
          gpu_done.WaitForNotification();
          gpu_crc_t.push_back(Seconds(t0));
        }
      }
      cudaStreamDestroy(stream);
      Breakdown(**backend, pieces, *dst, bytes, line);
    }
    // Staging path.
    const ChunkId staged{reg->namespace_id, ChunkKey{0, mib}};
    if (!put(staged)) return 1;
    (*store)->StageAsync(staged);
    for (int i = 0; i < 10000 && (*store)->Locate(staged) != Tier::kGpu; ++i) {
      cudaDeviceSynchronize();
    }
    if ((*store)->Locate(staged) != Tier::kGpu) {
      std::fprintf(stderr, "the chunk did not reach the staging buffers\n");
      return 1;
    }
    const double staging = StoreSeconds(**store, staged, bytes, *dst, Tier::kGpu);

    line.S("bench", "gpu")
        .S("device", (*backend)->Describe())
        .N("chunk_mib", mib)
        .N("baseline_gbps", bytes / base / 1e9)
        .N("host_gbps", bytes / host / 1e9)
        .N("staging_gbps", staging > 0 ? bytes / staging / 1e9 : 0)
        .N("host_vs_baseline", base / host)
        .N("pool_runs", runs)
        .N("dma_from_pool_gbps", bytes / Pct(dma_t, 50) / 1e9)
        .N("crc_1_thread_gbps", bytes / Pct(crc1_t, 50) / 1e9)
        .N("crc_parallel_gbps", bytes / Pct(crcn_t, 50) / 1e9)
        .N("crc_on_gpu_gbps", gpu_crc_t.empty() ? 0 : bytes / Pct(gpu_crc_t, 50) / 1e9)
        .Emit();
    (*backend)->Free(*dst);
  }
  return 0;
}

}  // namespace
}  // namespace kvtier::bench

int main(int argc, char** argv) {
  kvtier::bench::InitFlags(argc, argv);
  return kvtier::bench::Main();
}
