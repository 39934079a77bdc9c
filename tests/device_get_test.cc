// Get into a worker's GPU memory, end to end through a real gRPC server and region
// socket in this process, on the fake device backend (a GPU made of host memory, so it
// runs everywhere): a worker registers device memory by its IPC handle, Gets chunks and
// layer ranges into it, and sees one frame per item once its bytes landed, saying which
// tier they came from. Then what workers get wrong or the device does: stale, foreign
// and too-small handles, a daemon without a GPU, targets outside the region, a wrong
// token, a device error mid-copy, and a worker that exits with a transfer in flight.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/kvtier_client.h"
#include "client/prefill_session.h"
#include "client/region_channel.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/kv_cache_service.h"
#include "server/lease_table.h"
#include "server/prefill_runner.h"
#include "server/region_socket.h"
#include "server/region_table.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/tiered_store.h"
#include "tests/support/daemon_process.h"
#include "tests/support/fake_clock.h"
#include "tests/support/fake_device_backend.h"
#include "tests/support/stalling_proxy.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::PatternBytes;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint32_t kLayers = 4;  // LayoutOfMiB(4): 4 layers of 1 MiB.
constexpr uint64_t kChunk = kLayers * kMiB;
constexpr uint64_t kInstance = 0x6b7674696572;

struct Frames {
  std::vector<v1::GetFrame> frames;
  grpc::Status status;
};

class DeviceGetTest : public ::testing::Test {
 protected:
  // `streams` (may be null: no bound) is the service's max_streams limiter.
  void Start(FakeDeviceOptions device_options = {}, bool with_gpu = true,
             StallReaper* stalls = nullptr, uint64_t staging_chunks = 2,
             StreamLimiter* streams = nullptr) {
    SetMinLogLevel(LogLevel::kError);
    device_ = std::make_unique<FakeDeviceBackend>(device_options);
    hold_copies_ = device_options.hold_copies;
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 8 * kChunk;
    o.max_chunk_bytes = kChunk;
    if (with_gpu) o.device = device_.get();
    o.gpu_staging.capacity_bytes = staging_chunks * kChunk;
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);

    regions_ = std::make_unique<RegionTable>(RegionTableOptions{});
    RegionSocketOptions socket_options;
    socket_name_ = "@kvtier-device-get-test-" + std::to_string(getpid());
    socket_options.name = socket_name_;
    socket_options.instance_id = kInstance;
    socket_options.device = with_gpu ? device_.get() : nullptr;
    auto socket = RegionSocket::Start(socket_options, regions_.get());
    ASSERT_TRUE(socket.ok()) << socket.status();
    socket_ = *std::move(socket);

    prefill_ = std::make_unique<PrefillRunner>(PrefillRunnerOptions{}, nullptr);
    leases_ = std::make_unique<LeaseTable>(LeaseTableOptions{});
    service_ = std::make_unique<KvCacheService>(
        ServiceLimits{}, "test", nullptr, prefill_.get(), leases_.get(),
        DataPlaneInfo{.regions = regions_.get(), .socket = socket_name_, .instance_id = kInstance},
        /*events=*/nullptr, ServiceGuards{.streams = streams, .stalls = stalls});
    service_->SetStore(store_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = "127.0.0.1:" + std::to_string(port);
    stub_ = v1::KvCache::NewStub(grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));

    auto client = KvTierClient::Connect(target_);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    auto reg = client_->RegisterLayout(LayoutOfMiB(kLayers));
    ASSERT_TRUE(reg.ok()) << reg.status();
    ns_ = reg->namespace_id;
  }

  void TearDown() override {
    client_.reset();
    if (server_) {
      // Copies a failed test left held would keep calls open, and Shutdown waiting on
      // them: run them meanwhile (a no-op for a passing test).
      std::atomic<bool> down{false};
      std::thread drain([&] {
        while (!down.load()) {
          if (hold_copies_) device_->RunPending();
          absl::SleepFor(absl::Milliseconds(1));
        }
      });
      server_->Shutdown();
      down = true;
      drain.join();
    }
    server_.reset();
    if (device_ != nullptr) device_->RunPending();  // Held copies (hold_copies tests).
    service_.reset();
    socket_.reset();
    regions_.reset();
    leases_.reset();  // Its leases hold pool chunks: before the store.
    store_.reset();
    if (device_ == nullptr) return;
    // Only the worker's own buffers are left; every IPC mapping was closed.
    EXPECT_EQ(device_->open_ipc_mappings(), 0u);
    EXPECT_EQ(device_->open_ipc_events(), 0u);
    EXPECT_EQ(device_->pinned_ranges(), 0u);
    EXPECT_EQ(device_->live_allocations(), worker_buffers_);
    EXPECT_TRUE(device_->misuse().empty()) << device_->misuse()[0];
  }

  void Put(uint64_t i) {
    const std::string data = PatternBytes(i, kChunk);
    ChunkToPut chunk{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(ns_, {&chunk, 1}).ok());
  }

  // A worker's device buffer and its IPC handle.
  std::pair<DevicePtr, std::string> WorkerBuffer(uint64_t bytes) {
    auto p = device_->Allocate(bytes);
    EXPECT_TRUE(p.ok());
    ++worker_buffers_;
    auto handle = device_->ExportIpcMemory(*p);
    EXPECT_TRUE(handle.ok());
    return {*p, *handle};
  }

  // A worker's interprocess events and their IPC handles.
  std::vector<std::string> WorkerEvents(int n) {
    std::vector<std::string> handles;
    for (int i = 0; i < n; ++i) handles.push_back(device_->ExportIpcEvent());
    return handles;
  }

  std::shared_ptr<RegionChannel> Channel() {
    auto ch = RegionChannel::Connect(socket_name_, kInstance);
    EXPECT_TRUE(ch.ok()) << ch.status();
    return ch.ok() ? *ch : nullptr;
  }

  v1::GetRequest Request(const std::vector<uint64_t>& keys, uint64_t region, uint64_t token) {
    v1::GetRequest req;
    req.set_namespace_id(ns_);
    for (uint64_t k : keys) {
      const auto b = KeyOf(k).ToBytes();
      req.add_keys(std::string(reinterpret_cast<const char*>(b.data()), b.size()));
    }
    req.mutable_target()->set_region_id(region);
    req.mutable_target()->set_token(token);
    req.mutable_target()->add_offsets(0);
    return req;
  }

  Frames Get(const v1::GetRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // Hangs.
    auto reader = stub_->Get(&ctx, req);
    Frames out;
    v1::GetFrame f;
    while (reader->Read(&f)) out.frames.push_back(f);
    out.status = reader->Finish();
    return out;
  }

  std::string Landed(DevicePtr p, uint64_t n) { return std::string(device_->HostView(p), n); }

  // A Prefill's open for keys 0..n-1 into `reg` from its start, with compute forecast so
  // slow that the daemon streams every cached chunk.
  v1::PrefillClientMessage AllStreamedOpen(uint64_t n, const RegionChannel::Registration& reg) {
    v1::PrefillClientMessage open;
    open.mutable_open()->set_namespace_id(ns_);
    for (uint64_t i = 0; i < n; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
    open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);
    open.mutable_open()->mutable_target()->set_region_id(reg.region_id);
    open.mutable_open()->mutable_target()->set_token(reg.token);
    open.mutable_open()->mutable_target()->add_offsets(0);
    return open;
  }

  std::unique_ptr<FakeDeviceBackend> device_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<RegionTable> regions_;
  std::unique_ptr<RegionSocket> socket_;
  std::unique_ptr<PrefillRunner> prefill_;
  std::unique_ptr<LeaseTable> leases_;
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<KvTierClient> client_;
  std::string socket_name_, target_;
  uint64_t ns_ = 0;
  size_t worker_buffers_ = 0;
  bool hold_copies_ = false;
  // Outlive the server and its calls: TearDown shuts it down before members go.
  testing::FakeClock clock_;
  std::unique_ptr<StallReaper> reaper_;
};

TEST_F(DeviceGetTest, ChunksLandInTheWorkersGpuMemoryFromStagingAndFromRam) {
  Start();
  for (uint64_t i = 0; i < 3; ++i) Put(i);
  // A leased Lookup stages its hits for the worker.
  v1::LookupRequest lookup;
  lookup.set_namespace_id(ns_);
  const auto b = KeyOf(0).ToBytes();
  lookup.add_keys(std::string(reinterpret_cast<const char*>(b.data()), b.size()));
  lookup.set_lease_seconds(10);
  v1::LookupResponse looked;
  grpc::ClientContext lctx;
  ASSERT_TRUE(stub_->Lookup(&lctx, lookup, &looked).ok());
  device_->Drain();
  EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(0)}), Tier::kGpu);

  grpc::ClientContext dctx;
  v1::DataPlaneResponse plane;
  ASSERT_TRUE(stub_->DataPlane(&dctx, v1::DataPlaneRequest(), &plane).ok());
  EXPECT_TRUE(plane.device_memory());

  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  const Frames got = Get(Request({0, 1, 2, 99}, reg->region_id, reg->token));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_EQ(got.frames.size(), 4u);
  for (uint32_t k = 0; k < 4; ++k) {
    EXPECT_EQ(got.frames[k].key_index(), k);
    EXPECT_TRUE(got.frames[k].last());
    EXPECT_TRUE(got.frames[k].data().empty());
  }
  EXPECT_EQ(got.frames[0].tier(), v1::TIER_GPU);
  EXPECT_EQ(got.frames[1].tier(), v1::TIER_RAM);
  EXPECT_EQ(got.frames[2].total_bytes(), kChunk);
  EXPECT_FALSE(got.frames[3].found());
  for (uint64_t k = 0; k < 3; ++k) {
    EXPECT_TRUE(Landed(buf + k * kChunk, kChunk) == PatternBytes(k, kChunk)) << "key " << k;
  }
  const TieredStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.gpu.deliveries_from_staging, 1u);
  EXPECT_EQ(stats.gpu.deliveries_from_host, 2u);
}

TEST_F(DeviceGetTest, LayerMajorSendsAFramePerLayerAsItLands) {
  Start();
  Put(0);
  Put(1);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok());
  // Key 99 is absent: answered once, in the first pass, and left out of the second.
  v1::GetRequest req = Request({0, 99, 1}, reg->region_id, reg->token);
  req.set_order(v1::GET_ORDER_LAYER_MAJOR);
  req.mutable_layer_range()->set_begin(1);
  req.mutable_layer_range()->set_end(3);
  const Frames got = Get(req);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_EQ(got.frames.size(), 5u);
  const uint32_t want[5][3] = {{1, 0, 1}, {1, 1, 0}, {1, 2, 1}, {2, 0, 1}, {2, 2, 1}};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(got.frames[i].key_index(), want[i][1]) << i;
    EXPECT_EQ(got.frames[i].found(), want[i][2] == 1) << i;
    if (!got.frames[i].found()) continue;
    EXPECT_EQ(got.frames[i].layer(), want[i][0]) << i;
    EXPECT_EQ(got.frames[i].total_bytes(), kMiB);
  }
  // Key index k's two layers back to back at k * 2 MiB.
  for (uint64_t k : {0, 2}) {
    const std::string chunk = PatternBytes(k == 0 ? 0 : 1, kChunk);
    EXPECT_TRUE(Landed(buf + k * 2 * kMiB, 2 * kMiB) == chunk.substr(kMiB, 2 * kMiB)) << k;
  }
}

// Later-pass items of absent keys count in the copy window: with three absent keys over
// four layers (twelve items, a window of eight), skipping them once left the last item
// unissued with nothing in flight to pump the call again, and the Get hung for ever.
TEST_F(DeviceGetTest, LayerMajorOverManyAbsentKeysEnds) {
  Start();
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok());
  v1::GetRequest req = Request({97, 98, 99}, reg->region_id, reg->token);
  req.set_order(v1::GET_ORDER_LAYER_MAJOR);
  const Frames got = Get(req);
  ASSERT_TRUE(got.status.ok()) << got.status.error_code() << ": " << got.status.error_message();
  ASSERT_EQ(got.frames.size(), 3u);  // One per absent key, in the first pass.
  for (uint32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(got.frames[k].key_index(), k);
    EXPECT_FALSE(got.frames[k].found()) << k;
  }
}

// The C++ client's call for it: the frames checked against the protocol, one callback
// per landed item.
TEST_F(DeviceGetTest, ClientGetIntoDeviceReportsEachItemAsItLands) {
  Start();
  Put(0);
  Put(1);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok());
  std::vector<std::pair<uint32_t, uint32_t>> landed;
  auto got = client_->GetIntoDevice(
      ns_, std::vector<ChunkKey>{KeyOf(1), KeyOf(42), KeyOf(0)}, *reg, kChunk,
      LayerRange{0, kLayers}, v1::GET_ORDER_LAYER_MAJOR, 0,
      [&](uint32_t key, uint32_t layer) {
        landed.emplace_back(key, layer);
        return absl::OkStatus();
      });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->found, (std::vector<bool>{true, false, true}));
  // RAM for the first layer; later layers may come from staging, where the first
  // delivery put the chunk meanwhile.
  EXPECT_NE(got->tiers[0], v1::TIER_UNSPECIFIED);
  EXPECT_NE(got->tiers[0], v1::TIER_SSD);
  EXPECT_EQ(got->tiers[1], v1::TIER_UNSPECIFIED);
  ASSERT_EQ(landed.size(), 2u * kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_EQ(landed[2 * l], std::make_pair(0u, l));
    EXPECT_EQ(landed[2 * l + 1], std::make_pair(2u, l));
  }
  EXPECT_TRUE(Landed(buf + kChunk, kChunk) == PatternBytes(1, kChunk));
  EXPECT_TRUE(Landed(buf + 3 * kChunk, kChunk) == PatternBytes(0, kChunk));
  // Each chunk's CRC32C was checked once, at its first layer (from RAM), not per layer.
  EXPECT_EQ(store_->GetStats().gpu.crc_checked_bytes, 2 * kChunk);
  // Keys that do not fit: the daemon's InvalidArgument.
  EXPECT_EQ(client_->GetIntoDevice(ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1)}, *reg,
                                   3 * kChunk)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A Prefill session streaming backward into GPU memory: the cached chunks are staged at
// open, then each streamed chunk is copied on the device and announced once it landed.
TEST_F(DeviceGetTest, PrefillStreamsChunksIntoGpuMemory) {
  Start();
  for (uint64_t i = 0; i < 3; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(3 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 3 * kChunk);
  ASSERT_TRUE(reg.ok());
  grpc::ClientContext ctx;
  auto stream = stub_->Prefill(&ctx);
  v1::PrefillClientMessage open;
  open.mutable_open()->set_namespace_id(ns_);
  for (uint64_t i = 0; i < 3; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
  // Compute is forecast to be very slow: the daemon streams every cached chunk.
  open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);
  open.mutable_open()->mutable_target()->set_region_id(reg->region_id);
  open.mutable_open()->mutable_target()->set_token(reg->token);
  open.mutable_open()->mutable_target()->add_offsets(0);
  ASSERT_TRUE(stream->Write(open));
  v1::PrefillServerMessage msg;
  std::vector<uint32_t> chunks;
  v1::PrefillDone done;
  uint64_t staged_at_plan = 0;
  while (stream->Read(&msg)) {
    // The plan is sent after the session asked for its chunks to be staged.
    if (msg.has_plan()) {
      staged_at_plan = store_->GetStats().gpu.stage_requests;
      // The pace forecast is the GPU's (the device prior, nothing measured yet), not a
      // network connection's (1 GB/s), which would keep the daemon from streaming.
      EXPECT_NEAR(msg.plan().stream_bytes_per_second(), PrefillEstimatorOptions{}.device_prior,
                  1e3);
    }
    if (msg.has_chunk()) {
      EXPECT_TRUE(msg.chunk().last());
      EXPECT_TRUE(msg.chunk().data().empty());
      const uint32_t j = msg.chunk().index();
      EXPECT_TRUE(Landed(buf + j * kChunk, kChunk) == PatternBytes(j, kChunk)) << j;
      EXPECT_NE(msg.chunk().tier(), v1::TIER_UNSPECIFIED);
      chunks.push_back(j);
    }
    if (msg.has_done()) {
      done = msg.done();
      stream->WritesDone();
    }
  }
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(chunks, (std::vector<uint32_t>{2, 1, 0}));
  EXPECT_EQ(done.reason(), v1::PrefillDone::ALL_STREAMED);
  // The three cached chunks were sent to staging at open (whether a delivery found one
  // there yet depends on timing).
  EXPECT_GE(staged_at_plan, 3u);
}

// A device-target Prefill stages the chunks it streams first (h-1 down). Staging copies
// are in flight while the session asks for the next, and a slot whose copy is in flight
// cannot be taken: staged in ascending order, the two slots went to chunks 0 and 1
// (streamed last) and chunks 3 and 2 were refused.
TEST_F(DeviceGetTest, PrefillStagesTheChunksItStreamsFirst) {
  Start({.hold_copies = true}, /*with_gpu=*/true, /*stalls=*/nullptr, /*staging_chunks=*/2);
  for (uint64_t i = 0; i < 4; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  grpc::ClientContext ctx;
  auto stream = stub_->Prefill(&ctx);
  v1::PrefillClientMessage open = AllStreamedOpen(4, *reg);
  // Paced to a standstill, so that no delivery is queued: only the staging copies are
  // when the test runs them. (Under load the session's first deliveries were queued
  // too, and the staging each asks for evicted chunk 3 for chunk 1.)
  open.mutable_open()->set_max_bytes_per_second(1);
  open.mutable_open()->mutable_compute_estimate()->set_a_seconds(1e8);
  ASSERT_TRUE(stream->Write(open));
  v1::PrefillServerMessage msg;
  ASSERT_TRUE(stream->Read(&msg));
  ASSERT_TRUE(msg.has_plan());
  ASSERT_EQ(msg.plan().predicted_meeting(), 0u);
  device_->RunPending();  // The staging copies land.
  for (uint64_t i : {3, 2}) {
    EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(i)}), Tier::kGpu) << i;
  }
  for (uint64_t i : {1, 0}) {
    EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(i)}), Tier::kRam) << i;
  }
  EXPECT_EQ(store_->GetStats().gpu.staging.no_room, 2u);  // 1 and 0, while 3 and 2 loaded.
  ctx.TryCancel();  // TearDown runs the copies the session still waits on.
}

// A device-target Prefill delivers the copy it prefetched, or none: a chunk deleted and
// put again with other bytes between its prefetch and its device copy once landed the
// new bytes under the prefetched copy's CRC32C. It now goes back to the worker.
TEST_F(DeviceGetTest, PrefillNeverLandsAnotherCopyThanTheOneItPrefetched) {
  Start({.hold_copies = true}, /*with_gpu=*/true, /*stalls=*/nullptr, /*staging_chunks=*/0);
  for (uint64_t i = 0; i < 2; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(2 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 2 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  grpc::ClientContext ctx;
  auto stream = stub_->Prefill(&ctx);
  ASSERT_TRUE(stream->Write(AllStreamedOpen(2, *reg)));
  const auto ram_hits = [&] {
    for (const TierStats& t : store_->LocalTierStats()) {
      if (t.tier == Tier::kRam) return t.hits;
    }
    return uint64_t{0};
  };
  // Chunk 1's copy is held on the device; chunk 0 is prefetched (a RAM hit each).
  ASSERT_TRUE(testing::Eventually([&] { return device_->pending() > 0 && ram_hits() >= 2; }));
  ASSERT_TRUE(store_->Delete(ChunkId{ns_, KeyOf(0)}).ok());
  const std::string other = PatternBytes(99, kChunk);
  ChunkToPut again{KeyOf(0), other, 256};
  ASSERT_TRUE(client_->Put(ns_, {&again, 1}).ok());
  device_->RunPending();  // Chunk 1 lands.
  std::atomic<bool> done{false};
  std::thread pump([&] {  // Runs chunk 0's copy, should the session make one.
    while (!done.load()) {
      device_->RunPending();
      absl::SleepFor(absl::Milliseconds(1));
    }
  });
  v1::PrefillServerMessage msg;
  std::vector<uint32_t> landed;
  v1::PrefillDone finished;
  while (stream->Read(&msg)) {
    if (msg.has_chunk()) {
      const uint32_t j = msg.chunk().index();
      EXPECT_EQ(crc32c::Value(Landed(buf + j * kChunk, kChunk)), msg.chunk().crc32c()) << j;
      landed.push_back(j);
    }
    if (msg.has_done()) {
      finished = msg.done();
      stream->WritesDone();
    }
  }
  done = true;
  pump.join();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(landed, std::vector<uint32_t>{1});
  EXPECT_EQ(finished.reason(), v1::PrefillDone::MET);
  EXPECT_EQ(finished.first_streamed(), 1u);
}

// The client's PrefillSession with into_device: the daemon places each streamed chunk
// in the worker's GPU memory and the session announces it once it landed; options that
// name two destinations, and keys that do not fit the region, are refused.
TEST_F(DeviceGetTest, ClientPrefillSessionDeliversIntoGpuMemory) {
  Start();
  for (uint64_t i = 0; i < 3; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto reg = client_->RegisterDeviceMemory(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  const std::vector<ChunkKey> keys = {KeyOf(0), KeyOf(1), KeyOf(2)};
  std::vector<uint32_t> placed;
  PrefillOptions options;
  options.into_device = PrefillOptions::DeviceInto{*reg, kChunk};
  options.on_chunk_in_place = [&](uint32_t index, v1::Tier tier) {
    // Announced only once the bytes are in the worker's memory.
    EXPECT_TRUE(Landed(buf + kChunk + index * kChunk, kChunk) == PatternBytes(index, kChunk))
        << index;
    EXPECT_NE(tier, v1::TIER_UNSPECIFIED);
    placed.push_back(index);
  };
  options.compute_estimate = ComputeEstimate{100, 0};  // Slow worker: all streamed.
  auto session = PrefillSession::Start(*client_, ns_, keys, options);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::ALL_STREAMED);
  EXPECT_EQ(r->path, DataPath::kSharedMemory);
  EXPECT_EQ(r->chunks_streamed, 3u);
  EXPECT_EQ(placed, (std::vector<uint32_t>{2, 1, 0}));
  ASSERT_TRUE((*session)->Close().ok());

  // Two destinations; three chunks from 2 chunks into a 4-chunk region.
  PrefillOptions both = options;
  both.on_chunk = [](uint32_t, std::string, v1::Tier) {};
  both.on_chunk_in_place = nullptr;
  EXPECT_EQ(PrefillSession::Start(*client_, ns_, keys, both).status().code(),
            absl::StatusCode::kInvalidArgument);
  PrefillOptions past_end = options;
  past_end.into_device->offset = 2 * kChunk;
  EXPECT_EQ(PrefillSession::Start(*client_, ns_, keys, past_end).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client_->ReleaseDeviceMemory(reg->region_id).ok());
}

// A Prefill worker that writes its own KV into a chunk's place while the daemon copies
// the same chunk there (which the contract allows): the device's check of what landed
// differs, the pool's copy is intact, so the chunk goes back to the worker (Done MET at
// that chunk) and stays stored; nothing is deleted.
TEST_F(DeviceGetTest, PrefillChunkOverwrittenDuringItsCopyGoesBackToTheWorker) {
  // No staging: every chunk is copied from the host and checked on the device.
  Start({.checks_crc32c = true}, /*with_gpu=*/true, /*stalls=*/nullptr, /*staging_chunks=*/0);
  for (uint64_t i = 0; i < 3; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(3 * kChunk);
  auto reg = client_->RegisterDeviceMemory(handle, 3 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  device_->ChangeTargetBeforeNextCheck();  // The first streamed chunk: 2.
  std::vector<uint32_t> placed;
  PrefillOptions options;
  options.into_device = PrefillOptions::DeviceInto{*reg, 0};
  options.on_chunk_in_place = [&](uint32_t index, v1::Tier) { placed.push_back(index); };
  options.compute_estimate = ComputeEstimate{100, 0};
  auto session = PrefillSession::Start(*client_, ns_, {KeyOf(0), KeyOf(1), KeyOf(2)}, options);
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, v1::PrefillDone::MET);
  EXPECT_EQ(r->first_streamed, 3u);
  EXPECT_TRUE(placed.empty());
  EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(2)}), Tier::kRam);
  EXPECT_EQ(store_->GetStats().checksum_failures, 0u);
  EXPECT_TRUE((*session)->Close().ok());
}

// The device's pace is learned from its copies alone: a session held to a low rate by
// its own limit does not drag the next session's forecast down to that rate (the
// estimate is the daemon's, shared by every worker on this GPU).
TEST_F(DeviceGetTest, APacedSessionDoesNotSlowTheDeviceForecast) {
  Start({}, /*with_gpu=*/true, /*stalls=*/nullptr, /*staging_chunks=*/0);
  for (uint64_t i = 0; i < 3; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(3 * kChunk);
  auto reg = client_->RegisterDeviceMemory(handle, 3 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  // 1 MiB frames at 16 MiB/s: every chunk, the first streamed too, waits ~0.19 s for
  // its last three frames (the bucket's burst is 5 ms); the whole session ~0.7 s. The
  // first sample decides a fresh estimate, so a paced one would stay near kLimit.
  constexpr uint64_t kLimit = 16 * kMiB;
  double forecast[2] = {0, 0};
  for (int session = 0; session < 2; ++session) {
    PrefillOptions options;
    options.into_device = PrefillOptions::DeviceInto{*reg, 0};
    options.compute_estimate = ComputeEstimate{100, 0};
    options.max_frame_bytes = kMiB;
    if (session == 0) options.max_bytes_per_second = kLimit;
    auto s = PrefillSession::Start(*client_, ns_, {KeyOf(0), KeyOf(1), KeyOf(2)}, options);
    ASSERT_TRUE(s.ok()) << s.status();
    forecast[session] = (*s)->plan().stream_bytes_per_second();
    auto r = (*s)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->chunks_streamed, 3u);
  }
  EXPECT_NEAR(forecast[0], kLimit, 1e3);  // Its own limit caps its forecast.
  // The fake device's copies are memcpys: gigabytes per second, not 64 MiB/s.
  EXPECT_GT(forecast[1], 4.0 * kLimit);
}

TEST_F(DeviceGetTest, BadHandlesAndTargetsGetClearStatuses) {
  Start();
  Put(0);
  auto ch = Channel();
  auto [buf, handle] = WorkerBuffer(kChunk);
  // Not a handle; a handle nobody exported; one whose allocation is smaller than claimed.
  EXPECT_EQ(ch->AddDevice("short", kChunk).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ch->AddDevice(std::string(kIpcHandleBytes, 'x'), kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  const auto too_small = ch->AddDevice(handle, 2 * kChunk);
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_small.status().message().find("smaller"), std::string::npos);
  EXPECT_EQ(device_->open_ipc_mappings(), 0u);  // The refused ones were closed.

  auto reg = ch->AddDevice(handle, kChunk);
  ASSERT_TRUE(reg.ok());
  // Two chunks do not fit a one-chunk region; a wrong token; a region gone.
  EXPECT_EQ(Get(Request({0, 1}, reg->region_id, reg->token)).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Get(Request({0}, reg->region_id, reg->token + 1)).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(ch->Remove(reg->region_id).ok());
  EXPECT_EQ(Get(Request({0}, reg->region_id, reg->token)).status.error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // A revoked (stale) handle.
  device_->RevokeIpcMemory(handle);
  EXPECT_EQ(ch->AddDevice(handle, kChunk).status().code(), absl::StatusCode::kInvalidArgument);
}

// A Get into GPU memory that can never succeed is told so with no stream place free,
// not RESOURCE_EXHAUSTED ("retry"): keys that do not fit the region, a wrong token, more
// items than the region's events. While the daemon starts up the region is checked too
// (the layout, and so the fit, is not known yet), not UNAVAILABLE. These checks once ran
// only in the device path, after the place. A Prefill session takes its places first
// (so that one that never sends its open holds a place, not a thread beyond them), then
// its target is checked before the store is asked.
TEST_F(DeviceGetTest, ADeviceTargetThatCanNeverWorkIsRefusedBeforeAStreamPlace) {
  StreamLimiter streams(1, nullptr);
  Start({}, /*with_gpu=*/true, /*stalls=*/nullptr, /*staging_chunks=*/2, &streams);
  Put(0);
  Put(1);
  auto ch = Channel();
  auto [buf, handle] = WorkerBuffer(kChunk);
  std::vector<std::string> events = WorkerEvents(1);
  auto reg = ch->AddDevice(handle, kChunk, events);
  ASSERT_TRUE(reg.ok()) << reg.status();
  std::optional<StreamLimiter::Ticket> held;  // The only place.
  {
    absl::StatusOr<StreamLimiter::Ticket> place = streams.TryAcquire();
    ASSERT_TRUE(place.ok()) << place.status();
    held = *std::move(place);
  }
  // A Get that may well succeed is told to retry.
  EXPECT_EQ(Get(Request({0}, reg->region_id, reg->token)).status.error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  const Frames too_big = Get(Request({0, 1}, reg->region_id, reg->token));
  EXPECT_EQ(too_big.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << too_big.status.error_message();
  EXPECT_EQ(Get(Request({0}, reg->region_id, reg->token + 1)).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::GetRequest layer_major = Request({0}, reg->region_id, reg->token);
  layer_major.set_order(v1::GET_ORDER_LAYER_MAJOR);  // kLayers items, one event.
  layer_major.mutable_target()->set_record_events(true);
  const Frames too_few_events = Get(layer_major);
  EXPECT_EQ(too_few_events.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << too_few_events.status.error_message();
  EXPECT_NE(too_few_events.status.error_message().find("1 events"), std::string::npos)
      << too_few_events.status.error_message();

  // A Prefill session into the same region.
  const auto prefill = [&](const v1::PrefillClientMessage& open) {
    grpc::ClientContext ctx;
    auto stream = stub_->Prefill(&ctx);
    stream->Write(open);
    stream->WritesDone();
    v1::PrefillServerMessage msg;
    while (stream->Read(&msg)) {
    }
    return stream->Finish();
  };
  EXPECT_EQ(prefill(AllStreamedOpen(1, *reg)).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  v1::PrefillClientMessage wrong_token = AllStreamedOpen(1, *reg);
  wrong_token.mutable_open()->mutable_target()->set_token(reg->token + 1);
  EXPECT_EQ(prefill(wrong_token).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  held.reset();
  const grpc::Status prefill_too_big = prefill(AllStreamedOpen(2, *reg));
  EXPECT_EQ(prefill_too_big.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << prefill_too_big.error_message();
  service_->SetStore(nullptr);  // As while starting up.
  EXPECT_EQ(prefill(wrong_token).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Get(Request({0}, reg->region_id, reg->token)).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Get(Request({0}, reg->region_id, reg->token + 1)).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  service_->SetStore(store_.get());
  EXPECT_EQ(device_->submissions(), 0u);  // Nothing was copied.
}

TEST_F(DeviceGetTest, DeviceErrorMidCopyFailsTheGetAndTheDaemonGoesOn) {
  Start();
  Put(0);
  auto [buf, handle] = WorkerBuffer(kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, kChunk);
  ASSERT_TRUE(reg.ok());
  device_->FailSubmission(1, absl::UnavailableError("injected: device fell off the bus"));
  const Frames failed = Get(Request({0}, reg->region_id, reg->token));
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(failed.status.error_message().find("injected"), std::string::npos);
  // RAM still serves the stream, and the next device Get works.
  auto streamed = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(0)});
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  const Frames again = Get(Request({0}, reg->region_id, reg->token));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(Landed(buf, kChunk) == PatternBytes(0, kChunk));
}

// A device error copying a Prefill chunk into the worker's GPU memory ends the session
// with Done (CHUNK_UNAVAILABLE: compute from there), at once. It once ended without
// Done, so the session waited out its linger for a half-close the worker never sends
// and then answered CANCELLED, leaving the worker unable to tell what to compute.
TEST_F(DeviceGetTest, PrefillDeviceErrorEndsWithDoneNamingTheChunk) {
  Start({}, /*with_gpu=*/true, /*stalls=*/nullptr, /*staging_chunks=*/0);  // From RAM.
  for (uint64_t i = 0; i < 3; ++i) Put(i);
  auto [buf, handle] = WorkerBuffer(3 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 3 * kChunk);
  ASSERT_TRUE(reg.ok());
  device_->FailSubmission(1, absl::UnavailableError("injected: device fell off the bus"));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub_->Prefill(&ctx);
  v1::PrefillClientMessage open;
  open.mutable_open()->set_namespace_id(ns_);
  for (uint64_t i = 0; i < 3; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
  open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);  // Stream it all.
  open.mutable_open()->mutable_target()->set_region_id(reg->region_id);
  open.mutable_open()->mutable_target()->set_token(reg->token);
  open.mutable_open()->mutable_target()->add_offsets(0);
  ASSERT_TRUE(stream->Write(open));
  v1::PrefillServerMessage msg;
  std::optional<v1::PrefillDone> done;
  int chunks = 0;
  while (stream->Read(&msg)) {
    if (msg.has_chunk()) ++chunks;
    if (msg.has_done()) {
      done = msg.done();
      stream->WritesDone();
    }
  }
  const grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_code() << ": " << s.error_message();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->reason(), v1::PrefillDone::CHUNK_UNAVAILABLE);
  EXPECT_EQ(done->first_streamed(), 3u);  // Chunk 2's copy failed: nothing streamed.
  EXPECT_EQ(chunks, 0);
}

TEST_F(DeviceGetTest, WorkerThatExitsMidTransferLeaksNothing) {
  Start({.hold_copies = true});
  Put(0);
  auto [buf, handle] = WorkerBuffer(kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, kChunk);
  ASSERT_TRUE(reg.ok());
  grpc::ClientContext ctx;
  auto reader = stub_->Get(&ctx, Request({0}, reg->region_id, reg->token));
  ASSERT_TRUE(testing::Eventually([&] { return device_->pending() > 0; }));
  // The worker's region socket closes (it exited): the region is forgotten at once, but
  // its mapping stays open while the copy into it is in flight.
  ch.reset();
  // (The KvTierClient's own shared-memory region for puts stays registered.)
  ASSERT_TRUE(testing::Eventually([&] { return !regions_->IsDevice(reg->region_id); }));
  EXPECT_EQ(device_->open_ipc_mappings(), 1u);
  ctx.TryCancel();
  device_->RunPending();
  v1::GetFrame f;
  while (reader->Read(&f)) {
  }
  reader->Finish().error_code();  // Cancelled or OK: the worker is gone either way.
  ASSERT_TRUE(testing::Eventually([&] {
    device_->RunPending();  // The delivery staged the chunk afterwards.
    return device_->open_ipc_mappings() == 0;
  }));
}

// Put takes chunks from a worker's GPU memory too: copied on the device into the pool,
// checksummed there, stored only if the CRC32C matches.
TEST_F(DeviceGetTest, PutTakesChunksFromTheWorkersGpuMemory) {
  Start();
  auto [buf, handle] = WorkerBuffer(2 * kChunk);
  const std::string a = PatternBytes(7, kChunk), b = PatternBytes(8, kChunk);
  std::memcpy(device_->HostView(buf), a.data(), kChunk);
  std::memcpy(device_->HostView(buf) + kChunk, b.data(), kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 2 * kChunk);
  ASSERT_TRUE(reg.ok());
  auto frame = [&](uint64_t key, uint64_t offset, uint64_t length, uint64_t region_off,
                   std::optional<uint32_t> crc) {
    v1::PutFrame f;
    f.set_namespace_id(ns_);
    const auto kb = KeyOf(key).ToBytes();
    f.set_key(std::string(reinterpret_cast<const char*>(kb.data()), kb.size()));
    f.set_offset(offset);
    f.set_token_count(256);
    f.mutable_region()->set_region_id(reg->region_id);
    f.mutable_region()->set_token(reg->token);
    f.mutable_region()->set_offset(region_off);
    f.mutable_region()->set_length(length);
    if (crc) f.set_crc32c(*crc);
    return f;
  };
  auto put = [&](const std::vector<v1::PutFrame>& frames) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto writer = stub_->Put(&ctx, &resp);
    for (const auto& f : frames) {
      if (!writer->Write(f)) break;
    }
    writer->WritesDone();
    grpc::Status st = writer->Finish();
    return std::make_pair(st, resp);
  };
  // Chunk 7 in two frames, chunk 8 in one.
  auto [st, resp] = put({frame(7, 0, kMiB, 0, std::nullopt),
                         frame(7, kMiB, kChunk - kMiB, kMiB, crc32c::Value(a)),
                         frame(8, 0, kChunk, kChunk, crc32c::Value(b))});
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.chunks_stored(), 2u);
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7), KeyOf(8)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_TRUE((*got)[0].data == a);
  EXPECT_TRUE((*got)[1].data == b);

  // A wrong CRC stores nothing; a range past the region is refused before any copy; a
  // device error mid-copy fails the put, and nothing is stored.
  auto [bad_crc, r1] = put({frame(9, 0, kChunk, 0, crc32c::Value(a) ^ 1)});
  // (INVALID_ARGUMENT, as for any put whose CRC32C does not match the bytes sent.)
  EXPECT_EQ(bad_crc.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad_crc.error_message();
  EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(9)}), Tier::kNone);
  auto [outside, r2] = put({frame(9, 0, kChunk, kChunk + 1, crc32c::Value(a))});
  EXPECT_EQ(outside.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  device_->FailSubmission(1, absl::UnavailableError("injected: DMA fault"));
  auto [fault, r3] = put({frame(9, 0, kChunk, 0, crc32c::Value(a))});
  EXPECT_EQ(fault.error_code(), grpc::StatusCode::UNAVAILABLE) << fault.error_message();
  EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(9)}), Tier::kNone);
}

// The C++ client's PutFromDevice: chunks in the worker's registered GPU memory are
// stored by reference (one Put stream, a region frame per chunk), and each is stored
// only if the daemon's copy matches the CRC32C the worker gave.
TEST_F(DeviceGetTest, ClientPutFromDeviceStoresChunksThatMatchTheirCrc) {
  Start();
  auto [buf, handle] = WorkerBuffer(3 * kChunk);
  const std::string a = PatternBytes(7, kChunk), b = PatternBytes(8, kChunk);
  std::memcpy(device_->HostView(buf), a.data(), kChunk);
  std::memcpy(device_->HostView(buf) + 2 * kChunk, b.data(), kChunk);
  auto reg = client_->RegisterDeviceMemory(handle, 3 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  const DeviceChunkToPut chunks[] = {
      {KeyOf(7), 0, crc32c::Value(a), 256, 0, std::nullopt},
      {KeyOf(8), 2 * kChunk, crc32c::Value(b), 256, 1, KeyOf(7)}};
  auto put = client_->PutFromDevice(ns_, chunks, *reg);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 2u);
  EXPECT_EQ(put->bytes, 2 * kChunk);  // Copied from the region, not sent.
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7), KeyOf(8)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_TRUE((*got)[0].data == a);
  EXPECT_TRUE((*got)[1].data == b);
  auto again = client_->PutFromDevice(ns_, chunks, *reg);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->stored, 0u);
  EXPECT_EQ(again->already_present, 2u);

  // A CRC32C the bytes do not have: nothing of that chunk is stored.
  const DeviceChunkToPut torn[] = {{KeyOf(9), kChunk, crc32c::Value(a), 256}};
  auto bad = client_->PutFromDevice(ns_, torn, *reg);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(9)}), Tier::kNone);
  // A chunk that does not fit the region is refused before anything is sent.
  const DeviceChunkToPut outside[] = {{KeyOf(9), 2 * kChunk + 1, crc32c::Value(b), 256}};
  auto past = client_->PutFromDevice(ns_, outside, *reg);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
  EXPECT_NE(past.status().message().find("does not fit"), std::string::npos) << past.status();
  // A namespace nobody registered: NOT_FOUND, as the daemon answers a Put of it.
  EXPECT_EQ(client_->PutFromDevice(ns_ + 1, chunks, *reg).status().code(),
            absl::StatusCode::kNotFound);
  // A region the daemon does not know (released): the daemon refuses it.
  ASSERT_TRUE(client_->ReleaseDeviceMemory(reg->region_id).ok());
  const DeviceChunkToPut fresh[] = {{KeyOf(10), 0, crc32c::Value(a), 256}};
  auto gone = client_->PutFromDevice(ns_, fresh, *reg);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_EQ(store_->Locate(ChunkId{ns_, KeyOf(10)}), Tier::kNone);
}

TEST_F(DeviceGetTest, ADaemonWithoutAGpuRefusesDeviceMemory) {
  Start({}, /*with_gpu=*/false);
  auto [buf, handle] = WorkerBuffer(kChunk);
  auto ch = Channel();
  const auto reg = ch->AddDevice(handle, kChunk);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(reg.status().message().find("no GPU"), std::string::npos);
  grpc::ClientContext dctx;
  v1::DataPlaneResponse plane;
  ASSERT_TRUE(stub_->DataPlane(&dctx, v1::DataPlaneRequest(), &plane).ok());
  EXPECT_FALSE(plane.device_memory());
}

// A device Get is watched like a streamed one: waiting on the device is not idle (copies
// held on the fake device for longer than the idle time are not reaped), but a worker
// that stops reading its frames is cancelled, and the daemon goes on serving. The worker
// reaches the daemon through a proxy that stops forwarding the daemon's bytes, and asks
// for 4000 small chunks (most absent: a frame each, no copy) so that the frames fill
// its flow-control window.
TEST_F(DeviceGetTest, AWorkerThatStopsReadingIsCancelledButWaitingOnTheDeviceIsNot) {
  StallReaperOptions o;
  o.idle = absl::Seconds(10);
  o.run_thread = false;
  o.clock = clock_.AsFunction();
  // A member: calls end (and leave the reaper) until the server is shut down.
  reaper_ = std::make_unique<StallReaper>(o);
  StallReaper& reaper = *reaper_;
  testing::FakeClock& clock = clock_;
  Start({.hold_copies = true}, /*with_gpu=*/true, &reaper);
  Put(0);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Get(&ctx, Request({0}, reg->region_id, reg->token));
    for (int i = 0; i < 10000 && device_->pending() == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(device_->pending(), 1u);
    clock.Advance(absl::Minutes(1));
    EXPECT_EQ(reaper.Sweep(), 0) << "a Get waiting on its copy was reaped";
    device_->RunPending();
    v1::GetFrame f;
    ASSERT_TRUE(reader->Read(&f));
    EXPECT_TRUE(f.found());
    EXPECT_FALSE(reader->Read(&f));
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_TRUE(Landed(buf, kChunk) == PatternBytes(0, kChunk));
  }

  // 4000 keys of 4 KiB: a layout with 1 layer, 1 head of 64, 16 tokens, fp16.
  LayoutSpec tiny = LayoutOfMiB(1, "tiny-model");
  tiny.num_kv_heads = 1;
  tiny.head_dim = 64;
  tiny.tokens_per_chunk = 16;
  auto tiny_ns = client_->RegisterLayout(tiny);
  ASSERT_TRUE(tiny_ns.ok()) << tiny_ns.status();
  constexpr uint64_t kKeys = 4000;
  const uint64_t key_bytes = tiny.ChunkBytes();
  auto [tiny_buf, tiny_handle] = WorkerBuffer(kKeys * key_bytes);
  auto tiny_reg = ch->AddDevice(tiny_handle, kKeys * key_bytes);
  ASSERT_TRUE(tiny_reg.ok()) << tiny_reg.status();
  std::vector<uint64_t> keys(kKeys);
  for (uint64_t k = 0; k < kKeys; ++k) keys[k] = 100000 + k;
  v1::GetRequest req = Request(keys, tiny_reg->region_id, tiny_reg->token);
  req.set_namespace_id(tiny_ns->namespace_id);

  const int port = std::stoi(target_.substr(target_.rfind(':') + 1));
  auto proxy = testing::StallingProxy::Start(port);
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  grpc::ChannelArguments args;
  // A small window that stays small: a few hundred frames fill it.
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto stalled = v1::KvCache::NewStub(grpc::CreateCustomChannel(
      (*proxy)->target(), grpc::InsecureChannelCredentials(), args));
  {
    grpc::ClientContext hello;  // The connection is up, through the proxy.
    v1::DataPlaneResponse plane;
    ASSERT_TRUE(stalled->DataPlane(&hello, v1::DataPlaneRequest(), &plane).ok());
  }
  (*proxy)->PauseDownstream();
  grpc::ClientContext ctx;
  auto reader = stalled->Get(&ctx, req);
  // Until a frame has waited on the worker past the idle time: then it is reaped.
  int reaped = 0;
  for (int i = 0; i < 10000 && reaped == 0; ++i) {
    clock.Advance(absl::Seconds(11));
    reaped = reaper.Sweep();
    if (reaped == 0) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(reaped, 1) << "the stalled device Get was never reaped";
  EXPECT_EQ(reaper.reaped(), 1u);
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The daemon goes on serving device Gets.
  std::thread device([&] {
    for (int i = 0; i < 10000 && device_->pending() == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    device_->RunPending();
  });
  const Frames again = Get(Request({0}, reg->region_id, reg->token));
  device.join();
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
}

// record_events: each item's frame comes once its copies are queued, before they land,
// and the worker's event for that item is recorded right after its bytes: here no
// copy has run (the fake device holds them) when all four frames are in. The status
// comes only once every copy landed.
// A layer-major Get reads each later layer of a chunk again, by key. A chunk deleted
// and stored afresh with other bytes between its first layers and the rest (the same
// prefix recomputed) once gave the worker layers of both copies, each passing its own
// CRC32C, and the Get ended OK. The later layers must come from the copy the first came
// from: the Get ends ABORTED instead.
TEST_F(DeviceGetTest, LayerMajorNeverMixesTwoCopiesOfAChunk) {
  Start({.hold_copies = true});
  for (uint64_t k = 0; k < 4; ++k) Put(k);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk);
  ASSERT_TRUE(reg.ok()) << reg.status();
  v1::GetRequest req = Request({0, 1, 2, 3}, reg->region_id, reg->token);
  req.set_order(v1::GET_ORDER_LAYER_MAJOR);
  Frames got;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    got = Get(req);
    done = true;
  });
  // The first pass: layer 0 of the four keys, read and held on the device (the later
  // passes are issued once it has landed).
  const bool first_pass_held = testing::Eventually([&] { return device_->pending() >= 4; });
  if (!first_pass_held) {
    testing::Eventually([&] {
      device_->RunPending();
      return done.load();
    });
    reader.join();
    FAIL() << "the first pass's copies were never submitted";
  }
  auto deleted = client_->Delete(ns_, {KeyOf(0)});
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  const std::string other = PatternBytes(100, kChunk);
  ChunkToPut again{KeyOf(0), other, 256};
  ASSERT_TRUE(client_->Put(ns_, {&again, 1}).ok());
  ASSERT_TRUE(testing::Eventually([&] {
    device_->RunPending();
    return done.load();
  }));
  reader.join();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::ABORTED) << got.status.error_message();
  // Whatever of key 0 landed is of the first copy only.
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    const std::string landed = Landed(buf + layer * kMiB, kMiB);
    EXPECT_FALSE(landed == other.substr(layer * kMiB, kMiB))
        << "layer " << layer << " of key 0 came from the copy stored afresh";
  }
}

TEST_F(DeviceGetTest, RecordEventsSendsEachFrameBeforeItsBytesLandAndRecordsItsEvent) {
  Start({.hold_copies = true});
  Put(0);
  Put(1);
  auto [buf, handle] = WorkerBuffer(4 * kChunk);
  const std::vector<std::string> events = WorkerEvents(4);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 4 * kChunk, events);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(device_->open_ipc_events(), 4u);
  v1::GetRequest req = Request({0, 1}, reg->region_id, reg->token);
  req.set_order(v1::GET_ORDER_LAYER_MAJOR);
  req.mutable_layer_range()->set_begin(2);
  req.mutable_layer_range()->set_end(4);
  req.mutable_target()->set_record_events(true);
  grpc::ClientContext ctx;
  // (A deadline only so that frames held until landing fail here, not hang.)
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub_->Get(&ctx, req);
  // Items in order: (layer 2: key 0, key 1), (layer 3: key 0, key 1).
  for (uint32_t i = 0; i < 4; ++i) {
    v1::GetFrame f;
    ASSERT_TRUE(reader->Read(&f)) << i;
    EXPECT_TRUE(f.found()) << i;
    EXPECT_TRUE(f.in_flight()) << i;
    EXPECT_EQ(f.event_index(), i);
    EXPECT_EQ(f.key_index(), i % 2);
    EXPECT_EQ(f.layer(), 2 + i / 2);
    EXPECT_EQ(f.tier(), v1::TIER_RAM);
    EXPECT_EQ(device_->event_reached(events[i]), 0u) << "event " << i << " before its copy ran";
  }
  EXPECT_GE(device_->pending(), 1u);
  EXPECT_NE(Landed(buf, 2 * kMiB), PatternBytes(0, kChunk).substr(2 * kMiB));
  device_->RunPending();
  v1::GetFrame f;
  EXPECT_FALSE(reader->Read(&f));
  ASSERT_TRUE(reader->Finish().ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(device_->event_reached(events[i]), 1u) << i;
  for (uint64_t k : {0, 1}) {
    EXPECT_TRUE(Landed(buf + k * 2 * kMiB, 2 * kMiB) == PatternBytes(k, kChunk).substr(2 * kMiB))
        << k;
  }
  // Removing the region closes its events (TearDown checks none is left open).
  ASSERT_TRUE(ch->Remove(reg->region_id).ok());
  EXPECT_EQ(device_->open_ipc_events(), 0u);
}

// The C++ client: on_item runs before the bytes land (the worker waits on the event),
// and the call returns the verdict once they have; from staging the event is recorded
// after the device-to-device copy just the same.
TEST_F(DeviceGetTest, ClientGetIntoDeviceWithEventsCallsBackBeforeTheBytesLand) {
  Start({.hold_copies = true});
  Put(0);
  Put(1);
  store_->StageAsync(ChunkId{ns_, KeyOf(1)});
  device_->RunPending();
  ASSERT_EQ(store_->Locate(ChunkId{ns_, KeyOf(1)}), Tier::kGpu);
  auto [buf, handle] = WorkerBuffer(2 * kChunk);
  const std::vector<std::string> events = WorkerEvents(2);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, 2 * kChunk, events);
  ASSERT_TRUE(reg.ok()) << reg.status();
  absl::Mutex mu;
  std::vector<uint32_t> called;
  std::vector<uint64_t> reached_then;
  absl::StatusOr<GetIntoResult> got;
  std::thread worker([&] {
    got = client_->GetIntoDevice(
        ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1)}, *reg, 0, std::nullopt,
        v1::GET_ORDER_CHUNK_MAJOR, 0,
        [&](uint32_t key, uint32_t) {
          absl::MutexLock lock(&mu);
          called.push_back(key);
          reached_then.push_back(device_->event_reached(events[key]));
          return absl::OkStatus();
        },
        /*record_events=*/true);
  });
  bool early;  // Both items announced while their copies are held.
  {
    absl::MutexLock lock(&mu);
    early = mu.AwaitWithTimeout(
        absl::Condition(+[](std::vector<uint32_t>* c) { return c->size() == 2; }, &called),
        absl::Seconds(30));  // Only so that a failure does not hang.
  }
  device_->RunPending();
  worker.join();
  EXPECT_TRUE(early) << "on_item waited for the copies to land";
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(called, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(reached_then, (std::vector<uint64_t>{0, 0}));
  EXPECT_EQ(got->tiers, (std::vector<v1::Tier>{v1::TIER_RAM, v1::TIER_GPU}));
  EXPECT_EQ(device_->event_reached(events[0]), 1u);
  EXPECT_EQ(device_->event_reached(events[1]), 1u);
  EXPECT_TRUE(Landed(buf, kChunk) == PatternBytes(0, kChunk));
  EXPECT_TRUE(Landed(buf + kChunk, kChunk) == PatternBytes(1, kChunk));
}

// What goes wrong with events: handles that are not, stale or too few; two Gets at
// once on one region's events; a device error after the frames went out. Each gets
// a code that says whether to retry, and nothing is left open.
TEST_F(DeviceGetTest, RecordEventsBadHandlesTooFewEventsAndRacesGetClearStatuses) {
  Start({.hold_copies = true});
  Put(0);
  Put(1);
  auto [buf, handle] = WorkerBuffer(2 * kChunk);
  auto ch = Channel();
  std::vector<std::string> events = WorkerEvents(2);
  // Not a handle; a stale one (its worker went away): nothing stays open.
  auto bad = ch->AddDevice(handle, 2 * kChunk, {events[0], "short"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("event_handles[1]"), std::string::npos) << bad.status();
  const std::string stale = device_->ExportIpcEvent();
  device_->RevokeIpcEvent(stale);
  EXPECT_EQ(ch->AddDevice(handle, 2 * kChunk, {stale}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->open_ipc_events(), 0u);
  EXPECT_EQ(device_->open_ipc_mappings(), 0u);
  EXPECT_EQ(ch->AddDevice(handle, 2 * kChunk, std::vector<std::string>(513, events[0]))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);

  auto one = ch->AddDevice(handle, 2 * kChunk, {events[0]});
  ASSERT_TRUE(one.ok()) << one.status();
  v1::GetRequest two_keys = Request({0, 1}, one->region_id, one->token);
  two_keys.mutable_target()->set_record_events(true);
  const uint64_t submitted = device_->submissions();
  const Frames too_many = Get(two_keys);
  EXPECT_EQ(too_many.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(too_many.status.error_message().find("1 events"), std::string::npos)
      << too_many.status.error_message();
  EXPECT_EQ(device_->submissions(), submitted);  // Refused before any copy.
  // A region registered without events cannot record them.
  auto none = ch->AddDevice(handle, 2 * kChunk);
  ASSERT_TRUE(none.ok());
  v1::GetRequest no_events = Request({0}, none->region_id, none->token);
  no_events.mutable_target()->set_record_events(true);
  EXPECT_EQ(Get(no_events).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A second Get on the same events while the first holds them: ABORTED, retry later.
  auto reg = ch->AddDevice(handle, 2 * kChunk, events);
  ASSERT_TRUE(reg.ok());
  v1::GetRequest req = Request({0, 1}, reg->region_id, reg->token);
  req.mutable_target()->set_record_events(true);
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Get(&ctx, req);
    v1::GetFrame f;
    ASSERT_TRUE(reader->Read(&f));  // The first is under way, its copies held.
    // (A deadline only so that a daemon that lets it run fails here, not hangs: its
    // copies are held.)
    grpc::ClientContext raced_ctx;
    raced_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto raced = stub_->Get(&raced_ctx, req);
    while (raced->Read(&f)) {
    }
    const grpc::Status raced_status = raced->Finish();
    EXPECT_EQ(raced_status.error_code(), grpc::StatusCode::ABORTED) << raced_status.error_message();
    device_->RunPending();
    while (reader->Read(&f)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  // Lent back: the next one runs. Then a device error after its frames went out: the
  // status says so (UNAVAILABLE: retry), and the daemon goes on.
  device_->FailSubmission(1, absl::UnavailableError("injected: device fell off the bus"));
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Get(&ctx, req);
    v1::GetFrame f;
    ASSERT_TRUE(reader->Read(&f));
    EXPECT_TRUE(f.in_flight());
    device_->RunPending();
    while (reader->Read(&f)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  std::thread run([&] {
    ASSERT_TRUE(testing::Eventually([&] { return device_->pending() > 0; }));
    device_->RunPending();
  });
  const Frames again = Get(req);
  run.join();
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(Landed(buf + kChunk, kChunk) == PatternBytes(1, kChunk));
}

// A device error coded NOT_FOUND (CUDA's "no device") after an item's frame said "in
// flight" fails the call: it is not an absent chunk, and a staged chunk is not sent to
// the host path a second time (which would record its event twice).
TEST_F(DeviceGetTest, ADeviceErrorCodedNotFoundAfterTheFrameFailsTheCall) {
  Start({.hold_copies = true});
  Put(0);
  Put(1);
  store_->StageAsync(ChunkId{ns_, KeyOf(0)});
  device_->RunPending();
  ASSERT_EQ(store_->Locate(ChunkId{ns_, KeyOf(0)}), Tier::kGpu);
  auto [buf, handle] = WorkerBuffer(kChunk);
  const std::vector<std::string> events = WorkerEvents(1);
  auto ch = Channel();
  auto reg = ch->AddDevice(handle, kChunk, events);
  ASSERT_TRUE(reg.ok()) << reg.status();
  for (uint64_t key : {0, 1}) {  // From staging, then from RAM.
    v1::GetRequest req = Request({key}, reg->region_id, reg->token);
    req.mutable_target()->set_record_events(true);
    device_->FailSubmission(1, absl::NotFoundError("injected: no CUDA device"));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub_->Get(&ctx, req);
    v1::GetFrame f;
    ASSERT_TRUE(reader->Read(&f)) << key;
    EXPECT_TRUE(f.in_flight());
    EXPECT_EQ(f.tier(), key == 0 ? v1::TIER_GPU : v1::TIER_RAM);
    device_->RunPending();
    while (reader->Read(&f)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << key << ": " << s.error_message();
    EXPECT_LE(device_->event_reached(events[0]), key) << "recorded again after the failure";
  }
}

}  // namespace
}  // namespace kvtier
