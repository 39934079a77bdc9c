// A worker on a real GPU against a real kvtierd (CTest label `gpu`): this process plays
// the worker. It allocates device memory with the CUDA runtime, registers it with the
// daemon by its CUDA IPC handle (the daemon is another process, as CUDA IPC requires),
// and has chunks delivered into it by Get (chunk-major and layer-major, each item
// announced once it landed, or once queued with the worker's own events recorded after
// it) and by a Prefill session, and Puts chunks from it. Then what
// a worker gets wrong: a stale or foreign handle, an allocation smaller than it says, a
// worker that exits with a registration and a transfer in flight, and staging buffers
// larger than the GPU. After each the daemon still serves from RAM.
// Without a GPU every test skips; `ctest -L gpu` on a GPU host runs them.
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/kvtier_client.h"
#include "client/prefill_session.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

extern char** environ;

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::PatternBytes;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint32_t kLayers = 4;  // LayoutOfMiB(4): 4 layers of 1 MiB.
constexpr uint64_t kChunk = kLayers * kMiB;
// Set in the environment of the child that plays a worker exiting mid-transfer.
constexpr char kHelperEnv[] = "KVTIER_GPU_TEST_EXITING_WORKER";

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Device memory of this process and its IPC handle.
struct WorkerMemory {
  explicit WorkerMemory(uint64_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess);
    cudaIpcMemHandle_t h;
    EXPECT_EQ(cudaIpcGetMemHandle(&h, ptr), cudaSuccess);
    handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  ~WorkerMemory() { cudaFree(ptr); }
  std::string Read(uint64_t offset, uint64_t n) const {
    std::string out(n, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), static_cast<char*>(ptr) + offset, n,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }
  void Write(uint64_t offset, const std::string& data) {
    EXPECT_EQ(cudaMemcpy(static_cast<char*>(ptr) + offset, data.data(), data.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  void* ptr = nullptr;
  uint64_t bytes;
  std::string handle;
};

class DaemonGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv(kHelperEnv) != nullptr) return;  // The child: see ExitingWorker.
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  }

  void StartDaemon(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--shm-socket=auto", "--gpu=0", "--gpu-staging-size=64MiB",
                                     "--ram-capacity=256MiB", "--write-mode=ram-only"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto d = testing::DaemonProcess::Start(testing::MakeTempDir("gpu") + "/data", args);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::make_unique<testing::DaemonProcess>(*std::move(d));
    auto client = KvTierClient::Connect(daemon_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    auto reg = client_->RegisterLayout(LayoutOfMiB(kLayers));
    ASSERT_TRUE(reg.ok()) << reg.status();
    ns_ = reg->namespace_id;
  }

  void Put(uint64_t i) {
    const std::string data = PatternBytes(i, kChunk);
    ChunkToPut chunk{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(ns_, {&chunk, 1}).ok());
  }

  double Metric(const std::string& series) {
    auto r = testing::HttpGet(daemon_->metrics_port(), "/metrics");
    return r.ok() ? testing::SeriesValue(r->body, series) : -1;
  }

  // The daemon still serves chunks from RAM, over the stream.
  void ExpectServesFromRam(uint64_t i) {
    auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(i)});
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 1u);
    EXPECT_TRUE((*got)[0].found);
    EXPECT_TRUE((*got)[0].data == PatternBytes(i, kChunk));
  }

  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(DaemonGpuTest, GetDeliversChunksAndLayersIntoTheWorkersGpuMemory) {
  StartDaemon();
  EXPECT_EQ(Metric("kvtier_gpu_available"), 1);
  EXPECT_EQ(Metric("kvtier_gpu_pool_pinned"), 1);
  for (uint64_t i = 0; i < 4; ++i) Put(i);
  WorkerMemory mem(8 * kChunk);
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();

  // Chunk-major at the start of the region: each key announced once it landed.
  std::vector<uint32_t> announced;
  auto got = client_->GetIntoDevice(
      ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1), KeyOf(99), KeyOf(2)}, *reg, 0,
      std::nullopt, v1::GET_ORDER_CHUNK_MAJOR, 0, [&](uint32_t key, uint32_t) {
        announced.push_back(key);
        return absl::OkStatus();
      });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->found, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(announced, (std::vector<uint32_t>{0, 1, 3}));
  EXPECT_TRUE(mem.Read(0, kChunk) == PatternBytes(0, kChunk));
  EXPECT_TRUE(mem.Read(kChunk, kChunk) == PatternBytes(1, kChunk));
  EXPECT_TRUE(mem.Read(3 * kChunk, kChunk) == PatternBytes(2, kChunk));
#ifdef KVTIER_HAVE_CUDA_KERNELS
  // Whole chunks were checked on the GPU, where they landed.
  EXPECT_GE(Metric("kvtier_gpu_crc_checked_bytes_total{on=\"gpu\"}"), 3.0 * kChunk);
#endif

  // Layer-major, layers [1, 4) of two chunks after the first four: layer by layer, each
  // layer of each key once it landed, and exactly those bytes.
  std::vector<std::pair<uint32_t, uint32_t>> layers;
  auto part = client_->GetIntoDevice(
      ns_, std::vector<ChunkKey>{KeyOf(3), KeyOf(1)}, *reg, 4 * kChunk, LayerRange{1, 4},
      v1::GET_ORDER_LAYER_MAJOR, 0, [&](uint32_t key, uint32_t layer) {
        layers.emplace_back(key, layer);
        return absl::OkStatus();
      });
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ(layers, (std::vector<std::pair<uint32_t, uint32_t>>{{0, 1}, {1, 1}, {0, 2},
                                                                {1, 2}, {0, 3}, {1, 3}}));
  const uint64_t part_bytes = 3 * kMiB;
  EXPECT_TRUE(mem.Read(4 * kChunk, part_bytes) == PatternBytes(3, kChunk).substr(kMiB));
  EXPECT_TRUE(mem.Read(4 * kChunk + part_bytes, part_bytes) ==
              PatternBytes(1, kChunk).substr(kMiB));
  EXPECT_GT(Metric("kvtier_gpu_delivered_bytes_total"), 0);
  EXPECT_TRUE(client_->ReleaseDeviceMemory(reg->region_id).ok());
}

// record_events: the worker's stream waits on the worker's own interprocess events,
// which the daemon records on its copy streams after each layer, so the worker queues
// its reads of a layer (here a copy back to the host, as a kernel would) as soon as the
// layer's frame says its copies are queued, before they land. The region starts out
// zeroed: a read that ran before its layer landed would see zeros.
TEST_F(DaemonGpuTest, TheWorkersStreamWaitsOnEventsTheDaemonRecordsAfterEachLayer) {
  StartDaemon();
  for (uint64_t i = 0; i < 4; ++i) Put(i);
  constexpr uint32_t kUsed = 2;  // Layers [0, 2) of 4 keys: 8 items.
  constexpr uint64_t kKeyBytes = kUsed * kMiB;
  WorkerMemory mem(4 * kKeyBytes);
  ASSERT_EQ(cudaMemset(mem.ptr, 0, mem.bytes), cudaSuccess);
  std::vector<cudaEvent_t> events(8);
  std::vector<std::string> handles;
  for (cudaEvent_t& e : events) {
    ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming),
              cudaSuccess);
    cudaIpcEventHandle_t h;
    ASSERT_EQ(cudaIpcGetEventHandle(&h, e), cudaSuccess);
    handles.emplace_back(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes, handles);
  ASSERT_TRUE(reg.ok()) << reg.status();
  // The same events in a second region: opened twice in the daemon, closed twice.
  auto twice = client_->RegisterDeviceMemory(mem.handle, mem.bytes, handles);
  ASSERT_TRUE(twice.ok()) << twice.status();
  EXPECT_TRUE(client_->ReleaseDeviceMemory(twice->region_id).ok());

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  char* back = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&back), mem.bytes), cudaSuccess);
  std::memset(back, 0x55, mem.bytes);
  std::vector<uint32_t> items;
  auto got = client_->GetIntoDevice(
      ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3)}, *reg, 0,
      LayerRange{0, kUsed}, v1::GET_ORDER_LAYER_MAJOR, 0,
      [&](uint32_t key, uint32_t layer) {
        const uint32_t item = layer * 4 + key;
        items.push_back(item);
        const uint64_t at = key * kKeyBytes + layer * kMiB;
        EXPECT_EQ(cudaStreamWaitEvent(stream, events[item], 0), cudaSuccess);
        EXPECT_EQ(cudaMemcpyAsync(back + at, static_cast<char*>(mem.ptr) + at, kMiB,
                                  cudaMemcpyDeviceToHost, stream),
                  cudaSuccess);
        return absl::OkStatus();
      },
      /*record_events=*/true);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(items, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  for (uint64_t k = 0; k < 4; ++k) {
    EXPECT_TRUE(std::string(back + k * kKeyBytes, kKeyBytes) ==
                PatternBytes(k, kChunk).substr(0, kKeyBytes))
        << "key " << k;
  }
  // Too many items for the events: refused before any copy, and it says so.
  auto too_many = client_->GetIntoDevice(
      ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3)}, *reg, 0,
      LayerRange{0, 3}, v1::GET_ORDER_LAYER_MAJOR, 0, nullptr, /*record_events=*/true);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument) << too_many.status();
  EXPECT_TRUE(client_->ReleaseDeviceMemory(reg->region_id).ok());
  ExpectServesFromRam(0);
  cudaFreeHost(back);
  cudaStreamDestroy(stream);
  for (cudaEvent_t e : events) cudaEventDestroy(e);
}

TEST_F(DaemonGpuTest, PrefillSessionStreamsIntoGpuMemory) {
  StartDaemon();
  for (uint64_t i = 0; i < 6; ++i) Put(i);
  WorkerMemory mem(6 * kChunk);
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 6; ++i) keys.push_back(KeyOf(i));
  std::vector<uint32_t> placed;
  PrefillOptions options;
  options.into_device = PrefillOptions::DeviceInto{*reg, 0};
  options.on_chunk_in_place = [&](uint32_t index, v1::Tier) {
    // The copy is complete when announced: read it on another stream right away.
    EXPECT_TRUE(mem.Read(index * kChunk, kChunk) == PatternBytes(index, kChunk)) << index;
    placed.push_back(index);
  };
  options.compute_estimate = ComputeEstimate{100, 0};  // Slow worker: all streamed.
  auto session = PrefillSession::Start(*client_, ns_, keys, options);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::ALL_STREAMED);
  EXPECT_EQ(placed, (std::vector<uint32_t>{5, 4, 3, 2, 1, 0}));
  EXPECT_TRUE((*session)->Close().ok());
}

TEST_F(DaemonGpuTest, PutTakesChunksFromTheWorkersGpuMemory) {
  StartDaemon();
  WorkerMemory mem(2 * kChunk);
  const std::string a = PatternBytes(7, kChunk);
  mem.Write(kChunk, a);
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  auto put = [&](uint32_t crc) {
    v1::PutFrame f;
    f.set_namespace_id(ns_);
    f.set_key(KeyOf(7).ToByteString());
    f.set_token_count(256);
    f.mutable_region()->set_region_id(reg->region_id);
    f.mutable_region()->set_token(reg->token);
    f.mutable_region()->set_offset(kChunk);
    f.mutable_region()->set_length(kChunk);
    f.set_crc32c(crc);
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto writer = stub->Put(&ctx, &resp);
    writer->Write(f);
    writer->WritesDone();
    return writer->Finish();
  };
  // A CRC32C that does not match the device bytes stores nothing.
  EXPECT_EQ(put(crc32c::Value(a) ^ 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto absent = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7)});
  ASSERT_TRUE(absent.ok());
  EXPECT_FALSE((*absent)[0].found);
  // The client's call sends the same frame.
  const DeviceChunkToPut chunk[] = {{KeyOf(7), kChunk, crc32c::Value(a), 256}};
  auto stored = client_->PutFromDevice(ns_, chunk, *reg);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->stored, 1u);
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7)});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)[0].found);
  EXPECT_TRUE((*got)[0].data == a);
}

TEST_F(DaemonGpuTest, BadHandlesAndShortAllocationsAreRefusedAndTheDaemonGoesOn) {
  StartDaemon();
  Put(0);
  WorkerMemory mem(2 * kChunk);
  // Zeros (stale or foreign), a handle of the wrong size, an allocation smaller than the
  // registration says: InvalidArgument, never a code that says retry.
  EXPECT_EQ(client_->RegisterDeviceMemory(std::string(64, '\0'), kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RegisterDeviceMemory("short", kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RegisterDeviceMemory(mem.handle, 64 * kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A handle of memory freed since: stale.
  std::string stale;
  {
    WorkerMemory gone(kChunk);
    stale = gone.handle;
  }
  EXPECT_FALSE(client_->RegisterDeviceMemory(stale, kChunk).ok());
  // A get past the region's end is refused before any copy.
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(client_->GetIntoDevice(ns_, std::vector<ChunkKey>{KeyOf(0)}, *reg, 2 * kChunk - 1)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  ExpectServesFromRam(0);
  auto ok = client_->GetIntoDevice(ns_, std::vector<ChunkKey>{KeyOf(0)}, *reg, 0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(mem.Read(0, kChunk) == PatternBytes(0, kChunk));
}

// The child's side of the test below: registers its GPU memory, writes the registration
// to the file the parent named, starts a Get of many chunks into it and exits (no
// cleanup: no release, no cudaFree) once the first chunk landed.
TEST_F(DaemonGpuTest, ExitingWorker) {
  const char* spec = std::getenv(kHelperEnv);
  if (spec == nullptr) GTEST_SKIP() << "the child process of WorkerExitingMidTransfer...";
  const std::vector<std::string> parts = absl::StrSplit(spec, ',');  // target,ns,file
  uint64_t ns = 0;
  ASSERT_EQ(parts.size(), 3u);
  ASSERT_TRUE(absl::SimpleAtoi(parts[1], &ns));
  auto client = KvTierClient::Connect(parts[0]);
  ASSERT_TRUE(client.ok());
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 16 * kChunk), cudaSuccess);
  cudaIpcMemHandle_t h;
  ASSERT_EQ(cudaIpcGetMemHandle(&h, p), cudaSuccess);
  auto reg = (*client)->RegisterDeviceMemory(
      std::string(reinterpret_cast<const char*>(&h), sizeof(h)), 16 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  std::ofstream(parts[2]) << reg->region_id << "," << reg->token << "\n";
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 16; ++i) keys.push_back(KeyOf(i % 8));
  (void)(*client)->GetIntoDevice(ns, keys, *reg, 0, std::nullopt, v1::GET_ORDER_CHUNK_MAJOR,
                                 0, [](uint32_t, uint32_t) -> absl::Status { _exit(0); });
  _exit(1);  // Nothing landed.
}

TEST_F(DaemonGpuTest, WorkerExitingMidTransferLeaksNothingAndTheDaemonGoesOn) {
  StartDaemon();
  for (uint64_t i = 0; i < 8; ++i) Put(i);
  const std::string file = testing::MakeTempDir("gpu-child") + "/registration";
  const std::string env = std::string(kHelperEnv) + "=" + daemon_->target() + "," +
                          std::to_string(ns_) + "," + file;
  std::vector<std::string> env_strings = {env};
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe", filter = "--gtest_filter=DaemonGpuTest.ExitingWorker";
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the child exited before anything landed";
  std::string line;
  std::getline(std::ifstream(file), line);
  const std::vector<std::string> parts = absl::StrSplit(line, ',');
  ASSERT_EQ(parts.size(), 2u);
  RegionChannel::Registration dead;
  ASSERT_TRUE(absl::SimpleAtoi(parts[0], &dead.region_id));
  ASSERT_TRUE(absl::SimpleAtoi(parts[1], &dead.token));
  dead.bytes = 16 * kChunk;

  // The daemon dropped the dead worker's registration (its region socket closed), so
  // its memory is never written again; it still serves this worker from RAM and into
  // this worker's GPU memory.
  WorkerMemory mem(kChunk);
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE(testing::Eventually([&] {
    auto got = client_->GetIntoDevice(ns_, std::vector<ChunkKey>{KeyOf(0)}, dead, 0);
    return !got.ok() && got.status().code() != absl::StatusCode::kUnavailable;
  }));
  ExpectServesFromRam(5);
  auto got = client_->GetIntoDevice(ns_, std::vector<ChunkKey>{KeyOf(5)}, *reg, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(mem.Read(0, kChunk) == PatternBytes(5, kChunk));
}

TEST_F(DaemonGpuTest, StagingLargerThanTheGpuIsADegradedModeNotACrash) {
  // 1024 TiB of staging buffers cannot be allocated: the daemon starts without them, says
  // so in a metric, and delivers into GPU memory from its pinned pool.
  StartDaemon({"--gpu-staging-size=1024TiB"});
  EXPECT_EQ(Metric("kvtier_gpu_available"), 1);
  EXPECT_EQ(Metric("kvtier_gpu_staging_enabled"), 0);
  Put(1);
  WorkerMemory mem(kChunk);
  auto reg = client_->RegisterDeviceMemory(mem.handle, mem.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto got = client_->GetIntoDevice(ns_, std::vector<ChunkKey>{KeyOf(1)}, *reg, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(mem.Read(0, kChunk) == PatternBytes(1, kChunk));
}

}  // namespace
}  // namespace kvtier
