// The tiered store's GPU level against the fake device backend: the pool is
// page-locked, staged chunks are Located as TIER_GPU and delivered device-to-device,
// others host-to-device with their CRC32C checked; every degraded mode (no pin, no
// staging memory, a device error mid-copy, corrupt bytes) gets a clear status, leaks
// nothing, and leaves RAM and SSD serving.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/tiered_store.h"
#include "tests/support/fake_device_backend.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kChunk = kMiB;  // LayoutOfMiB(1)'s chunk.

std::string Payload(uint64_t n) {
  std::string s(kChunk, '\0');
  for (uint64_t i = 0; i < kChunk; ++i) s[i] = static_cast<char>((i * 31 + n * 7) >> 3);
  return s;
}

class TieredStoreGpuTest : public ::testing::Test {
 protected:
  void SetUp() override { SetMinLogLevel(LogLevel::kError); }

  void Open(FakeDeviceOptions device = {}, uint64_t staging_chunks = 4,
            absl::Status pin_failure = absl::OkStatus(), uint64_t slot_bytes = 256 << 10) {
    device_ = std::make_unique<FakeDeviceBackend>(device);
    if (!pin_failure.ok()) device_->FailNextPin(pin_failure);
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 8 * kChunk;
    o.ram.arena.slot_bytes = 64 << 10;
    o.max_chunk_bytes = 4 * kChunk;
    o.device = device_.get();
    o.gpu_staging.capacity_bytes = staging_chunks * kChunk;
    o.gpu_staging.slot_bytes = slot_bytes;
    o.after_copy_delete = [this](const ChunkId& id) {
      if (after_copy_delete_) after_copy_delete_(id);
    };
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
    auto r = store_->RegisterLayout(testing::LayoutOfMiB(1));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
  }

  void TearDown() override {
    store_.reset();
    if (device_ == nullptr) return;
    EXPECT_EQ(device_->live_allocations(), worker_allocations_);
    EXPECT_EQ(device_->pinned_ranges(), 0u);
    EXPECT_TRUE(device_->misuse().empty()) << device_->misuse()[0];
  }

  ChunkId Id(uint64_t n) const { return ChunkId{ns_, ChunkKey{0x9000 + n, n}}; }

  void Put(uint64_t n) { PutBytes(n, Payload(n)); }
  void PutBytes(uint64_t n, const std::string& data) {
    auto w = store_->BeginPut(Id(n), 256);
    ASSERT_TRUE(w.ok() && *w != nullptr) << w.status();
    ASSERT_TRUE((*w)->Append(data).ok());
    ASSERT_TRUE(store_->CommitPut(*std::move(w), crc32c::Value(data)).ok());
  }

  // A worker's device buffer (the fake's memory), counted as not leaked at teardown.
  DevicePtr WorkerBuffer(uint64_t bytes) {
    absl::StatusOr<DevicePtr> p = device_->Allocate(bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    ++worker_allocations_;
    return p.ok() ? *p : 0;
  }

  absl::StatusOr<Tier> Deliver(uint64_t n, std::vector<TieredStore::DeviceRange> ranges) {
    absl::Notification done;
    absl::StatusOr<Tier> result;
    store_->ReadToDeviceAsync(Id(n), std::move(ranges), [&](absl::StatusOr<Tier> r) {
      result = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return result;
  }

  // Flips a byte of the pool's copy of chunk n behind the store's back.
  void FlipPoolByte(uint64_t n) {
    std::optional<ChunkView> view = store_->HoldInRam(Id(n));
    ASSERT_TRUE(view.has_value());
    view->ForEachPiece(4096, 1, [](absl::string_view p) { const_cast<char*>(p.data())[0] ^= 1; });
  }

  // Staging runs on the device's thread; waits for it to finish.
  void Stage(uint64_t n) {
    store_->StageAsync(Id(n));
    device_->Drain();
  }

  std::unique_ptr<FakeDeviceBackend> device_;
  // Runs inside Delete between the staging's and RAM's (TieredStoreOptions).
  std::function<void(const ChunkId&)> after_copy_delete_;
  std::unique_ptr<TieredStore> store_;
  uint64_t ns_ = 0;
  size_t worker_allocations_ = 0;
};

TEST_F(TieredStoreGpuTest, PoolIsPinnedAndStagedChunksAreServedDeviceToDevice) {
  Open();
  EXPECT_EQ(device_->pinned_ranges(), 1u);
  Put(1);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  Stage(1);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kGpu);

  const DevicePtr dst = WorkerBuffer(kChunk);
  absl::StatusOr<Tier> from = Deliver(1, {{0, kChunk, dst}});
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, Tier::kGpu);
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(1));

  TieredStoreStats stats = store_->GetStats();
  EXPECT_TRUE(stats.gpu_present);
  EXPECT_TRUE(stats.gpu.pool_pinned);
  EXPECT_TRUE(stats.gpu.staging_enabled);
  EXPECT_EQ(stats.gpu.staging.chunks, 1u);
  EXPECT_EQ(stats.gpu.deliveries_from_staging, 1u);
  EXPECT_EQ(stats.gpu.delivered_bytes, kChunk);

  // Delete takes the staged copy too.
  ASSERT_TRUE(store_->Delete(Id(1)).ok());
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().gpu.staging.chunks, 0u);
  EXPECT_EQ(Deliver(1, {{0, kChunk, dst}}).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TieredStoreGpuTest, AHintStagesItsRamChunksOnTheGpu) {
  Open();
  Put(1);
  Put(2);
  Put(3);
  auto r = store_->Hint("sched", {{ns_, {Id(2).key, Id(3).key, Id(9).key}}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cached, 2u);
  device_->Drain();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);  // Not hinted: not staged.
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kGpu);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kGpu);
  EXPECT_EQ(store_->Locate(Id(9)), Tier::kNone);
}

// A Hint stages its nearest chunks up to half the staging buffers, counted in the
// slots they take: counted in payload bytes, chunks half a slot each took the whole
// of staging, evicting what earlier hints had staged.
TEST_F(TieredStoreGpuTest, AHintStagesAtMostHalfTheSlotsOfStaging) {
  Open({}, /*staging_chunks=*/8, absl::OkStatus(), /*slot_bytes=*/2 * kChunk);  // 4 slots.
  for (uint64_t n = 1; n <= 4; ++n) Put(n);
  auto r = store_->Hint("sched", {{ns_, {Id(1).key, Id(2).key, Id(3).key, Id(4).key}}});
  ASSERT_TRUE(r.ok()) << r.status();
  device_->Drain();
  const GpuStagingStats staging = store_->GetStats().gpu.staging;
  EXPECT_LE(staging.used_bytes, staging.capacity_bytes / 2);
  EXPECT_EQ(staging.no_room, 0u);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kGpu);  // The nearest.
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kGpu);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(4)), Tier::kRam);
}

TEST_F(TieredStoreGpuTest, UnstagedChunksGoHostToDeviceInLayerRanges) {
  Open();
  Put(2);
  // Two "layers" in reverse order into separate places: each lands where it was sent.
  const DevicePtr dst = WorkerBuffer(kChunk);
  absl::StatusOr<Tier> from =
      Deliver(2, {{kChunk / 2, kChunk / 2, dst}, {0, kChunk / 2, dst + kChunk / 2}});
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, Tier::kRam);
  const std::string want = Payload(2);
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk / 2), want.substr(kChunk / 2));
  EXPECT_EQ(std::string(device_->HostView(dst) + kChunk / 2, kChunk / 2),
            want.substr(0, kChunk / 2));
  EXPECT_EQ(store_->GetStats().gpu.deliveries_from_host, 1u);

  EXPECT_EQ(Deliver(2, {{kChunk - 1, 2, dst}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Deliver(2, {{0, 64, 0x40}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Deliver(99, {{0, 64, dst}}).status().code(), absl::StatusCode::kNotFound);
}

// A range's event is recorded on the device after its bytes, and `enqueued` (with the
// tier) comes before `done`, from the host and from staging alike; a delivery that
// submits nothing (an absent chunk, a bad range) never says enqueued. The device holds
// the copies here: "enqueued" is heard while none has run.
TEST_F(TieredStoreGpuTest, EventsAreRecordedAfterTheirRangesAndEnqueuedComesFirst) {
  Open({.hold_copies = true});
  Put(1);
  Put(2);
  store_->StageAsync(Id(2));
  device_->RunPending();
  ASSERT_EQ(store_->Locate(Id(2)), Tier::kGpu);
  const std::string first = device_->ExportIpcEvent(), second = device_->ExportIpcEvent();
  auto a = device_->OpenIpcEvent(first);
  auto b = device_->OpenIpcEvent(second);
  ASSERT_TRUE(a.ok() && b.ok());
  const DevicePtr dst = WorkerBuffer(2 * kChunk);
  for (uint64_t n : {1, 2}) {
    absl::Mutex mu;  // `done` may run on a CRC32C thread.
    std::vector<std::string> heard;
    std::optional<absl::StatusOr<Tier>> result;
    absl::Notification done;
    store_->ReadToDeviceAsync(
        Id(n), {{0, kChunk / 2, dst, *a}, {kChunk / 2, kChunk / 2, dst + kChunk / 2, *b}},
        [&](absl::StatusOr<Tier> r) {
          absl::MutexLock lock(&mu);
          heard.push_back("done");
          result = std::move(r);
          done.Notify();
        },
        /*check_crc=*/true,
        [&](Tier from) {
          absl::MutexLock lock(&mu);
          heard.push_back(absl::StrCat("enqueued ", TierName(from)));
        });
    const std::string tier = n == 1 ? "ram" : "gpu";
    {
      absl::MutexLock lock(&mu);
      EXPECT_EQ(heard, (std::vector<std::string>{"enqueued " + tier})) << n;
    }
    EXPECT_EQ(device_->event_reached(first), n - 1);
    device_->RunPending();
    done.WaitForNotification();
    absl::MutexLock lock(&mu);
    EXPECT_EQ(heard, (std::vector<std::string>{"enqueued " + tier, "done"})) << n;
    ASSERT_TRUE(result.has_value() && result->ok()) << n;
    EXPECT_EQ(device_->event_reached(first), n);
    EXPECT_EQ(device_->event_reached(second), n);
    EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(n));
  }
  int enqueued = 0;
  absl::Status absent;
  store_->ReadToDeviceAsync(
      Id(9), {{0, kChunk, dst, *a}}, [&](absl::StatusOr<Tier> r) { absent = r.status(); },
      true, [&](Tier) { ++enqueued; });
  device_->RunPending();
  EXPECT_EQ(absent.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(enqueued, 0);
  EXPECT_EQ(device_->event_reached(first), 2u);
  device_->CloseIpcEvent(*a);
  device_->CloseIpcEvent(*b);
  EXPECT_EQ(device_->open_ipc_events(), 0u);
}

// A chunk put into a fresh pool has adjacent slots: the whole delivery is one DMA, not
// one per 64 KiB slot. Its CRC32C is checked once per delivery, and not at all when
// the caller says it checked the chunk earlier in the same request.
TEST_F(TieredStoreGpuTest, AFreshChunkIsOneCopyAndItsCrcIsCheckedOncePerDelivery) {
  Open({}, /*staging_chunks=*/0);
  Put(1);
  Put(2);
  const DevicePtr dst = WorkerBuffer(kChunk);
  const uint64_t copies = device_->copies_run();
  ASSERT_TRUE(Deliver(2, {{0, kChunk, dst}}).ok());
  EXPECT_EQ(device_->copies_run() - copies, 1u);
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(2));
  EXPECT_EQ(store_->GetStats().gpu.crc_checked_bytes, kChunk);

  absl::Notification done;
  store_->ReadToDeviceAsync(
      Id(1), {{0, kChunk / 4, dst}}, [&](absl::StatusOr<Tier> r) {
        EXPECT_TRUE(r.ok()) << r.status();
        done.Notify();
      },
      /*check_crc=*/false);
  done.WaitForNotification();
  EXPECT_EQ(store_->GetStats().gpu.crc_checked_bytes, kChunk);
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk / 4), Payload(1).substr(0, kChunk / 4));
}

// On a device that checks CRC32Cs, a whole chunk delivered into one place is checked on
// the device, over what landed: the CPU checks nothing (bar a tail past the last 64
// KiB), corrupt pool bytes are still DataLoss, a layer range is still checked on the
// CPU, and a check the device could not run falls back to the CPU.
TEST(TieredStoreGpuDeviceCrcTest, WholeChunksAreCheckedOnTheDeviceOverWhatLanded) {
  SetMinLogLevel(LogLevel::kError);
  FakeDeviceBackend device({.memory_bytes = 256 * kMiB, .checks_crc32c = true});
  TieredStoreOptions o;
  o.write_mode = WriteMode::kRamOnly;
  o.ram.arena.capacity_bytes = 16 * kMiB;
  o.max_chunk_bytes = 4 * kMiB;
  o.device = &device;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  // K and V of 257 tokens x 8 heads x 256 dims in fp16: 2 MiB and 8 KiB, 32 blocks of
  // 64 KiB and a tail.
  LayoutSpec layout = testing::LayoutOfMiB(1);
  layout.tokens_per_chunk = 257;
  layout.head_dim = 256;
  auto reg = (*store)->RegisterLayout(layout);
  ASSERT_TRUE(reg.ok()) << reg.status();
  const uint64_t size = layout.ChunkBytes();
  ASSERT_EQ(size, 2 * kMiB + 8192);
  std::string data(size, '\0');
  for (uint64_t i = 0; i < size; ++i) data[i] = static_cast<char>(i * 13 + (i >> 11));
  auto put = [&](uint64_t k) {
    const ChunkId id{reg->namespace_id, ChunkKey{k, 5}};
    auto w = (*store)->BeginPut(id, 257);
    EXPECT_TRUE(w.ok() && *w != nullptr);
    EXPECT_TRUE((*w)->Append(data).ok());
    EXPECT_TRUE((*store)->CommitPut(*std::move(w), crc32c::Value(data)).ok());
    return id;
  };
  auto deliver = [&](const ChunkId& id, std::vector<TieredStore::DeviceRange> ranges) {
    absl::Notification done;
    absl::StatusOr<Tier> result;
    (*store)->ReadToDeviceAsync(id, std::move(ranges), [&](absl::StatusOr<Tier> r) {
      result = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return result;
  };
  auto dst = device.Allocate(size);
  ASSERT_TRUE(dst.ok());
  const uint64_t whole = size / (64 << 10) * (64 << 10);

  const ChunkId a = put(1);
  ASSERT_TRUE(deliver(a, {{0, size, *dst}}).ok());
  EXPECT_TRUE(std::string(device.HostView(*dst), size) == data);
  EXPECT_EQ(device.checks_run(), 1u);
  EXPECT_EQ((*store)->GetStats().gpu.device_crc_checked_bytes, whole);
  EXPECT_EQ((*store)->GetStats().gpu.crc_checked_bytes, 0u);

  // A layer range: the CPU checks the whole chunk.
  ASSERT_TRUE(deliver(a, {{0, size / 2, *dst}}).ok());
  EXPECT_EQ(device.checks_run(), 1u);
  EXPECT_EQ((*store)->GetStats().gpu.crc_checked_bytes, size);

  // The device could not check: the CPU does.
  device.SkipNextCheck();
  ASSERT_TRUE(deliver(a, {{0, size, *dst}}).ok());
  EXPECT_EQ(device.checks_run(), 1u);
  EXPECT_EQ((*store)->GetStats().gpu.crc_checked_bytes, 2 * size);

  // What landed changed under the copy (another writer in the worker's memory) while
  // the pool's copy is intact: Aborted, and the chunk stays.
  device.ChangeTargetBeforeNextCheck();
  EXPECT_EQ(deliver(a, {{0, size, *dst}}).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ((*store)->Locate(a), Tier::kRam);
  ASSERT_TRUE(deliver(a, {{0, size, *dst}}).ok());

  // A flipped byte inside the checked part, and one in the tail, are DataLoss.
  for (uint64_t at : {uint64_t{70000}, size - 5}) {
    const ChunkId id = put(at);
    std::optional<ChunkView> view = (*store)->HoldInRam(id);
    ASSERT_TRUE(view.has_value());
    view->ForEachPiece(at, 1, [](absl::string_view p) { const_cast<char*>(p.data())[0] ^= 1; });
    view.reset();
    EXPECT_EQ(deliver(id, {{0, size, *dst}}).status().code(), absl::StatusCode::kDataLoss) << at;
  }
  device.Free(*dst);
  store->reset();
  EXPECT_TRUE(device.misuse().empty()) << device.misuse()[0];
}

// A chunk large enough for its check to be split into parts (ParallelCrc): delivered
// intact, and a flipped byte in its last part is found like one in the first.
TEST(TieredStoreGpuLargeChunkTest, CorruptBytesInAnyPartOfALargeChunkAreDataLoss) {
  SetMinLogLevel(LogLevel::kError);
  constexpr uint64_t kLarge = 16 * kMiB;  // At least two 4 MiB parts.
  FakeDeviceBackend device({.memory_bytes = 256 * kMiB});
  TieredStoreOptions o;
  o.write_mode = WriteMode::kRamOnly;
  o.ram.arena.capacity_bytes = 2 * kLarge;
  o.max_chunk_bytes = kLarge;
  o.device = &device;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  auto reg = (*store)->RegisterLayout(testing::LayoutOfMiB(16));
  ASSERT_TRUE(reg.ok()) << reg.status();
  std::string data(kLarge, '\0');
  for (uint64_t i = 0; i < kLarge; ++i) data[i] = static_cast<char>(i * 7 + (i >> 12));
  auto dst = device.Allocate(kLarge);
  ASSERT_TRUE(dst.ok());
  for (uint64_t at : {uint64_t{100}, kLarge - 100}) {
    const ChunkId id{reg->namespace_id, ChunkKey{at, 1}};
    auto w = (*store)->BeginPut(id, 256);
    ASSERT_TRUE(w.ok() && *w != nullptr);
    ASSERT_TRUE((*w)->Append(data).ok());
    ASSERT_TRUE((*store)->CommitPut(*std::move(w), crc32c::Value(data)).ok());
    // Intact, its parts' CRCs combine to the chunk's.
    absl::Notification clean;
    (*store)->ReadToDeviceAsync(id, {{0, kLarge, *dst}}, [&](absl::StatusOr<Tier> r) {
      EXPECT_TRUE(r.ok()) << r.status();
      clean.Notify();
    });
    clean.WaitForNotification();
    EXPECT_TRUE(std::string(device.HostView(*dst), kLarge) == data);
    std::optional<ChunkView> view = (*store)->HoldInRam(id);
    ASSERT_TRUE(view.has_value());
    view->ForEachPiece(at, 1, [](absl::string_view p) { const_cast<char*>(p.data())[0] ^= 1; });
    view.reset();
    absl::Notification done;
    absl::Status status;
    (*store)->ReadToDeviceAsync(id, {{0, kLarge, *dst}}, [&](absl::StatusOr<Tier> r) {
      status = r.status();
      done.Notify();
    });
    done.WaitForNotification();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << at << ": " << status;
  }
  device.Free(*dst);
  store->reset();
  EXPECT_EQ(device.live_allocations(), 0u);
}

TEST_F(TieredStoreGpuTest, CorruptPoolBytesAreDataLossNotDelivered) {
  Open();
  Put(3);
  ASSERT_NO_FATAL_FAILURE(FlipPoolByte(3));
  const DevicePtr dst = WorkerBuffer(kChunk);
  absl::StatusOr<Tier> from = Deliver(3, {{0, kChunk, dst}});
  EXPECT_EQ(from.status().code(), absl::StatusCode::kDataLoss) << from.status();
  EXPECT_EQ(store_->GetStats().gpu.delivery_failures, 1u);
  // DATA_LOSS means the chunk is gone: a re-put stores it again, nothing serves the
  // corrupt copy.
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().checksum_failures, 1u);
  Put(3);
  EXPECT_TRUE(Deliver(3, {{0, kChunk, dst}}).ok());
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(3));
}

// Pool bytes that changed since their put (a flipped bit) are not staged: staging once
// copied them unchecked, and every delivery from the staged copy then answered OK with
// the corrupt bytes (only a delivery from RAM checked them). The check fails, nothing is
// staged, and the RAM copy goes as a delivery that found it would drop it.
TEST_F(TieredStoreGpuTest, CorruptPoolBytesAreNotStaged) {
  Open();
  Put(3);
  ASSERT_NO_FATAL_FAILURE(FlipPoolByte(3));
  Stage(3);
  EXPECT_EQ(store_->GetStats().gpu.staging.chunks, 0u);
  EXPECT_EQ(store_->GetStats().gpu.staging.stage_failures, 1u);
  EXPECT_EQ(store_->GetStats().gpu.stage_crc_checked_bytes, kChunk);
  EXPECT_EQ(store_->GetStats().gpu.crc_checked_bytes, 0u);  // No delivery checked any.
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().checksum_failures, 1u);
  const DevicePtr dst = WorkerBuffer(kChunk);
  EXPECT_EQ(Deliver(3, {{0, kChunk, dst}}).status().code(), absl::StatusCode::kNotFound);
  // Put again, it stages and is served from staging.
  Put(3);
  Stage(3);
  absl::StatusOr<Tier> from = Deliver(3, {{0, kChunk, dst}});
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, Tier::kGpu);
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(3));
}

TEST_F(TieredStoreGpuTest, DeviceErrorMidCopyIsUnavailableAndRamStillServes) {
  Open();
  Put(4);
  const DevicePtr dst = WorkerBuffer(kChunk);
  device_->FailSubmission(1, absl::UnavailableError("injected: uncorrectable ECC error"));
  absl::StatusOr<Tier> from = Deliver(4, {{0, kChunk, dst}});
  EXPECT_EQ(from.status().code(), absl::StatusCode::kUnavailable) << from.status();
  auto read = store_->Read(Id(4));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->tier(), Tier::kRam);
  // And the next delivery works.
  EXPECT_TRUE(Deliver(4, {{0, kChunk, dst}}).ok());
}

TEST_F(TieredStoreGpuTest, PinFailureIsALoudDegradedModeNotAFailure) {
  Open({}, 4, absl::ResourceExhaustedError("RLIMIT_MEMLOCK"));
  EXPECT_EQ(device_->pinned_ranges(), 0u);
  EXPECT_FALSE(store_->GetStats().gpu.pool_pinned);
  Put(5);
  const DevicePtr dst = WorkerBuffer(kChunk);
  ASSERT_TRUE(Deliver(5, {{0, kChunk, dst}}).ok());
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(5));
}

TEST_F(TieredStoreGpuTest, NoDeviceMemoryForStagingLeavesHostDeliveries) {
  // The device has room for the worker's buffer but not the staging buffers.
  Open({.memory_bytes = 2 * kChunk}, /*staging_chunks=*/4);
  const TieredStoreStats stats = store_->GetStats();
  EXPECT_TRUE(stats.gpu_present);
  EXPECT_FALSE(stats.gpu.staging_enabled);
  Put(6);
  Stage(6);
  EXPECT_EQ(store_->Locate(Id(6)), Tier::kRam);
  const DevicePtr dst = WorkerBuffer(kChunk);
  absl::StatusOr<Tier> from = Deliver(6, {{0, kChunk, dst}});
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, Tier::kRam);
}

TEST_F(TieredStoreGpuTest, StagingEvictionFallsBackToTheHostCopy) {
  Open({}, /*staging_chunks=*/1);
  Put(7);
  Put(8);
  Stage(7);
  Stage(8);  // Evicts 7 from staging; RAM still has it.
  EXPECT_EQ(store_->Locate(Id(7)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(8)), Tier::kGpu);
  EXPECT_EQ(store_->GetStats().gpu.staging.evictions, 1u);
  const DevicePtr dst = WorkerBuffer(kChunk);
  absl::StatusOr<Tier> from = Deliver(7, {{0, kChunk, dst}});
  ASSERT_TRUE(from.ok());
  EXPECT_EQ(*from, Tier::kRam);
  EXPECT_EQ(std::string(device_->HostView(dst), kChunk), Payload(7));
  // Clearing the namespace clears staging too.
  ASSERT_TRUE(store_->Clear(ns_).ok());
  EXPECT_EQ(store_->GetStats().gpu.staging.chunks, 0u);
}

// Staging caches the pool: once RAM (the only other tier in ram-only mode) has evicted a
// chunk, its staged copy is not a hit, so a re-put stores it and nothing stale is served.
TEST_F(TieredStoreGpuTest, AStagedCopyOfAChunkTheStoreDroppedIsNotAHit) {
  Open();
  Put(1);
  Stage(1);
  ASSERT_EQ(store_->Locate(Id(1)), Tier::kGpu);
  for (uint64_t i = 100; i < 108; ++i) Put(i);  // Fills the 8-chunk pool: 1 is evicted.
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  // The orphaned copy is dropped, not left to hold staging room until evicted.
  EXPECT_EQ(store_->GetStats().gpu.staging.chunks, 0u);
  const DevicePtr dst = WorkerBuffer(kChunk);
  EXPECT_EQ(Deliver(1, {{0, kChunk, dst}}).status().code(), absl::StatusCode::kNotFound);
  Put(1);  // Stored again, not drained as already present.
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
}

// A staging that runs inside a Delete, after the staging let go of the chunk and before
// RAM did, copies the bytes being deleted. Still loading while a put of new bytes
// under the same id came in (so the put did not see it), that copy was then served for
// the new chunk: deliveries from staging do not check the CRC32C.
TEST_F(TieredStoreGpuTest, AStagedCopyOfDeletedBytesIsNeverServedForNewOnes) {
  FakeDeviceOptions device;
  device.hold_copies = true;
  Open(device);
  Put(1);
  after_copy_delete_ = [this](const ChunkId& id) { store_->StageAsync(id); };
  ASSERT_TRUE(store_->Delete(Id(1)).ok());
  after_copy_delete_ = nullptr;
  const std::string fresh = Payload(77);
  PutBytes(1, fresh);
  device_->RunPending();  // The copy of the deleted bytes lands in staging.
  const DevicePtr dst = WorkerBuffer(kChunk);
  auto deliver = [&]() -> absl::StatusOr<Tier> {
    std::memset(device_->HostView(dst), 0, kChunk);
    absl::Notification done;
    absl::StatusOr<Tier> from;
    store_->ReadToDeviceAsync(Id(1), {{0, kChunk, dst}}, [&](absl::StatusOr<Tier> r) {
      from = std::move(r);
      done.Notify();
    });
    while (!done.HasBeenNotified()) device_->RunPending();  // Its copies are held.
    return from;
  };
  absl::StatusOr<Tier> from = deliver();
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, Tier::kRam) << "the stale staged copy was taken";
  EXPECT_TRUE(std::string(device_->HostView(dst), kChunk) == fresh)
      << "the deleted chunk's bytes were delivered";
  // The delivery staged the new bytes; those are served from staging from now on.
  device_->RunPending();
  from = deliver();
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, Tier::kGpu);
  EXPECT_TRUE(std::string(device_->HostView(dst), kChunk) == fresh);
}

TEST(TieredStoreNoGpuTest, DeliveryWithoutAGpuIsFailedPrecondition) {
  SetMinLogLevel(LogLevel::kError);
  TieredStoreOptions o;
  o.write_mode = WriteMode::kRamOnly;
  o.ram.arena.capacity_bytes = 4 * kChunk;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok());
  EXPECT_FALSE((*store)->has_gpu());
  EXPECT_FALSE((*store)->GetStats().gpu_present);
  absl::Notification done;
  absl::StatusOr<Tier> result;
  (*store)->ReadToDeviceAsync(ChunkId{}, {{0, 1, 1}}, [&](absl::StatusOr<Tier> r) {
    result = std::move(r);
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvtier
