// The StorageTier contract, checked the same way on every tier: the host-RAM pool, the
// SSD tier, the GPU staging buffers (on the fake device) and the shared remote tier
// (on a real Redis Cluster; skipped without redis-server). A tier that plugs into the
// store must pass all of it.
#include "storage/storage_tier.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <ostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "storage/gpu_tier.h"
#include "storage/host_pool.h"
#include "storage/log.h"
#include "storage/lru_policy.h"
#include "storage/remote_tier.h"
#include "storage/ssd_tier.h"
#include "tests/support/fake_clock.h"
#include "tests/support/fake_device_backend.h"
#include "tests/support/redis_cluster_process.h"

namespace kvtier {
namespace {

using testing::RedisClusterProcess;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kCapacity = 8 * kMiB;  // Of each tier that has one.
constexpr uint64_t kNs = 0x51, kOtherNs = 0x52;
constexpr uint64_t kUnknownNs = 0x53;  // No layout anywhere (the remote tier refuses it).

std::string Payload(const ChunkId& id, uint64_t size) {
  std::string s(size, '\0');
  uint64_t x = id.key.hi * 0x9e3779b97f4a7c15ull + id.ns + 1;
  for (size_t i = 0; i + 8 <= size; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&s[i], &x, 8);
  }
  return s;
}

ChunkId Id(uint64_t n, uint64_t ns = kNs) { return ChunkId{ns, ChunkKey{0xab00 + n, n}}; }

// One tier under test, with whatever it stands on.
struct TierUnderTest {
  virtual ~TierUnderTest() = default;
  virtual StorageTier& tier() = 0;
};

struct RamTier : TierUnderTest {
  RamTier() {
    HostPoolOptions o;
    o.arena.capacity_bytes = kCapacity;
    o.arena.slot_bytes = 64 << 10;
    auto p = HostPool::Create(o, std::make_unique<LruPolicy>());
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) pool = *std::move(p);
  }
  StorageTier& tier() override { return *pool; }
  std::unique_ptr<HostPool> pool;
};

struct SsdTierUnderTest : TierUnderTest {
  SsdTierUnderTest() {
    SsdTierOptions o;
    o.path = dir.path() + "/db";
    o.capacity_bytes = kCapacity;
    o.write_buffer_bytes = 8 * kMiB;
    auto t = SsdTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) ssd = *std::move(t);
  }
  StorageTier& tier() override { return *ssd; }
  testing::TempDir dir{"kvtier_tier"};
  std::unique_ptr<SsdTier> ssd;
};

struct GpuTierUnderTest : TierUnderTest {
  GpuTierUnderTest() : device(FakeDeviceOptions{.memory_bytes = 64 * kMiB}) {
    GpuStagingOptions staging;
    staging.capacity_bytes = kCapacity;
    staging.slot_bytes = 64 << 10;
    gpu = GpuTier::Create(&device, staging, host_pool.data(), host_pool.size());
  }
  ~GpuTierUnderTest() override {
    gpu.reset();
    EXPECT_EQ(device.live_allocations(), 0u);
    EXPECT_TRUE(device.misuse().empty()) << device.misuse()[0];
  }
  StorageTier& tier() override { return *gpu; }
  FakeDeviceBackend device;
  std::vector<char> host_pool = std::vector<char>(1 << 20);
  std::unique_ptr<GpuTier> gpu;
};

// One cluster for the whole binary (starting one takes a while), stopped at exit.
RedisClusterProcess* g_cluster = nullptr;

RedisClusterProcess* SharedCluster() {
  if (g_cluster == nullptr) {
    auto c = RedisClusterProcess::Start({});
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) g_cluster = c->release();
  }
  return g_cluster;
}

class ClusterEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    delete g_cluster;
    g_cluster = nullptr;
  }
};
[[maybe_unused]] ::testing::Environment* const kClusterEnvironment =
    ::testing::AddGlobalTestEnvironment(new ClusterEnvironment);

struct RemoteTierUnderTest : TierUnderTest {
  RemoteTierUnderTest() {
    RedisClusterProcess* cluster = SharedCluster();
    if (cluster == nullptr) return;
    EXPECT_TRUE(cluster->FlushAll().ok());
    RemoteTierOptions o;
    o.cluster.seeds = cluster->Seeds();
    o.cluster.tls = cluster->ClientTls();
    o.cluster.min_refresh_interval = absl::ZeroDuration();
    o.segment_bytes = 64 << 10;
    o.batch_bytes = 450 << 10;  // ReadMany of ~210 KiB chunks: two per pipeline.
    o.layout_of = [](uint64_t ns) -> absl::StatusOr<RemoteLayout> {
      if (ns != kNs && ns != kOtherNs) return absl::NotFoundError("no such namespace");
      return RemoteLayout{ns * 1000003, /*chunk_bytes=*/0};  // Sizes vary here.
    };
    auto t = RemoteTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) remote = *std::move(t);
  }
  StorageTier& tier() override { return *remote; }
  std::unique_ptr<RemoteTier> remote;
};

struct Param {
  const char* name;
  std::function<std::unique_ptr<TierUnderTest>()> make;
  bool needs_redis = false;
  bool reads_ranges = false;  // Streams a chunk a frame at a time (SSD).
  bool quotas = false;        // Keeps per-namespace bytes for tenants' quotas (RAM, SSD).
  bool batches_reads = false;  // ReadMany fetches several chunks per round trip (remote).
};

void PrintTo(const Param& p, std::ostream* os) { *os << p.name; }

class StorageTierTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    if (GetParam().needs_redis && !RedisClusterProcess::Available()) {
      GTEST_SKIP() << "redis-server not installed";
    }
    under_test_ = GetParam().make();
    ASSERT_NE(under_test_, nullptr);
    tier_ = &under_test_->tier();
  }

  // Writes Payload(id, size) and waits for `done`.
  absl::Status Write(const ChunkId& id, uint64_t size, int64_t wrong_size_by = 0) {
    auto bytes = std::make_shared<const std::string>(Payload(id, size));
    ChunkMeta meta{size, crc32c::Value(*bytes), 256, 0};
    meta.size += wrong_size_by;
    absl::Notification landed;
    absl::Status status;
    tier_->Write(id, meta, ChunkBytes::Of(bytes), [&](absl::Status s) {
      status = std::move(s);
      landed.Notify();
    });
    landed.WaitForNotification();
    return status;
  }

  // Reads a whole chunk into a string; `refuse` makes sink_for give no sink.
  absl::StatusOr<std::string> Read(const ChunkId& id, bool refuse = false) {
    std::string out;
    StringSink sink(&out);
    absl::Notification read;
    absl::StatusOr<ChunkMeta> meta;
    tier_->Read(
        id,
        [&](const ChunkMeta& m) -> ChunkSink* {
          if (refuse) return nullptr;
          out.resize(m.size);
          return &sink;
        },
        [&](absl::StatusOr<ChunkMeta> m) {
          meta = std::move(m);
          read.Notify();
        });
    read.WaitForNotification();
    if (!meta.ok()) return meta.status();
    EXPECT_EQ(meta->size, out.size());
    EXPECT_EQ(meta->crc32c, crc32c::Value(out));
    EXPECT_EQ(meta->token_count, 256u);
    return out;
  }

  bool bounded() const { return tier_->capacity_bytes() > 0; }

  std::unique_ptr<TierUnderTest> under_test_;
  StorageTier* tier_ = nullptr;
};

TEST_P(StorageTierTest, WhatIsWrittenReadsBackExactly) {
  const uint64_t sizes[] = {64 << 10, kMiB + 4096, 200 << 10};
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_FALSE(tier_->Contains(Id(i)));
    ASSERT_TRUE(Write(Id(i), sizes[i]).ok()) << GetParam().name;
    EXPECT_TRUE(tier_->Contains(Id(i)));
  }
  for (uint64_t i = 0; i < 3; ++i) {
    auto bytes = Read(Id(i));
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_TRUE(*bytes == Payload(Id(i), sizes[i])) << "chunk " << i << " differs";
  }
  const TierStats s = tier_->Stats();
  EXPECT_EQ(s.tier, tier_->tier());
  EXPECT_GE(s.hits, 3u);
  if (bounded()) {
    EXPECT_EQ(s.capacity_bytes, tier_->capacity_bytes());
    EXPECT_EQ(s.chunks, 3u);
    EXPECT_EQ(s.payload_bytes, sizes[0] + sizes[1] + sizes[2]);
    EXPECT_GE(s.used_bytes, s.payload_bytes);
  }
}

TEST_P(StorageTierTest, WritesAreIdempotent) {
  ASSERT_TRUE(Write(Id(1), 128 << 10).ok());
  ASSERT_TRUE(Write(Id(1), 128 << 10).ok());
  auto bytes = Read(Id(1));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_TRUE(*bytes == Payload(Id(1), 128 << 10));
  if (bounded()) { EXPECT_EQ(tier_->Stats().chunks, 1u); }
}

TEST_P(StorageTierTest, AMissIsNotFound) {
  EXPECT_EQ(Read(Id(9)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(tier_->Contains(Id(9)));
  auto deleted = tier_->Delete(Id(9));
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_FALSE(*deleted);
}

TEST_P(StorageTierTest, DeleteTakesOnlyThatChunk) {
  ASSERT_TRUE(Write(Id(1), 64 << 10).ok());
  ASSERT_TRUE(Write(Id(2), 64 << 10).ok());
  auto deleted = tier_->Delete(Id(1));
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_TRUE(*deleted);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(*tier_->Delete(Id(1)));
  auto kept = Read(Id(2));
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(*kept == Payload(Id(2), 64 << 10));
  if (bounded()) { EXPECT_EQ(tier_->Stats().chunks, 1u); }
}

TEST_P(StorageTierTest, DeleteNamespaceTakesAllOfItAndNothingElse) {
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(Write(Id(i), 64 << 10).ok());
  ASSERT_TRUE(Write(Id(7, kOtherNs), 64 << 10).ok());
  auto removed = tier_->DeleteNamespace(kNs);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 3u);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_FALSE(tier_->Contains(Id(i)));
  auto kept = Read(Id(7, kOtherNs));
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(*kept == Payload(Id(7, kOtherNs), 64 << 10));
}

TEST_P(StorageTierTest, BytesThatDoNotAddUpAreRefusedAndNothingIsStored) {
  EXPECT_EQ(Write(Id(3), 64 << 10, /*wrong_size_by=*/+4096).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(tier_->Contains(Id(3)));
  EXPECT_EQ(Read(Id(3)).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(StorageTierTest, AReadWithNowhereToGoIsResourceExhausted) {
  ASSERT_TRUE(Write(Id(4), 64 << 10).ok());
  EXPECT_EQ(Read(Id(4), /*refuse=*/true).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(tier_->Contains(Id(4)));  // Still there for the next reader.
  EXPECT_TRUE(Read(Id(4)).ok());
}

// A bounded tier evicts through its policy: three times its capacity written, it
// holds at most its capacity, the newest chunk is there, the oldest went.
TEST_P(StorageTierTest, CapacityBoundsWhatItHolds) {
  if (!bounded()) GTEST_SKIP() << "bounded by the cluster, not here";
  const uint64_t n = 3 * kCapacity / kMiB;
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(Write(Id(i), kMiB).ok()) << "chunk " << i;
  }
  const TierStats s = tier_->Stats();
  EXPECT_LE(s.used_bytes, tier_->capacity_bytes());
  EXPECT_LT(s.chunks, n);
  EXPECT_GE(s.evictions, n - s.chunks);
  EXPECT_FALSE(tier_->Contains(Id(0)));
  auto newest = Read(Id(n - 1));
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_TRUE(*newest == Payload(Id(n - 1), kMiB));
}

TEST_P(StorageTierTest, ContainsManyAnswersForEachChunkInOrder) {
  ASSERT_TRUE(Write(Id(1), 64 << 10).ok());
  ASSERT_TRUE(Write(Id(3), 64 << 10).ok());
  const ChunkId ids[] = {Id(0), Id(1), Id(2), Id(3), Id(1, kOtherNs)};
  EXPECT_EQ(tier_->ContainsMany(ids), (std::vector<bool>{false, true, false, true, false}));
  EXPECT_TRUE(tier_->ContainsMany({}).empty());
}

// ReadMany: each chunk into its own sink, each `done` once, a miss, an unknown
// namespace or a refused sink stopping only its own chunk, and each chunk handed over
// before the last is asked for (the store releases a chunk to its Get as it lands). A
// tier that batches asks for the sinks of a batch before any of its chunks lands.
TEST_P(StorageTierTest, ReadManyReadsEachChunkIntoItsOwnSinkAndAnswersEachOnce) {
  const uint64_t size = 200 << 10;
  for (uint64_t i : {1, 2, 3, 4}) ASSERT_TRUE(Write(Id(i), size + i * 4096).ok());
  const std::vector<ChunkId> ids = {Id(1), Id(9), Id(2), Id(3), Id(5, kUnknownNs), Id(4)};
  const size_t kAbsent = 1, kRefused = 3, kUnknown = 4;  // Id(3): given no sink.
  std::vector<std::string> out(ids.size());
  std::vector<std::optional<StringSink>> sinks(ids.size());
  std::vector<int> answers(ids.size(), 0), asked(ids.size(), 0);
  std::vector<absl::StatusOr<ChunkMeta>> results(ids.size(), absl::UnknownError("no answer"));
  std::vector<std::string> order;  // "ask i" and "done i", as they came.
  tier_->ReadMany(
      ids,
      [&](size_t i, const ChunkMeta& meta) -> ChunkSink* {
        ++asked[i];
        order.push_back(absl::StrCat("ask ", i));
        if (i == kRefused) return nullptr;
        out[i].resize(meta.size);
        return &sinks[i].emplace(&out[i]);
      },
      [&](size_t i, absl::StatusOr<ChunkMeta> meta) {
        ASSERT_LT(i, ids.size());
        ++answers[i];
        order.push_back(absl::StrCat("done ", i));
        results[i] = std::move(meta);
      });
  EXPECT_EQ(answers, (std::vector<int>{1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(asked[kAbsent], 0) << "a sink asked for a chunk the tier does not hold";
  EXPECT_EQ(asked[kUnknown], 0) << "a sink asked for a chunk of an unknown namespace";
  auto at = [&](const std::string& event) {
    return std::find(order.begin(), order.end(), event) - order.begin();
  };
  EXPECT_LT(at("done 0"), at("ask 5")) << "the first chunk waited for the last";
  if (GetParam().batches_reads) {
    // Chunks 0 and 2 share a pipeline: both sinks are given before either lands.
    EXPECT_LT(at("ask 2"), at("done 0")) << "chunks 0 and 2 were fetched one at a time";
  }
  EXPECT_EQ(results[kAbsent].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(results[kUnknown].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(results[kRefused].status().code(), absl::StatusCode::kResourceExhausted);
  for (size_t i : {0, 2, 5}) {
    ASSERT_TRUE(results[i].ok()) << "chunk " << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->size, out[i].size());
    EXPECT_EQ(results[i]->crc32c, crc32c::Value(out[i]));
    EXPECT_TRUE(out[i] == Payload(ids[i], size + ids[i].key.lo * 4096)) << "chunk " << i;
  }
  EXPECT_TRUE(tier_->Contains(Id(3)));  // Refused, not dropped.
}

// Ranged reads: a tier that streams reads any range of a chunk exactly, and refuses
// one past its end; a tier that does not says Unimplemented.
TEST_P(StorageTierTest, ReadRangeReadsExactBytesWhereTheTierStreams) {
  const uint64_t size = kMiB + 4096;
  ASSERT_TRUE(Write(Id(5), size).ok());
  const std::string want = Payload(Id(5), size);
  const ChunkMeta meta{size, crc32c::Value(want), 256, 0};
  EXPECT_EQ(tier_->reads_ranges(), GetParam().reads_ranges);
  std::string out(size, '\0');
  if (!GetParam().reads_ranges) {
    EXPECT_EQ(tier_->ReadRange(Id(5), meta, 0, size, out.data()).code(),
              absl::StatusCode::kUnimplemented);
    return;
  }
  tier_->CountRangedRead();
  for (uint64_t offset = 0; offset < size;) {
    const uint64_t len = std::min<uint64_t>(300 << 10, size - offset);
    ASSERT_TRUE(tier_->ReadRange(Id(5), meta, offset, len, out.data() + offset).ok())
        << "at " << offset;
    offset += len;
  }
  EXPECT_TRUE(out == want);
  EXPECT_EQ(tier_->ReadRange(Id(5), meta, size - 1, 2, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_GE(tier_->Stats().hits, 1u);
}

TEST_P(StorageTierTest, DropCorruptDropsOnlyThatCopyAndSaysDataLoss) {
  ASSERT_TRUE(Write(Id(1), 64 << 10).ok());
  ASSERT_TRUE(Write(Id(2), 64 << 10).ok());
  const std::string bytes = Payload(Id(1), 64 << 10);
  const ChunkMeta meta{bytes.size(), crc32c::Value(bytes), 256, 0};
  EXPECT_EQ(tier_->DropCorrupt(Id(1), meta).code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tier_->Contains(Id(2)));
}

// Tenants' quotas: a tier that keeps them counts each namespace's payload bytes and
// shrinks only the namespaces named; the others hold nothing and shrink nothing.
TEST_P(StorageTierTest, NamespaceBytesAndShrinkTouchOnlyTheNamespacesNamed) {
  const uint64_t size = 128 << 10;
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(Write(Id(i), size).ok());
  ASSERT_TRUE(Write(Id(7, kOtherNs), size).ok());
  const absl::flat_hash_set<uint64_t> tenant = {kNs};
  if (!GetParam().quotas) {
    EXPECT_EQ(tier_->NamespaceQuotaBytes(tenant), 0u);
    EXPECT_EQ(tier_->ShrinkNamespaces(tenant, 0).status().code(),
              absl::StatusCode::kUnimplemented);
    EXPECT_TRUE(tier_->Contains(Id(0)));
    return;
  }
  EXPECT_EQ(tier_->NamespaceQuotaBytes(tenant), 4 * size);
  EXPECT_EQ(tier_->NamespaceQuotaBytes({kOtherNs}), size);
  auto held = tier_->ShrinkNamespaces(tenant, 2 * size);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, 2 * size);
  EXPECT_EQ(tier_->NamespaceQuotaBytes(tenant), 2 * size);
  const ChunkId ids[] = {Id(0), Id(1), Id(2), Id(3)};
  const std::vector<bool> left = tier_->ContainsMany(ids);
  EXPECT_EQ(std::count(left.begin(), left.end(), true), 2);
  EXPECT_TRUE(tier_->Contains(Id(7, kOtherNs)));
  EXPECT_EQ(tier_->NamespaceQuotaBytes({kOtherNs}), size);
}

INSTANTIATE_TEST_SUITE_P(
    EveryTier, StorageTierTest,
    ::testing::Values(
        Param{"ram", [] { return std::unique_ptr<TierUnderTest>(new RamTier); },
              /*needs_redis=*/false, /*reads_ranges=*/false, /*quotas=*/true},
        Param{"ssd", [] { return std::unique_ptr<TierUnderTest>(new SsdTierUnderTest); },
              /*needs_redis=*/false, /*reads_ranges=*/true, /*quotas=*/true},
        Param{"gpu", [] { return std::unique_ptr<TierUnderTest>(new GpuTierUnderTest); }},
        Param{"remote", [] { return std::unique_ptr<TierUnderTest>(new RemoteTierUnderTest); },
              /*needs_redis=*/true, /*reads_ranges=*/false, /*quotas=*/false,
              /*batches_reads=*/true}),
    [](const ::testing::TestParamInfo<Param>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvtier
