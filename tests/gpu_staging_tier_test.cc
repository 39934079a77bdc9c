// The GPU staging tier's logic (admission, eviction, completion, failure) against the
// fake device backend: runs everywhere, no GPU needed.
#include "storage/gpu_staging_tier.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage/lru_policy.h"
#include "tests/support/fake_device_backend.h"

namespace kvtier {
namespace {

constexpr uint64_t kSlot = 4096;

ChunkId Id(uint64_t ns, uint8_t k) {
  ChunkId id;
  id.ns = ns;
  id.key.lo = k;
  return id;
}

// A status delivered to a callback, waited for without sleeping.
class Result {
 public:
  GpuStagingTier::Done Callback() {
    return [this](absl::Status s) {
      status_ = std::move(s);
      done_.Notify();
    };
  }
  absl::Status Wait() {
    done_.WaitForNotification();
    return status_;
  }
  bool HasRun() const { return done_.HasBeenNotified(); }

 private:
  absl::Notification done_;
  absl::Status status_;
};

struct HostChunk {
  std::shared_ptr<std::string> bytes;
  ChunkMeta meta;
  // Odd-sized pieces, so that copies cross slot boundaries mid-piece.
  std::vector<absl::string_view> Pieces() const {
    std::vector<absl::string_view> out;
    absl::string_view rest = *bytes;
    size_t n = 1000;
    while (!rest.empty()) {
      const size_t take = std::min(n, rest.size());
      out.push_back(rest.substr(0, take));
      rest.remove_prefix(take);
      n += 777;
    }
    return out;
  }
};

HostChunk MakeChunk(uint64_t size, char seed) {
  HostChunk c;
  c.bytes = std::make_shared<std::string>(size, '\0');
  for (uint64_t i = 0; i < size; ++i) (*c.bytes)[i] = static_cast<char>(seed + i * 7);
  c.meta.size = size;
  return c;
}

class GpuStagingTierTest : public ::testing::Test {
 protected:
  void Open(uint64_t slots, FakeDeviceOptions device = {}) {
    device_ = std::make_unique<FakeDeviceBackend>(device);
    GpuStagingOptions options;
    options.capacity_bytes = slots * kSlot;
    options.slot_bytes = kSlot;
    auto tier = GpuStagingTier::Create(options, device_.get(), std::make_unique<LruPolicy>());
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = *std::move(tier);
  }

  absl::Status Stage(const ChunkId& id, const HostChunk& c) {
    Result r;
    tier_->Stage(id, c.meta, c.Pieces(), c.bytes, r.Callback());
    if (held()) device_->RunPending();
    return r.Wait();
  }

  // Copies a staged chunk to a fresh device allocation and returns its bytes.
  absl::StatusOr<std::string> ReadBack(const ChunkId& id, uint64_t size) {
    absl::StatusOr<DevicePtr> dst = device_->Allocate(size);
    if (!dst.ok()) return dst.status();
    Result r;
    tier_->CopyToDevice(id, {{0, size, *dst}}, r.Callback());
    if (held()) device_->RunPending();
    absl::Status s = r.Wait();
    std::string out(device_->HostView(*dst), size);
    device_->Free(*dst);
    if (!s.ok()) return s;
    return out;
  }

  bool held() const { return held_; }

  void TearDown() override {
    if (device_ == nullptr) return;
    tier_.reset();
    EXPECT_EQ(device_->live_allocations(), 0u);
    EXPECT_TRUE(device_->misuse().empty()) << device_->misuse()[0];
  }

  bool held_ = false;
  std::unique_ptr<FakeDeviceBackend> device_;
  std::unique_ptr<GpuStagingTier> tier_;
};

// A chunk removed and staged again as a larger one between Find (which sized the
// caller's buffer) and CopyToHost: the copy is refused, not written past the buffer.
TEST_F(GpuStagingTierTest, CopyToHostOfAChunkStagedAgainAsAnotherIsRefused) {
  Open(8);
  ASSERT_TRUE(Stage(Id(1, 1), MakeChunk(kSlot, 'a')).ok());
  const ChunkMeta found = *tier_->Find(Id(1, 1));
  ASSERT_TRUE(tier_->Remove(Id(1, 1)));
  const HostChunk large = MakeChunk(3 * kSlot, 'b');
  ASSERT_TRUE(Stage(Id(1, 1), large).ok());
  std::string host(found.size + 64, '\x5a');
  Result refused;
  tier_->CopyToHost(Id(1, 1), found, host.data(), refused.Callback());
  EXPECT_EQ(refused.Wait().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(host == std::string(found.size + 64, '\x5a')) << "written to";
  // The chunk staged now is untouched and reads back whole.
  std::string back(large.meta.size, '\0');
  Result copied;
  tier_->CopyToHost(Id(1, 1), large.meta, back.data(), copied.Callback());
  ASSERT_TRUE(copied.Wait().ok());
  EXPECT_TRUE(back == *large.bytes);
}

TEST_F(GpuStagingTierTest, StagedBytesComeBackExactlyToDeviceAndHost) {
  Open(8);
  const HostChunk c = MakeChunk(3 * kSlot + 123, 'a');
  ASSERT_TRUE(Stage(Id(1, 1), c).ok());
  ASSERT_TRUE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_EQ(tier_->Find(Id(1, 1))->size, c.meta.size);

  absl::StatusOr<std::string> back = ReadBack(Id(1, 1), c.meta.size);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *c.bytes);

  std::string host(c.meta.size, '\0');
  Result r;
  tier_->CopyToHost(Id(1, 1), c.meta, host.data(), r.Callback());
  ASSERT_TRUE(r.Wait().ok());
  EXPECT_EQ(host, *c.bytes);

  const GpuStagingStats stats = tier_->GetStats();
  EXPECT_EQ(stats.chunks, 1u);
  EXPECT_EQ(stats.chunk_bytes, c.meta.size);
  EXPECT_EQ(stats.used_bytes, 4 * kSlot);
  EXPECT_EQ(stats.hits, 2u);
  EXPECT_EQ(stats.bytes_in, c.meta.size);
  EXPECT_EQ(stats.bytes_out, 2 * c.meta.size);
}

TEST_F(GpuStagingTierTest, LayerRangesLandWhereTheyAreSent) {
  Open(8);
  const HostChunk c = MakeChunk(4 * kSlot, 'q');
  ASSERT_TRUE(Stage(Id(1, 1), c).ok());
  // Two ranges, the second crossing a slot boundary, to two places in one allocation.
  absl::StatusOr<DevicePtr> dst = device_->Allocate(2 * kSlot);
  ASSERT_TRUE(dst.ok());
  Result r;
  tier_->CopyToDevice(Id(1, 1), {{100, 50, *dst + 10}, {kSlot - 8, 40, *dst + 1000}},
                      r.Callback());
  ASSERT_TRUE(r.Wait().ok());
  EXPECT_EQ(std::string(device_->HostView(*dst) + 10, 50), c.bytes->substr(100, 50));
  EXPECT_EQ(std::string(device_->HostView(*dst) + 1000, 40), c.bytes->substr(kSlot - 8, 40));

  Result outside;
  tier_->CopyToDevice(Id(1, 1), {{4 * kSlot - 10, 11, *dst}}, outside.Callback());
  EXPECT_EQ(outside.Wait().code(), absl::StatusCode::kInvalidArgument);
  // A destination nobody allocated is refused by the device, not written.
  Result wild;
  tier_->CopyToDevice(Id(1, 1), {{0, 16, 0x10}}, wild.Callback());
  EXPECT_EQ(wild.Wait().code(), absl::StatusCode::kInvalidArgument);
  device_->Free(*dst);
}

TEST_F(GpuStagingTierTest, ChunkIsInvisibleUntilItsCopyLands) {
  held_ = true;
  Open(8, {.hold_copies = true});
  const HostChunk c = MakeChunk(2 * kSlot, 'b');
  Result staged;
  tier_->Stage(Id(1, 1), c.meta, c.Pieces(), c.bytes, staged.Callback());
  EXPECT_FALSE(staged.HasRun());
  EXPECT_FALSE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_EQ(tier_->GetStats().loading, 1u);

  Result early;
  tier_->CopyToDevice(Id(1, 1), {{0, 1, 0}}, early.Callback());
  // Staging the same chunk again while it loads is not a second copy.
  Result again;
  tier_->Stage(Id(1, 1), c.meta, c.Pieces(), c.bytes, again.Callback());
  EXPECT_EQ(device_->submissions(), 1u);

  device_->RunPending();
  EXPECT_TRUE(staged.Wait().ok());
  EXPECT_EQ(early.Wait().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(again.Wait().ok());
  EXPECT_TRUE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_EQ(tier_->GetStats().misses, 1u);
}

TEST_F(GpuStagingTierTest, EvictsLeastRecentlyUsedButNeverAChunkBeingRead) {
  held_ = true;
  Open(4, {.hold_copies = true});
  const HostChunk a = MakeChunk(2 * kSlot, 'a');
  const HostChunk b = MakeChunk(2 * kSlot, 'b');
  ASSERT_TRUE(Stage(Id(1, 1), a).ok());
  ASSERT_TRUE(Stage(Id(1, 2), b).ok());
  // A is least recently used, but a copy out of it is in flight: B goes instead.
  absl::StatusOr<DevicePtr> dst = device_->Allocate(a.meta.size);
  ASSERT_TRUE(dst.ok());
  Result reading;
  tier_->CopyToDevice(Id(1, 1), {{0, a.meta.size, *dst}}, reading.Callback());
  // That read made A the most recent; a read of B that completes (on another stream,
  // while A's is still in flight) makes B the more recent, so plain LRU would pick A.
  absl::StatusOr<DevicePtr> dst_b = device_->Allocate(b.meta.size);
  ASSERT_TRUE(dst_b.ok());
  Result read_b;
  tier_->CopyToDevice(Id(1, 2), {{0, b.meta.size, *dst_b}}, read_b.Callback());
  ASSERT_TRUE(device_->RunNewest());
  ASSERT_TRUE(read_b.Wait().ok());
  EXPECT_FALSE(reading.HasRun());
  device_->Free(*dst_b);

  const HostChunk c = MakeChunk(2 * kSlot, 'c');
  Result staged;
  tier_->Stage(Id(1, 3), c.meta, c.Pieces(), c.bytes, staged.Callback());
  device_->RunPending();
  ASSERT_TRUE(staged.Wait().ok());
  ASSERT_TRUE(reading.Wait().ok());
  EXPECT_EQ(std::string(device_->HostView(*dst), a.meta.size), *a.bytes);
  device_->Free(*dst);

  EXPECT_TRUE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_FALSE(tier_->Find(Id(1, 2)).has_value());
  EXPECT_TRUE(tier_->Find(Id(1, 3)).has_value());
  EXPECT_EQ(tier_->GetStats().evictions, 1u);
}

TEST_F(GpuStagingTierTest, NoRoomEvictsNothingAndSaysResourceExhausted) {
  held_ = true;
  Open(4, {.hold_copies = true});
  const HostChunk a = MakeChunk(2 * kSlot, 'a');
  const HostChunk b = MakeChunk(2 * kSlot, 'b');
  ASSERT_TRUE(Stage(Id(1, 1), a).ok());
  // B loads (held) and A is being read: a third chunk of 3 slots could only get room
  // by evicting one of them.
  Result loading, reading;
  tier_->Stage(Id(1, 2), b.meta, b.Pieces(), b.bytes, loading.Callback());
  absl::StatusOr<DevicePtr> dst = device_->Allocate(a.meta.size);
  ASSERT_TRUE(dst.ok());
  tier_->CopyToDevice(Id(1, 1), {{0, a.meta.size, *dst}}, reading.Callback());

  const HostChunk c = MakeChunk(kSlot, 'c');
  Result refused;
  tier_->Stage(Id(1, 3), c.meta, c.Pieces(), c.bytes, refused.Callback());
  device_->RunPending();
  EXPECT_EQ(refused.Wait().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(loading.Wait().ok());
  EXPECT_TRUE(reading.Wait().ok());
  EXPECT_TRUE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_TRUE(tier_->Find(Id(1, 2)).has_value());
  EXPECT_EQ(tier_->GetStats().no_room, 1u);
  EXPECT_EQ(tier_->GetStats().evictions, 0u);
  device_->Free(*dst);

  // Larger than the whole tier: InvalidArgument, never worth retrying.
  const HostChunk huge = MakeChunk(5 * kSlot, 'h');
  EXPECT_EQ(Stage(Id(1, 4), huge).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuStagingTierTest, DeviceErrorMidCopyStagesNothingAndLeaksNoSlot) {
  Open(4);
  const HostChunk c = MakeChunk(3 * kSlot, 'e');
  // The pieces are odd-sized, so the copy is several calls; the first lands, then the
  // device fails.
  device_->FailSubmission(1, absl::UnavailableError("injected: illegal address"));
  const absl::Status s = Stage(Id(1, 1), c);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("injected"), absl::string_view::npos) << s;
  EXPECT_FALSE(tier_->Find(Id(1, 1)).has_value());
  GpuStagingStats stats = tier_->GetStats();
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_EQ(stats.stage_failures, 1u);
  EXPECT_EQ(stats.chunks, 0u);

  // The tier goes on working, with all its room.
  const HostChunk d = MakeChunk(4 * kSlot, 'f');
  ASSERT_TRUE(Stage(Id(1, 2), d).ok());
  absl::StatusOr<std::string> back = ReadBack(Id(1, 2), d.meta.size);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, *d.bytes);

  // A failure copying out leaves the staged chunk alone.
  absl::StatusOr<DevicePtr> dst = device_->Allocate(d.meta.size);
  ASSERT_TRUE(dst.ok());
  device_->FailSubmission(1, absl::UnavailableError("injected"));
  Result failed;
  tier_->CopyToDevice(Id(1, 2), {{0, d.meta.size, *dst}}, failed.Callback());
  EXPECT_EQ(failed.Wait().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(tier_->GetStats().copy_failures, 1u);
  EXPECT_TRUE(tier_->Find(Id(1, 2)).has_value());
  device_->Free(*dst);
}

TEST_F(GpuStagingTierTest, RemoveDuringCopiesFreesSlotsOnlyOnceTheDeviceIsDone) {
  held_ = true;
  Open(4, {.hold_copies = true});
  const HostChunk a = MakeChunk(2 * kSlot, 'a');
  const HostChunk b = MakeChunk(2 * kSlot, 'b');
  // A loading, B being read; both removed meanwhile.
  Result loading;
  tier_->Stage(Id(1, 1), a.meta, a.Pieces(), a.bytes, loading.Callback());
  ASSERT_TRUE(Stage(Id(2, 1), b).ok());  // Runs A's copy too.
  ASSERT_TRUE(loading.Wait().ok());
  ASSERT_TRUE(tier_->Remove(Id(1, 1)));

  Result loading2;
  tier_->Stage(Id(1, 1), a.meta, a.Pieces(), a.bytes, loading2.Callback());
  absl::StatusOr<DevicePtr> dst = device_->Allocate(b.meta.size);
  ASSERT_TRUE(dst.ok());
  Result reading;
  tier_->CopyToDevice(Id(2, 1), {{0, b.meta.size, *dst}}, reading.Callback());
  EXPECT_TRUE(tier_->Remove(Id(1, 1)));
  EXPECT_EQ(tier_->RemoveNamespace(2), 1u);
  EXPECT_FALSE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_FALSE(tier_->Find(Id(2, 1)).has_value());
  // The device may still write into A's slots and read B's: they are not free yet.
  EXPECT_EQ(tier_->GetStats().used_bytes, 4 * kSlot);
  const HostChunk c = MakeChunk(kSlot, 'c');
  Result refused;
  tier_->Stage(Id(3, 1), c.meta, c.Pieces(), c.bytes, refused.Callback());

  device_->RunPending();
  EXPECT_EQ(refused.Wait().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(loading2.Wait().ok());
  EXPECT_TRUE(reading.Wait().ok());
  EXPECT_EQ(std::string(device_->HostView(*dst), b.meta.size), *b.bytes);
  device_->Free(*dst);
  const GpuStagingStats stats = tier_->GetStats();
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_EQ(stats.chunks, 0u);
  EXPECT_FALSE(tier_->Find(Id(1, 1)).has_value());
  EXPECT_TRUE(Stage(Id(3, 1), c).ok());
}

TEST_F(GpuStagingTierTest, PiecesThatDoNotAddUpAreRefused) {
  Open(4);
  HostChunk c = MakeChunk(kSlot, 'p');
  c.meta.size += 1;
  EXPECT_EQ(Stage(Id(1, 1), c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->GetStats().used_bytes, 0u);
}

TEST(GpuStagingTierCreateTest, DeviceOutOfMemoryIsResourceExhausted) {
  FakeDeviceBackend device({.memory_bytes = 2 * kSlot});
  GpuStagingOptions options;
  options.capacity_bytes = 4 * kSlot;
  options.slot_bytes = kSlot;
  auto tier = GpuStagingTier::Create(options, &device, std::make_unique<LruPolicy>());
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(device.live_allocations(), 0u);

  options.slot_bytes = 1000;
  EXPECT_EQ(GpuStagingTier::Create(options, &device, std::make_unique<LruPolicy>())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
