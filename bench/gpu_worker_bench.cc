// A worker on the GPU host against a real kvtierd (--gpu=0, --shm-socket=auto): what
// the GPU tier gives a worker through the daemon, the RPC and CUDA IPC included, and a
// timeline of transfers beside the worker's own compute. Three parts, one run:
//
//   h2d        per chunk size: the baseline, cudaMemcpyAsync host-to-device from a
//              cudaHostAlloc'd buffer in this process (median of --reps), then
//              GetIntoDevice of one chunk into this process's IPC-registered memory,
//              timed from the call to its return (median of --reps):
//                ram      from the daemon's page-locked pool (staging off), a fresh
//                         chunk each rep;
//                staging  from its GPU staging buffers (device to device), once the
//                         chunk is there;
//              then the same with --batch keys per call (median of 3 calls after one
//              to warm up), as a worker loading a request's chunks would.
//   layerwise  --chunks chunks of --layers 1 MiB layers: a loader thread fetches chunk
//              k layer-major (one item per layer, each announced once it landed) while
//              the compute stream runs chunk k-1: each layer's "compute" (a kernel that
//              spins for a fixed time on every SM) is queued once its layer landed.
//              Reports the compute stream's busy share from its first kernel to its
//              last, and how much of chunk k's transfer lies inside chunk k-1's compute.
//   prefill    a Prefill session into GPU memory (PrefillOptions::into_device): the
//              worker computes forward on the compute stream, the daemon streams
//              backward into its memory; the same busy share, and where they met.
//
// The compute is a fixed-time spin (PTX, loaded at run time: no CUDA compiler in the
// build) so the timeline is about transfers and streams, not a model's kernels. Its
// per-layer time is --compute-factor x the measured per-layer transfer time.
//
//   build/bench/gpu_worker_bench --sizes-mib=32,128 --reps=10 --chunks=12 --layers=32
//       --json=FILE --timeline-dir=DIR   (one command line)
// --crc-threads=N passes --gpu-crc-threads=N to the daemon (0: its default); --h2d-only=1
// skips the timelines.
//
// Without a GPU it prints why and exits 0 (nothing to measure).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_flags.h"
#include "bench/json_line.h"
#include "client/kvtier_client.h"
#include "client/prefill_session.h"
#include "tests/support/daemon_process.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMiB = 1 << 20;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

#define CUDA_OR_DIE(expr)                                                           \
  do {                                                                              \
    cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));              \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// A kernel that spins until %globaltimer has advanced by its argument (ns).
constexpr char kSpinPtx[] = R"(.version 8.0
.target sm_80
.address_size 64
.visible .entry kvtier_spin(.param .u64 kvtier_spin_ns)
{
  .reg .pred %p;
  .reg .b64 %d, %t0, %t, %end;
  ld.param.u64 %d, [kvtier_spin_ns];
  mov.u64 %t0, %globaltimer;
  add.u64 %end, %t0, %d;
$Lloop:
  mov.u64 %t, %globaltimer;
  setp.lt.u64 %p, %t, %end;
  @%p bra $Lloop;
  ret;
}
)";

class Spinner {
 public:
  Spinner() {
    CUDA_OR_DIE(cudaLibraryLoadData(&lib_, kSpinPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
    CUDA_OR_DIE(cudaLibraryGetKernel(&kernel_, lib_, "kvtier_spin"));
    int dev = 0;
    CUDA_OR_DIE(cudaGetDevice(&dev));
    CUDA_OR_DIE(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
  }
  // One block per SM, one warp each: the compute holds every SM for `ns`.
  void Launch(cudaStream_t stream, uint64_t ns) {
    void* args[] = {&ns};
    CUDA_OR_DIE(cudaLaunchKernel(reinterpret_cast<const void*>(kernel_), dim3(sms_), dim3(32),
                                 args, 0, stream));
  }

 private:
  cudaLibrary_t lib_ = nullptr;
  cudaKernel_t kernel_ = nullptr;
  int sms_ = 1;
};

// Device memory of this process, registered with the daemon.
struct Region {
  void* ptr = nullptr;
  RegionChannel::Registration reg;
  std::vector<cudaEvent_t> events;  // Registered with it, for record_events.
};

Region Register(KvTierClient& client, uint64_t bytes, int events = 0) {
  Region r;
  CUDA_OR_DIE(cudaMalloc(&r.ptr, bytes));
  cudaIpcMemHandle_t h;
  CUDA_OR_DIE(cudaIpcGetMemHandle(&h, r.ptr));
  std::vector<std::string> handles;
  for (int i = 0; i < events; ++i) {
    cudaEvent_t e;
    CUDA_OR_DIE(cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming));
    cudaIpcEventHandle_t eh;
    CUDA_OR_DIE(cudaIpcGetEventHandle(&eh, e));
    handles.emplace_back(reinterpret_cast<const char*>(&eh), sizeof(eh));
    r.events.push_back(e);
  }
  auto reg = client.RegisterDeviceMemory(std::string(reinterpret_cast<const char*>(&h), sizeof(h)),
                                         bytes, handles);
  if (!reg.ok()) {
    std::fprintf(stderr, "register: %s\n", std::string(reg.status().message()).c_str());
    std::exit(1);
  }
  r.reg = *reg;
  return r;
}

struct Daemon {
  std::unique_ptr<testing::DaemonProcess> process;
  std::unique_ptr<KvTierClient> client;
  uint64_t ns = 0;
};

// A daemon for chunks of `layers` MiB with `chunks` of pool room, and a client with the
// layout registered.
Daemon StartDaemon(uint32_t layers, uint64_t chunks, uint64_t staging_bytes) {
  const uint64_t chunk = uint64_t{layers} * kMiB;
  Daemon d;
  auto p = testing::DaemonProcess::Start(
      testing::MakeTempDir("gpu-worker-bench") + "/data",
      {"--shm-socket=auto", "--gpu=0", "--write-mode=ram-only", "--ram-prefault=true",
       "--gpu-staging-size=" + std::to_string(staging_bytes),
       "--ram-capacity=" + std::to_string(chunks * chunk + 64 * kMiB),
       "--max-chunk-size=" + std::to_string(chunk), "--log-level=warn",
       "--gpu-crc-threads=" + std::to_string(Flag("crc-threads", 0))});
  if (!p.ok()) {
    std::fprintf(stderr, "kvtierd: %s\n", std::string(p.status().message()).c_str());
    std::exit(1);
  }
  d.process = std::make_unique<testing::DaemonProcess>(*std::move(p));
  auto c = KvTierClient::Connect(d.process->target());
  if (!c.ok()) std::exit(1);
  d.client = *std::move(c);
  LayoutSpec layout;
  layout.model_id = "bench/gpu-worker";
  layout.model_revision = "r1";
  layout.dtype = LayoutSpec::DType::kFloat16;
  layout.num_layers = layers;  // 1 MiB per layer.
  layout.num_kv_heads = 8;
  layout.head_dim = 128;
  layout.tokens_per_chunk = 256;
  layout.key_position = LayoutSpec::KeyPosition::kPostRope;
  auto reg = d.client->RegisterLayout(layout);
  if (!reg.ok()) {
    std::fprintf(stderr, "layout: %s\n", std::string(reg.status().message()).c_str());
    std::exit(1);
  }
  d.ns = reg->namespace_id;
  return d;
}

void PutChunks(Daemon& d, uint64_t first, uint64_t n, uint64_t bytes) {
  std::string data(bytes, '\0');
  for (uint64_t i = first; i < first + n; ++i) {
    std::memset(data.data(), static_cast<int>('a' + i % 26), bytes);
    ChunkToPut c{ChunkKey{i + 1, 7}, data, 256};
    if (auto r = d.client->Put(d.ns, {&c, 1}); !r.ok() || r->stored != 1) {
      std::fprintf(stderr, "put %llu failed\n", static_cast<unsigned long long>(i));
      std::exit(1);
    }
  }
}

ChunkKey Key(uint64_t i) { return ChunkKey{i + 1, 7}; }

// Seconds of one GetIntoDevice of key i; the tier it came from in *tier.
double TimedGet(Daemon& d, uint64_t i, const Region& r, v1::Tier* tier) {
  const auto t0 = Clock::now();
  auto got = d.client->GetIntoDevice(d.ns, std::vector<ChunkKey>{Key(i)}, r.reg, 0);
  const double s = Since(t0);
  if (!got.ok() || !got->found[0]) {
    std::fprintf(stderr, "get: %s\n", got.ok() ? "absent" : std::string(got.status().message()).c_str());
    std::exit(1);
  }
  *tier = got->tiers[0];
  return s;
}

void H2d(uint64_t mib) {
  const uint64_t bytes = mib * kMiB;
  const uint64_t reps = Flag("reps", 10);
  // Baseline: the device's own host-to-device copy from pinned memory, same target.
  void* host = nullptr;
  CUDA_OR_DIE(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  std::memset(host, 7, bytes);
  void* dst = nullptr;
  CUDA_OR_DIE(cudaMalloc(&dst, bytes));
  cudaStream_t stream;
  CUDA_OR_DIE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<double> base;
  for (uint64_t r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    CUDA_OR_DIE(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_OR_DIE(cudaStreamSynchronize(stream));
    if (r > 0) base.push_back(Since(t0));  // The first warms up.
  }
  cudaStreamDestroy(stream);
  cudaFreeHost(host);
  cudaFree(dst);

  // From the pool: staging off, a fresh chunk each rep.
  std::vector<double> ram, absent;
  {
    Daemon d = StartDaemon(static_cast<uint32_t>(mib), reps + 2, 0);
    PutChunks(d, 0, reps + 1, bytes);
    Region r = Register(*d.client, bytes);
    v1::Tier tier;
    for (uint64_t i = 0; i < reps + 1; ++i) {
      const double s = TimedGet(d, i, r, &tier);
      if (i > 0) ram.push_back(s);
      if (tier != v1::TIER_RAM) std::fprintf(stderr, "h2d ram: chunk came from tier %d\n", tier);
    }
    // The call's fixed cost: one GetIntoDevice of a key the daemon does not hold.
    for (uint64_t i = 0; i < reps + 1; ++i) {
      const auto t0 = Clock::now();
      auto got = d.client->GetIntoDevice(d.ns, std::vector<ChunkKey>{Key(1000 + i)}, r.reg, 0);
      const double s = Since(t0);
      if (!got.ok() || got->found[0]) {
        std::fprintf(stderr, "absent get: %s\n",
                     got.ok() ? "found" : std::string(got.status().message()).c_str());
        std::exit(1);
      }
      if (i > 0) absent.push_back(s);
    }
    cudaFree(r.ptr);
  }
  // From staging: the first get stages the chunk; later ones find it there.
  std::vector<double> staged;
  std::string staged_tier = "GPU";
  {
    Daemon d = StartDaemon(static_cast<uint32_t>(mib), 2, 2 * bytes + 2 * kMiB);
    PutChunks(d, 0, 1, bytes);
    Region r = Register(*d.client, bytes);
    v1::Tier tier = v1::TIER_UNSPECIFIED;
    for (int i = 0; i < 200 && tier != v1::TIER_GPU; ++i) {
      TimedGet(d, 0, r, &tier);
      if (tier != v1::TIER_GPU) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (tier != v1::TIER_GPU) staged_tier = "never staged";
    for (uint64_t i = 0; i < reps && tier == v1::TIER_GPU; ++i) {
      staged.push_back(TimedGet(d, 0, r, &tier));
    }
    cudaFree(r.ptr);
  }
  // Several keys per call (--batch), as a worker loads a request's chunks: the call's
  // fixed cost (the RPC and its thread hand-offs, about half a millisecond) is paid once
  // and the daemon keeps deliveries in flight back to back.
  const uint64_t batch = Flag("batch", 8);
  std::vector<double> ram_b, staged_b;
  auto batch_keys = [&](uint64_t first) {
    std::vector<ChunkKey> keys;
    for (uint64_t i = first; i < first + batch; ++i) keys.push_back(Key(i));
    return keys;
  };
  auto timed_batch = [&](Daemon& d, uint64_t first, const Region& r, bool* all_staged) {
    const auto t0 = Clock::now();
    auto got = d.client->GetIntoDevice(d.ns, batch_keys(first), r.reg, 0);
    const double s = Since(t0);
    if (!got.ok()) {
      std::fprintf(stderr, "batch get: %s\n", std::string(got.status().message()).c_str());
      std::exit(1);
    }
    *all_staged = true;
    for (size_t k = 0; k < got->found.size(); ++k) {
      if (!got->found[k]) std::exit(1);
      *all_staged = *all_staged && got->tiers[k] == v1::TIER_GPU;
    }
    return s;
  };
  if (batch > 1) {
    constexpr uint64_t kBatchReps = 4;  // The first warms up.
    {
      Daemon d = StartDaemon(static_cast<uint32_t>(mib), kBatchReps * batch + 1, 0);
      PutChunks(d, 0, kBatchReps * batch, bytes);
      Region r = Register(*d.client, batch * bytes);
      bool staged_all;
      for (uint64_t i = 0; i < kBatchReps; ++i) {
        const double s = timed_batch(d, i * batch, r, &staged_all);
        if (i > 0) ram_b.push_back(s);
      }
      cudaFree(r.ptr);
    }
    {
      Daemon d = StartDaemon(static_cast<uint32_t>(mib), batch + 1, 2 * batch * bytes + 2 * kMiB);
      PutChunks(d, 0, batch, bytes);
      Region r = Register(*d.client, batch * bytes);
      bool staged_all = false;
      for (int i = 0; i < 200 && !staged_all; ++i) {
        timed_batch(d, 0, r, &staged_all);
        if (!staged_all) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      for (uint64_t i = 0; i < kBatchReps && staged_all; ++i) {
        staged_b.push_back(timed_batch(d, 0, r, &staged_all));
      }
      cudaFree(r.ptr);
    }
  }
  const double b = Pct(base, 50), h = Pct(ram, 50);
  const double st = staged.empty() ? 0 : Pct(staged, 50);
  JsonLine()
      .S("bench", "gpu_worker_h2d")
      .N("chunk_mib", mib)
      .N("reps", reps)
      .N("baseline_gbps", bytes / b / 1e9)
      .N("daemon_ram_gbps", bytes / h / 1e9)
      .N("daemon_staging_gbps", st > 0 ? bytes / st / 1e9 : 0)
      .S("staging_tier", staged_tier)
      .N("ram_vs_baseline", b / h)
      .N("absent_get_us", Pct(absent, 50) * 1e6)
      .N("staging_vs_baseline", st > 0 ? b / st : 0)
      .N("batch", batch)
      .N("batch_ram_gbps", ram_b.empty() ? 0 : batch * bytes / Pct(ram_b, 50) / 1e9)
      .N("batch_staging_gbps", staged_b.empty() ? 0 : batch * bytes / Pct(staged_b, 50) / 1e9)
      .N("batch_ram_vs_baseline", ram_b.empty() ? 0 : batch * b / Pct(ram_b, 50))
      .N("batch_staging_vs_baseline", staged_b.empty() ? 0 : batch * b / Pct(staged_b, 50))
      .Emit();
}

// Host-clock times of GPU events: `origin` was recorded and synchronised at host time
// `origin_s` (seconds since the run's t0).
struct GpuClock {
  cudaEvent_t origin;
  double origin_s = 0;
  double At(cudaEvent_t e) const {
    float ms = 0;
    CUDA_OR_DIE(cudaEventElapsedTime(&ms, origin, e));
    return origin_s + ms / 1e3;
  }
};

GpuClock StartGpuClock(cudaStream_t stream, Clock::time_point t0) {
  GpuClock c;
  CUDA_OR_DIE(cudaEventCreate(&c.origin));
  CUDA_OR_DIE(cudaEventRecord(c.origin, stream));
  CUDA_OR_DIE(cudaEventSynchronize(c.origin));
  c.origin_s = Since(t0);
  return c;
}

struct Interval {
  std::string lane;  // "transfer" or "compute".
  uint32_t chunk = 0, layer = 0;
  double start = 0, end = 0;
};

void WriteTimeline(const std::string& name, const std::vector<Interval>& rows) {
  const std::string dir = StrFlag("timeline-dir", "");
  if (dir.empty()) return;
  std::ofstream out(dir + "/" + name + ".csv");
  out << "lane,chunk,layer,start_s,end_s\n";
  for (const Interval& r : rows) {
    out << r.lane << "," << r.chunk << "," << r.layer << "," << r.start << "," << r.end << "\n";
  }
}

// Busy share of the compute lane between its first start and last end.
double BusyShare(const std::vector<Interval>& rows) {
  double lo = 1e30, hi = 0, busy = 0;
  for (const Interval& r : rows) {
    if (r.lane != "compute") continue;
    lo = std::min(lo, r.start);
    hi = std::max(hi, r.end);
    busy += r.end - r.start;
  }
  return hi > lo ? busy / (hi - lo) : 0;
}

// Compute intervals from per-layer start/stop events.
void AddCompute(const GpuClock& clock, const std::vector<std::vector<cudaEvent_t>>& begin,
                const std::vector<std::vector<cudaEvent_t>>& end, std::vector<Interval>* rows) {
  for (uint32_t k = 0; k < begin.size(); ++k) {
    for (uint32_t l = 0; l < begin[k].size(); ++l) {
      rows->push_back({"compute", k, l, clock.At(begin[k][l]), clock.At(end[k][l])});
    }
  }
}

// What both timelines start from: --chunks chunks of --layers 1 MiB layers in a daemon
// without staging, and a registered region that holds them all.
struct TimelineSetUp {
  uint32_t layers = static_cast<uint32_t>(Flag("layers", 32));
  uint32_t chunks = static_cast<uint32_t>(Flag("chunks", 12));
  uint64_t chunk_bytes = uint64_t{layers} * kMiB;
  Daemon d = StartDaemon(layers, chunks + 2, 0);
  Region r;
  TimelineSetUp() {
    PutChunks(d, 0, chunks, chunk_bytes);
    r = Register(*d.client, uint64_t{chunks} * chunk_bytes);
  }
};

void Layerwise() {
  TimelineSetUp setup;
  const uint32_t layers = setup.layers, chunks = setup.chunks;
  const uint64_t chunk_bytes = setup.chunk_bytes;
  Daemon& d = setup.d;
  const Region& r = setup.r;
  Spinner spin;

  // Load alone: one chunk layer-major, frames on landing and record_events (the
  // worker's stream waits on the event the daemon records after each layer) in turn,
  // medians of --load-reps each (staging is off: every read is from the pool). For
  // each, the whole chunk (the call, and with events the stream past every wait) and
  // its first layer: the first frame on the host, or the stream past the first wait.
  cudaStream_t compute;
  CUDA_OR_DIE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  Region er = Register(*d.client, uint64_t{chunks} * chunk_bytes, static_cast<int>(layers));
  cudaEvent_t go, first;
  CUDA_OR_DIE(cudaEventCreate(&go));
  CUDA_OR_DIE(cudaEventCreate(&first));
  std::vector<double> load, first_frame, events_load, events_first;
  for (uint64_t i = 0; i < Flag("load-reps", 11); ++i) {
    const ChunkKey key = Key(i % chunks);
    auto t0 = Clock::now();
    double first_s = 0;
    auto got = d.client->GetIntoDevice(d.ns, std::vector<ChunkKey>{key}, r.reg, 0,
                                       LayerRange{0, layers}, v1::GET_ORDER_LAYER_MAJOR, 0,
                                       [&](uint32_t, uint32_t layer) {
                                         if (layer == 0) first_s = Since(t0);
                                         return absl::OkStatus();
                                       });
    if (!got.ok()) std::exit(1);
    load.push_back(Since(t0));
    first_frame.push_back(first_s);

    t0 = Clock::now();
    CUDA_OR_DIE(cudaEventRecord(go, compute));
    got = d.client->GetIntoDevice(
        d.ns, std::vector<ChunkKey>{key}, er.reg, 0, LayerRange{0, layers},
        v1::GET_ORDER_LAYER_MAJOR, 0,
        [&](uint32_t, uint32_t layer) {
          CUDA_OR_DIE(cudaStreamWaitEvent(compute, er.events[layer], 0));
          if (layer == 0) CUDA_OR_DIE(cudaEventRecord(first, compute));
          return absl::OkStatus();
        },
        /*record_events=*/true);
    if (!got.ok()) {
      std::fprintf(stderr, "events get: %s\n", std::string(got.status().message()).c_str());
      std::exit(1);
    }
    CUDA_OR_DIE(cudaStreamSynchronize(compute));
    events_load.push_back(Since(t0));
    float ms = 0;
    CUDA_OR_DIE(cudaEventElapsedTime(&ms, go, first));
    events_first.push_back(ms / 1e3);
  }
  const double load_chunk = Pct(load, 50);
  const double factor = DFlag("compute-factor", 1.25);
  const uint64_t layer_ns = static_cast<uint64_t>(load_chunk / layers * factor * 1e9);

  std::vector<std::vector<cudaEvent_t>> begin(chunks, std::vector<cudaEvent_t>(layers));
  std::vector<std::vector<cudaEvent_t>> end(chunks, std::vector<cudaEvent_t>(layers));
  for (auto* v : {&begin, &end}) {
    for (auto& row : *v) {
      for (auto& e : row) CUDA_OR_DIE(cudaEventCreate(&e));
    }
  }
  const auto t0 = Clock::now();
  GpuClock clock = StartGpuClock(compute, t0);

  std::mutex mu;
  std::condition_variable cv;
  uint64_t landed = 0;  // Layers landed, in (chunk, layer) order.
  std::vector<Interval> rows;
  std::vector<double> call_start(chunks), last_landed(chunks);
  std::thread loader([&] {
    for (uint32_t k = 0; k < chunks; ++k) {
      call_start[k] = Since(t0);
      double prev = call_start[k];
      auto got = d.client->GetIntoDevice(
          d.ns, std::vector<ChunkKey>{Key(k)}, r.reg, uint64_t{k} * chunk_bytes,
          LayerRange{0, layers}, v1::GET_ORDER_LAYER_MAJOR, 0, [&](uint32_t, uint32_t layer) {
            const double now = Since(t0);
            std::lock_guard<std::mutex> l(mu);
            rows.push_back({"transfer", k, layer, prev, now});
            prev = now;
            ++landed;
            cv.notify_one();
            return absl::OkStatus();
          });
      if (!got.ok()) {
        std::fprintf(stderr, "layerwise get: %s\n", std::string(got.status().message()).c_str());
        std::exit(1);
      }
      last_landed[k] = prev;
    }
  });
  for (uint32_t k = 0; k < chunks; ++k) {
    for (uint32_t l = 0; l < layers; ++l) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return landed > uint64_t{k} * layers + l; });
      }
      CUDA_OR_DIE(cudaEventRecord(begin[k][l], compute));
      spin.Launch(compute, layer_ns);
      CUDA_OR_DIE(cudaEventRecord(end[k][l], compute));
    }
  }
  loader.join();
  CUDA_OR_DIE(cudaStreamSynchronize(compute));
  const double total = Since(t0) - clock.origin_s;
  AddCompute(clock, begin, end, &rows);

  // How much of chunk k's transfer ran while chunk k-1 computed.
  std::vector<double> overlap;
  for (uint32_t k = 1; k < chunks; ++k) {
    const double cs = clock.At(begin[k - 1][0]), ce = clock.At(end[k - 1][layers - 1]);
    const double ts = call_start[k], te = last_landed[k];
    const double inter = std::max(0.0, std::min(ce, te) - std::max(cs, ts));
    overlap.push_back(te > ts ? inter / (te - ts) : 0);
  }
  const double busy = BusyShare(rows);
  WriteTimeline("layerwise", rows);

  // The same pipeline with record_events (the region `er`): the worker's stream waits
  // on the daemon's record of each layer's event, queued from the layer's frame as soon
  // as its copies are queued; the host waits on nothing per layer. One thread.
  std::vector<Interval> event_rows;
  const auto e0 = Clock::now();
  GpuClock eclock = StartGpuClock(compute, e0);
  for (uint32_t k = 0; k < chunks; ++k) {
    auto got = d.client->GetIntoDevice(
        d.ns, std::vector<ChunkKey>{Key(k)}, er.reg, uint64_t{k} * chunk_bytes,
        LayerRange{0, layers}, v1::GET_ORDER_LAYER_MAJOR, 0,
        [&](uint32_t, uint32_t l) {
          CUDA_OR_DIE(cudaStreamWaitEvent(compute, er.events[l], 0));
          CUDA_OR_DIE(cudaEventRecord(begin[k][l], compute));
          spin.Launch(compute, layer_ns);
          CUDA_OR_DIE(cudaEventRecord(end[k][l], compute));
          return absl::OkStatus();
        },
        /*record_events=*/true);
    if (!got.ok()) {
      std::fprintf(stderr, "events pipeline: %s\n", std::string(got.status().message()).c_str());
      std::exit(1);
    }
  }
  CUDA_OR_DIE(cudaStreamSynchronize(compute));
  const double events_total = Since(e0) - eclock.origin_s;
  AddCompute(eclock, begin, end, &event_rows);
  WriteTimeline("layerwise_events", event_rows);
  cudaFree(er.ptr);

  JsonLine()
      .S("bench", "gpu_worker_layerwise")
      .N("first_layer_frame_ms", Pct(first_frame, 50) * 1e3)
      .N("events_load_chunk_ms", Pct(events_load, 50) * 1e3)
      .N("events_first_layer_ms", Pct(events_first, 50) * 1e3)
      .N("events_pipelined_ms", events_total * 1e3)
      .N("events_compute_busy_share", BusyShare(event_rows))
      .N("chunks", chunks)
      .N("layers", layers)
      .N("chunk_mib", layers)
      .N("load_chunk_ms", load_chunk * 1e3)
      .N("compute_layer_ms", layer_ns / 1e6)
      .N("compute_only_ms", chunks * layers * layer_ns / 1e6)
      .N("load_only_ms", chunks * load_chunk * 1e3)
      .N("pipelined_ms", total * 1e3)
      .N("compute_busy_share", busy)
      .N("median_overlap_k_with_k_minus_1", Pct(overlap, 50))
      .Emit();
  cudaFree(r.ptr);
}

void Prefill() {
  TimelineSetUp setup;
  const uint32_t layers = setup.layers, chunks = setup.chunks;
  Daemon& d = setup.d;
  const Region& r = setup.r;
  Spinner spin;
  // Per-chunk compute: the same factor over a whole chunk's transfer, measured here.
  std::vector<double> load;
  v1::Tier tier;
  for (int i = 0; i < 5; ++i) load.push_back(TimedGet(d, i % chunks, r, &tier));
  const double load_chunk = Pct(load, 50);
  const double factor = DFlag("compute-factor", 1.25);
  const uint64_t layer_ns = static_cast<uint64_t>(load_chunk / layers * factor * 1e9);
  const double chunk_s = layer_ns * 1e-9 * layers;

  cudaStream_t compute;
  CUDA_OR_DIE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  std::vector<std::vector<cudaEvent_t>> begin, end;
  const auto t0 = Clock::now();
  GpuClock clock = StartGpuClock(compute, t0);
  std::vector<Interval> rows;
  std::mutex mu;
  std::vector<double> arrived(chunks, 0);
  PrefillOptions options;
  options.into_device = PrefillOptions::DeviceInto{r.reg, 0};
  options.on_chunk_in_place = [&](uint32_t index, v1::Tier) {
    std::lock_guard<std::mutex> l(mu);
    arrived[index] = Since(t0);
  };
  options.compute_estimate = ComputeEstimate{chunk_s, 0};  // a + b * i: flat.
  std::vector<ChunkKey> keys;
  for (uint32_t i = 0; i < chunks; ++i) keys.push_back(Key(i));
  const double open_s = Since(t0);
  auto session = PrefillSession::Start(*d.client, d.ns, keys, options);
  if (!session.ok()) {
    std::fprintf(stderr, "prefill: %s\n", std::string(session.status().message()).c_str());
    std::exit(1);
  }
  for (uint32_t i = 0; i < chunks && (*session)->ShouldCompute(i); ++i) {
    begin.emplace_back(layers);
    end.emplace_back(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      CUDA_OR_DIE(cudaEventCreate(&begin[i][l]));
      CUDA_OR_DIE(cudaEventCreate(&end[i][l]));
      CUDA_OR_DIE(cudaEventRecord(begin[i][l], compute));
      spin.Launch(compute, layer_ns);
      CUDA_OR_DIE(cudaEventRecord(end[i][l], compute));
    }
    CUDA_OR_DIE(cudaEventSynchronize(end[i][layers - 1]));
    if (!(*session)->ReportComputed(i).ok()) std::exit(1);
  }
  auto result = (*session)->Finish();
  const double total = Since(t0) - open_s;
  if (!result.ok()) {
    std::fprintf(stderr, "prefill: %s\n", std::string(result.status().message()).c_str());
    std::exit(1);
  }
  (*session)->Close().IgnoreError();
  AddCompute(clock, begin, end, &rows);
  for (uint32_t i = 0; i < chunks; ++i) {
    if (arrived[i] > 0) rows.push_back({"transfer", i, 0, arrived[i], arrived[i]});
  }
  WriteTimeline("prefill", rows);
  JsonLine()
      .S("bench", "gpu_worker_prefill")
      .N("chunks", chunks)
      .N("chunk_mib", layers)
      .N("load_chunk_ms", load_chunk * 1e3)
      .N("compute_chunk_ms", chunk_s * 1e3)
      .N("computed", static_cast<uint64_t>(begin.size()))
      .N("streamed", result->chunks_streamed)
      .N("first_streamed", result->first_streamed)
      .N("compute_only_ms", chunks * chunk_s * 1e3)
      .N("load_only_ms", chunks * load_chunk * 1e3)
      .N("session_ms", total * 1e3)
      .N("compute_busy_share", BusyShare(rows))
      .S("reason", v1::PrefillDone::Reason_Name(result->reason))
      .Emit();
  cudaFree(r.ptr);
}

int Main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "gpu_worker_bench: no GPU; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop;
  CUDA_OR_DIE(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(stderr, "gpu_worker_bench on %s\n", prop.name);
  for (uint64_t mib : ListFlag("sizes-mib", "32,128")) H2d(mib);
  if (Flag("h2d-only", 0) != 0) return 0;
  Layerwise();
  Prefill();
  return 0;
}

}  // namespace
}  // namespace kvtier::bench

int main(int argc, char** argv) {
  kvtier::bench::InitFlags(argc, argv);
  return kvtier::bench::Main();
}
