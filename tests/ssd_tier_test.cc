// SsdTier on a real RocksDB in a temp dir: round trips of multi-part payloads, the index
// rebuilt at reopen, LRU capacity eviction, TTL on an injected clock, deletes, and the
// failures the tier must survive (a full disk, corrupt reads) through FaultInjectionFs.
#include "storage/ssd_tier.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/crc32c.h"
#include "tests/support/fake_clock.h"
#include "storage/log.h"
#include "tests/support/fault_injection_fs.h"

namespace kvtier {
namespace {

using ::kvtier::testing::FakeClock;
using ::kvtier::testing::TempDir;

using ::kvtier::testing::FaultInjectionFs;

constexpr uint64_t kMiB = 1 << 20;



ChunkId Id(uint64_t n, uint64_t ns = 0x1111) {
  return ChunkId{ns, ChunkKey{0xabc0000000000000ull | n, n * 0x9e3779b97f4a7c15ull}};
}

std::string Payload(const ChunkId& id, uint64_t size) {
  std::string s(size, '\0');
  uint64_t x = id.key.lo ^ id.ns ^ 0x243f6a8885a308d3ull;
  for (size_t i = 0; i + 8 <= size; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&s[i], &x, 8);
  }
  for (size_t i = size & ~size_t{7}; i < size; ++i) s[i] = static_cast<char>(i);
  return s;
}

ChunkMeta MetaOf(absl::string_view data, uint32_t tokens = 256) {
  return ChunkMeta{data.size(), crc32c::Value(data), tokens, 0};
}

// Cuts `data` into `n` uneven parts.
std::vector<absl::string_view> Parts(absl::string_view data, size_t n) {
  std::vector<absl::string_view> parts;
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t left = data.size() - at;
    const size_t len = i + 1 == n ? left : std::min(left, left / (n - i) + 1000 * i);
    parts.push_back(data.substr(at, len));
    at += len;
  }
  return parts;
}

class SsdTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    options_.path = dir_.path() + "/db";
    options_.capacity_bytes = 64 * kMiB;
    options_.write_buffer_bytes = 8 * kMiB;
    options_.now = [this] { return clock_.Now(); };
    Open();
  }
  void TearDown() override { tier_.reset(); }

  void Open() {
    tier_.reset();
    auto t = SsdTier::Open(options_);
    ASSERT_TRUE(t.ok()) << t.status();
    tier_ = *std::move(t);
  }

  absl::Status Put(const ChunkId& id, absl::string_view data, size_t parts = 1) {
    const auto p = Parts(data, parts);
    return tier_->Put(id, MetaOf(data), p);
  }

  void PutOk(const ChunkId& id, uint64_t size, size_t parts = 1) {
    const std::string data = Payload(id, size);
    ASSERT_TRUE(Put(id, data, parts).ok());
  }

  // Get succeeds with exactly the bytes Payload(id, size) put there.
  void ExpectStored(const ChunkId& id, uint64_t size) {
    auto c = tier_->Get(id);
    ASSERT_TRUE(c.ok()) << id.DebugString() << ": " << c.status();
    const std::string want = Payload(id, size);
    EXPECT_EQ(c->meta, MetaOf(want)) << id.DebugString();
    EXPECT_TRUE(c->data == want) << id.DebugString() << ": bytes differ";
  }

  TempDir dir_{"kvtier_ssd"};
  FakeClock clock_;
  SsdTierOptions options_;
  std::unique_ptr<SsdTier> tier_;
};

TEST(SsdTierOptionsTest, ValidateNamesTheBadOption) {
  SsdTierOptions o;
  o.path = "/tmp/x";
  EXPECT_TRUE(o.Validate().ok());
  struct Case {
    const char* name;
    std::function<void(SsdTierOptions&)> spoil;
  } cases[] = {
      {"data_dir", [](SsdTierOptions& o) { o.path.clear(); }},
      {"ssd_capacity", [](SsdTierOptions& o) { o.capacity_bytes = 0; }},
      {"ssd_ttl", [](SsdTierOptions& o) { o.ttl = absl::Seconds(-1); }},
      {"ssd_write_buffer", [](SsdTierOptions& o) { o.write_buffer_bytes = 1 << 20; }},
  };
  for (const auto& c : cases) {
    SsdTierOptions bad = o;
    c.spoil(bad);
    const absl::Status s = bad.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_TRUE(absl::StrContains(s.message(), c.name)) << c.name << ": " << s;
    EXPECT_EQ(SsdTier::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(SsdRowKeyTest, NamespaceBigEndianThenKey) {
  const ChunkId id{0x0102030405060708ull, ChunkKey{0x1112131415161718ull, 0x2122232425262728ull}};
  const std::string row = SsdRowKey(id);
  ASSERT_EQ(row.size(), 24u);
  EXPECT_EQ(row.substr(0, 8), std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8));
  EXPECT_EQ(row.substr(8), id.key.ToByteString());
}

TEST_F(SsdTierTest, PutGetRoundTripMultiPart) {
  const ChunkId big = Id(1), odd = Id(2), tiny = Id(3);
  const std::string big_data = Payload(big, 6 * kMiB);
  const std::string odd_data = Payload(odd, 3 * kMiB + 12345);
  const std::string tiny_data = Payload(tiny, 100);  // Below blob_min_bytes: inline.
  ASSERT_TRUE(Put(big, big_data, 7).ok());
  ASSERT_TRUE(Put(odd, odd_data, 3).ok());
  ASSERT_TRUE(Put(tiny, tiny_data, 1).ok());
  EXPECT_TRUE(tier_->Contains(big));
  EXPECT_FALSE(tier_->Contains(Id(4)));

  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.chunks, 3u);
  EXPECT_EQ(s.used_bytes, big_data.size() + odd_data.size() + tiny_data.size());
  EXPECT_EQ(s.capacity_bytes, 64 * kMiB);

  // From the memtable.
  ExpectStored(big, 6 * kMiB);
  ExpectStored(odd, 3 * kMiB + 12345);
  ExpectStored(tiny, 100);
  // And from blob files.
  ASSERT_TRUE(tier_->Flush().ok());
  ExpectStored(big, 6 * kMiB);
  ExpectStored(odd, 3 * kMiB + 12345);
  ExpectStored(tiny, 100);

  auto missing = tier_->Get(Id(4));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  // Another namespace with the same key is another chunk.
  EXPECT_EQ(tier_->Get(Id(1, /*ns=*/0x2222)).status().code(), absl::StatusCode::kNotFound);
  s = tier_->GetStats();
  EXPECT_EQ(s.hits, 6u);
  EXPECT_EQ(s.misses, 2u);
}

TEST_F(SsdTierTest, ReadRangeReadsAcrossSegmentsAndRejectsRangesPastTheEnd) {
  const ChunkId id = Id(1);
  const uint64_t size = 9 * kMiB + 4321;  // Three segments, the last one short.
  const std::string data = Payload(id, size);
  ASSERT_TRUE(Put(id, data, 4).ok());
  const ChunkMeta meta = MetaOf(data);
  for (bool flushed : {false, true}) {
    if (flushed) ASSERT_TRUE(tier_->Flush().ok());
    struct Range {
      uint64_t off, len;
    } ranges[] = {{0, size},
                  {0, 4 * kMiB},
                  {4 * kMiB - 10, 20},             // Straddles segments 0 and 1.
                  {3 * kMiB, 6 * kMiB + 4321},     // Through to the end.
                  {size - 1, 1},
                  {5 * kMiB, 0}};
    for (const Range& r : ranges) {
      std::string out(r.len, '\0');
      absl::Status st = tier_->ReadRange(id, meta, r.off, r.len, out.data());
      ASSERT_TRUE(st.ok()) << r.off << "+" << r.len << ": " << st;
      EXPECT_TRUE(out == data.substr(r.off, r.len)) << r.off << "+" << r.len;
    }
  }
  char byte;
  EXPECT_EQ(tier_->ReadRange(id, meta, size, 1, &byte).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->ReadRange(id, meta, 1, size, &byte).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(tier_->Delete(id).ok());
  EXPECT_EQ(tier_->ReadRange(id, meta, 0, 1, &byte).code(), absl::StatusCode::kNotFound);
}

TEST_F(SsdTierTest, MetaIsKeptAsGiven) {
  const std::string data = Payload(Id(1), 5000);
  const ChunkMeta meta{data.size(), crc32c::Value(data), 17, 0};
  const absl::string_view part(data);
  ASSERT_TRUE(tier_->Put(Id(1), meta, {&part, 1}).ok());
  Open();
  auto c = tier_->Get(Id(1));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->meta.token_count, 17u);
  EXPECT_EQ(c->meta.size, 5000u);
  EXPECT_EQ(c->meta.crc32c, crc32c::Value(data));
}

TEST_F(SsdTierTest, PutIsIdempotent) {
  PutOk(Id(1), 2 * kMiB, 2);
  // A second put of the same id leaves the first copy alone, whatever it carries.
  const std::string other(2 * kMiB, 'z');
  EXPECT_TRUE(Put(Id(1), other).ok());
  ExpectStored(Id(1), 2 * kMiB);
  EXPECT_EQ(tier_->GetStats().chunks, 1u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 2 * kMiB);
  Open();
  ExpectStored(Id(1), 2 * kMiB);
}

TEST_F(SsdTierTest, ReopenRebuildsTheIndexFromTheWal) {
  PutOk(Id(1), 3 * kMiB, 4);
  PutOk(Id(2), 1 * kMiB, 2);
  PutOk(Id(3, /*ns=*/0x2222), 200);
  ASSERT_TRUE(tier_->SaveLayout(0x1111, "layout-one").ok());
  ASSERT_TRUE(tier_->SaveLayout(0x2222, std::string("layout\0two", 10)).ok());
  // No Flush: the chunks are only in the WAL and memtables when the tier closes.
  Open();
  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.chunks, 3u);
  EXPECT_EQ(s.used_bytes, 4 * kMiB + 200);
  EXPECT_TRUE(tier_->Contains(Id(1)));
  ExpectStored(Id(1), 3 * kMiB);
  ExpectStored(Id(2), 1 * kMiB);
  ExpectStored(Id(3, 0x2222), 200);
  auto layouts = tier_->LoadLayouts();
  ASSERT_TRUE(layouts.ok()) << layouts.status();
  ASSERT_EQ(layouts->size(), 2u);
  std::sort(layouts->begin(), layouts->end());
  EXPECT_EQ((*layouts)[0], std::make_pair(uint64_t{0x1111}, std::string("layout-one")));
  EXPECT_EQ((*layouts)[1], std::make_pair(uint64_t{0x2222}, std::string("layout\0two", 10)));
}

TEST_F(SsdTierTest, ReopenAfterFlushAndAgain) {
  PutOk(Id(1), 2 * kMiB, 3);
  ASSERT_TRUE(tier_->Flush().ok());
  Open();
  PutOk(Id(2), 2 * kMiB);
  ASSERT_TRUE(tier_->SaveLayout(7, "seven").ok());
  ASSERT_TRUE(tier_->Flush().ok());
  Open();
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 2u);
  ExpectStored(Id(1), 2 * kMiB);
  ExpectStored(Id(2), 2 * kMiB);
  auto layouts = tier_->LoadLayouts();
  ASSERT_TRUE(layouts.ok());
  ASSERT_EQ(layouts->size(), 1u);
  EXPECT_EQ((*layouts)[0].second, "seven");
  // Saving a layout again replaces it.
  ASSERT_TRUE(tier_->SaveLayout(7, "seven-again").ok());
  layouts = tier_->LoadLayouts();
  ASSERT_TRUE(layouts.ok());
  ASSERT_EQ(layouts->size(), 1u);
  EXPECT_EQ((*layouts)[0].second, "seven-again");
}

TEST_F(SsdTierTest, CapacityEvictsLeastRecentlyUsed) {
  options_.capacity_bytes = 3 * kMiB;
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  PutOk(Id(3), kMiB);
  EXPECT_EQ(tier_->GetStats().evictions, 0u);
  ExpectStored(Id(1), kMiB);  // 2 is now the coldest.
  PutOk(Id(4), kMiB);
  EXPECT_FALSE(tier_->Contains(Id(2)));
  EXPECT_EQ(tier_->Get(Id(2)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tier_->Contains(Id(1)));
  EXPECT_TRUE(tier_->Contains(Id(3)));
  EXPECT_TRUE(tier_->Contains(Id(4)));
  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.used_bytes, 3 * kMiB);
  // A chunk of two slots' worth evicts the next two coldest (3, then 1).
  PutOk(Id(5), 2 * kMiB);
  EXPECT_FALSE(tier_->Contains(Id(3)));
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_TRUE(tier_->Contains(Id(4)));
  EXPECT_EQ(tier_->GetStats().used_bytes, 3 * kMiB);
  // Evicted chunks are deleted from RocksDB, not only hidden.
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 2u);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_FALSE(tier_->Contains(Id(2)));
  EXPECT_FALSE(tier_->Contains(Id(3)));
  ExpectStored(Id(4), kMiB);
  ExpectStored(Id(5), 2 * kMiB);
  // Larger than the whole tier: refused.
  const std::string huge = Payload(Id(6), 3 * kMiB + 1);
  EXPECT_EQ(Put(Id(6), huge).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(tier_->Contains(Id(4))) << "a refused put evicts nothing";
}

TEST_F(SsdTierTest, ReopenWithSmallerCapacityDropsTheOldest) {
  for (uint64_t i = 1; i <= 4; ++i) {
    PutOk(Id(i), kMiB);
    clock_.Advance(absl::Seconds(1));
  }
  options_.capacity_bytes = 2 * kMiB;
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 2u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 2 * kMiB);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_FALSE(tier_->Contains(Id(2)));
  ExpectStored(Id(3), kMiB);
  ExpectStored(Id(4), kMiB);
  options_.capacity_bytes = 64 * kMiB;
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 2u) << "dropped chunks were deleted";
}

TEST_F(SsdTierTest, TtlHidesAndDeletesExpiredChunks) {
  options_.ttl = absl::Seconds(60);
  Open();
  PutOk(Id(1), kMiB);
  clock_.Advance(absl::Seconds(30));
  PutOk(Id(2), kMiB);
  PutOk(Id(3), kMiB);
  clock_.Advance(absl::Seconds(30));  // 1 is exactly 60 s old: expired.
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_TRUE(tier_->Contains(Id(2)));
  EXPECT_EQ(tier_->Get(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier_->GetStats().expirations, 1u);
  EXPECT_EQ(tier_->GetStats().chunks, 2u) << "an expired chunk found by Get is deleted";
  ExpectStored(Id(2), kMiB);

  // The sweep deletes what no one asked for.
  clock_.Advance(absl::Seconds(30));
  EXPECT_EQ(tier_->ExpireOld(), 2u);
  EXPECT_EQ(tier_->ExpireOld(), 0u);
  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.chunks, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.expirations, 3u);

  // Deleted, not merely hidden: a tier without a TTL does not see them either.
  options_.ttl = absl::ZeroDuration();
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 0u);
}

TEST_F(SsdTierTest, TtlAppliesAtReopen) {
  options_.ttl = absl::Seconds(60);
  Open();
  PutOk(Id(1), kMiB);
  clock_.Advance(absl::Seconds(40));
  PutOk(Id(2), kMiB);
  clock_.Advance(absl::Seconds(30));  // 1 is 70 s old, 2 is 30 s.
  Open();
  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.chunks, 1u);
  EXPECT_EQ(s.expirations, 1u);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
  // The expired one was deleted at open.
  options_.ttl = absl::ZeroDuration();
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_TRUE(tier_->Contains(Id(2)));
}

TEST_F(SsdTierTest, NoTtlKeepsChunksForever) {
  PutOk(Id(1), 1000);
  clock_.Advance(absl::Hours(24 * 365));
  EXPECT_EQ(tier_->ExpireOld(), 0u);
  ExpectStored(Id(1), 1000);
}

TEST_F(SsdTierTest, PutAfterExpiryStoresAFreshCopy) {
  options_.ttl = absl::Seconds(60);
  Open();
  PutOk(Id(1), kMiB);
  clock_.Advance(absl::Seconds(61));
  EXPECT_FALSE(tier_->Contains(Id(1)));
  // Written again before any sweep or read noticed the old copy had expired.
  PutOk(Id(1), kMiB);
  EXPECT_TRUE(tier_->Contains(Id(1)));
  ExpectStored(Id(1), kMiB);
  EXPECT_EQ(tier_->GetStats().chunks, 1u);
  EXPECT_EQ(tier_->GetStats().used_bytes, kMiB);
  clock_.Advance(absl::Seconds(59));
  EXPECT_TRUE(tier_->Contains(Id(1))) << "the TTL runs from the second put";
  Open();
  ExpectStored(Id(1), kMiB);
}

TEST_F(SsdTierTest, Delete) {
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  auto d = tier_->Delete(Id(1));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(*d);
  d = tier_->Delete(Id(1));
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(*d);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(tier_->Get(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier_->GetStats().used_bytes, kMiB);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
  // A deleted chunk can be stored again.
  PutOk(Id(1), kMiB);
  ExpectStored(Id(1), kMiB);
}

TEST_F(SsdTierTest, DeleteNamespace) {
  for (uint64_t i = 1; i <= 3; ++i) PutOk(Id(i, 0xaaaa), 100 * 1024);
  for (uint64_t i = 1; i <= 2; ++i) PutOk(Id(i, 0xbbbb), 100 * 1024);
  auto n = tier_->DeleteNamespace(0xaaaa);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 3u);
  n = tier_->DeleteNamespace(0xaaaa);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0u);
  for (uint64_t i = 1; i <= 3; ++i) EXPECT_FALSE(tier_->Contains(Id(i, 0xaaaa)));
  EXPECT_EQ(tier_->GetStats().chunks, 2u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 200u * 1024);
  Open();
  for (uint64_t i = 1; i <= 3; ++i) EXPECT_FALSE(tier_->Contains(Id(i, 0xaaaa)));
  for (uint64_t i = 1; i <= 2; ++i) ExpectStored(Id(i, 0xbbbb), 100 * 1024);
}

TEST_F(SsdTierTest, ConcurrentPutsStayWithinCapacity) {
  options_.capacity_bytes = 8 * kMiB;
  Open();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 8; ++i) {
        const ChunkId id = Id(100 * t + i);
        const std::string data = Payload(id, kMiB);
        const absl::string_view part(data);
        if (!tier_->Put(id, MetaOf(data), {&part, 1}).ok()) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  SsdTierStats s = tier_->GetStats();
  EXPECT_LE(s.used_bytes, 8 * kMiB);
  EXPECT_EQ(s.chunks * kMiB, s.used_bytes);
  EXPECT_EQ(s.evictions, 32u - s.chunks);
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, s.chunks) << "index and RocksDB agree";
}

// ---------------------------------------------------------------------------------
// Faults.

class SsdTierFaultTest : public SsdTierTest {
 protected:
  void SetUp() override {
    fs_ = std::make_shared<FaultInjectionFs>(/*seed=*/42);
    options_.file_system = fs_;
    SsdTierTest::SetUp();
  }
  // Puts, retrying while RocksDB still refuses writes after a full disk: it clears its
  // stopped state itself once its SstFileManager sees free space again, which it polls
  // every 5 s. Until then a put must fail with ResourceExhausted (never anything else,
  // never leaving half a chunk).
  absl::Status PutOnceRecovered(const ChunkId& id, absl::string_view data, size_t parts) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    absl::Status s = Put(id, data, parts);
    while (!s.ok() && absl::Now() < deadline) {
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      EXPECT_FALSE(tier_->Contains(id));
      absl::SleepFor(absl::Milliseconds(20));
      s = Put(id, data, parts);
    }
    EXPECT_TRUE(s.ok()) << s;
    return s;
  }

  std::shared_ptr<FaultInjectionFs> fs_;
};

TEST_F(SsdTierFaultTest, FullDiskIsResourceExhaustedAndRecovers) {
  PutOk(Id(1), 2 * kMiB, 2);
  PutOk(Id(2), 100);
  ASSERT_TRUE(tier_->Flush().ok());
  PutOk(Id(3), kMiB);  // Still in the WAL and memtable.

  fs_->SetNoSpace(true);
  const std::string data = Payload(Id(4), 2 * kMiB);
  const absl::Status full = Put(Id(4), data, 3);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_GT(fs_->no_space_errors(), 0u);
  EXPECT_FALSE(tier_->Contains(Id(4)));
  EXPECT_EQ(tier_->Get(Id(4)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_GE(tier_->GetStats().write_errors, 1u);
  // A second attempt while still full fails the same way.
  EXPECT_EQ(Put(Id(4), data).code(), absl::StatusCode::kResourceExhausted);

  // What was stored before stays readable while the disk is full.
  ExpectStored(Id(1), 2 * kMiB);
  ExpectStored(Id(2), 100);
  ExpectStored(Id(3), kMiB);
  EXPECT_EQ(tier_->GetStats().chunks, 3u);

  // Space is back: writes work again. RocksDB has stopped writes after the failed WAL
  // append and clears that itself once its SstFileManager sees free space again, which
  // it polls every 5 s; until then puts keep failing with ResourceExhausted (never
  // anything else, never a half-stored chunk).
  fs_->SetNoSpace(false);
  ASSERT_TRUE(PutOnceRecovered(Id(4), data, 3).ok());
  ExpectStored(Id(4), 2 * kMiB);
  PutOk(Id(5), kMiB);
  Open();
  for (uint64_t i : {1, 3, 5}) ExpectStored(Id(i), i == 1 ? 2 * kMiB : kMiB);
  ExpectStored(Id(2), 100);
  ExpectStored(Id(4), 2 * kMiB);
}

TEST_F(SsdTierFaultTest, FailedPutEvictsNothing) {
  options_.capacity_bytes = 3 * kMiB;
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  PutOk(Id(3), kMiB);
  fs_->SetNoSpace(true);
  // The tier is at capacity, so this put would evict 1 to make room; it fails, and
  // 1 must still be there.
  EXPECT_EQ(Put(Id(4), Payload(Id(4), kMiB)).code(), absl::StatusCode::kResourceExhausted);
  fs_->SetNoSpace(false);
  EXPECT_EQ(tier_->GetStats().evictions, 0u);
  EXPECT_EQ(tier_->GetStats().chunks, 3u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 3 * kMiB);
  ExpectStored(Id(1), kMiB);
  ExpectStored(Id(2), kMiB);
  ExpectStored(Id(3), kMiB);
  // And the index still matches RocksDB once writes work again.
  ASSERT_TRUE(PutOnceRecovered(Id(4), Payload(Id(4), kMiB), 1).ok());
  EXPECT_EQ(tier_->GetStats().evictions, 1u);
  EXPECT_EQ(tier_->GetStats().chunks, 3u);
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 3u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 3 * kMiB);
}

TEST_F(SsdTierFaultTest, CorruptReadIsDataLossAndDeletesTheChunk) {
  PutOk(Id(1), 2 * kMiB, 3);
  PutOk(Id(2), kMiB);
  ASSERT_TRUE(tier_->Flush().ok());  // Payloads now live in blob files.

  fs_->SetCorruptReads(true);
  auto bad = tier_->Get(Id(1));
  fs_->SetCorruptReads(false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_GT(fs_->corrupted_reads(), 0u) << "the fault never fired";
  EXPECT_TRUE(absl::StrContains(bad.status().message(), Id(1).key.ToHex())) << bad.status();
  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.checksum_failures, 1u);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(s.chunks, 1u);
  EXPECT_EQ(s.used_bytes, kMiB);
  // Gone for good, even though the bytes on disk were fine (the fault was in the read).
  EXPECT_EQ(tier_->Get(Id(1)).status().code(), absl::StatusCode::kNotFound);
  ExpectStored(Id(2), kMiB);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
}

TEST_F(SsdTierFaultTest, CorruptRangeReadIsDataLossAndDeletesTheChunk) {
  PutOk(Id(1), 6 * kMiB, 2);
  ASSERT_TRUE(tier_->Flush().ok());
  const ChunkMeta meta = MetaOf(Payload(Id(1), 6 * kMiB));
  std::string out(2 * kMiB, '\0');
  fs_->SetCorruptReads(true);
  absl::Status st = tier_->ReadRange(Id(1), meta, 3 * kMiB, out.size(), out.data());
  fs_->SetCorruptReads(false);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_GT(fs_->corrupted_reads(), 0u) << "the fault never fired";
  EXPECT_EQ(tier_->GetStats().checksum_failures, 1u);
  EXPECT_FALSE(tier_->Contains(Id(1)));
}

TEST_F(SsdTierFaultTest, NeverReturnsCorruptBytes) {
  constexpr int kChunks = 12;
  for (int i = 0; i < kChunks; ++i) PutOk(Id(i), 64 * 1024 + 4096 * i, 1 + i % 3);
  ASSERT_TRUE(tier_->Flush().ok());
  fs_->SetCorruptReads(true);
  for (int i = 0; i < kChunks; ++i) {
    auto c = tier_->Get(Id(i));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << "chunk " << i;
  }
  fs_->SetCorruptReads(false);
  EXPECT_GE(fs_->corrupted_reads(), static_cast<uint64_t>(kChunks));
  EXPECT_EQ(tier_->GetStats().checksum_failures, static_cast<uint64_t>(kChunks));
  EXPECT_EQ(tier_->GetStats().chunks, 0u);
  // The tier still works.
  PutOk(Id(100), kMiB);
  ASSERT_TRUE(tier_->Flush().ok());
  ExpectStored(Id(100), kMiB);
}

}  // namespace
}  // namespace kvtier
