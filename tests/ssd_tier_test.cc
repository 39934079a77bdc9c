// SsdTier on a real RocksDB in a temp dir: round trips of multi-part payloads, the index
// rebuilt at reopen, LRU capacity eviction, TTL on an injected clock, deletes, and the
// failures the tier must survive (a full disk, corrupt reads) through FaultInjectionFs.
#include "storage/ssd_tier.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "rocksdb/db.h"
#include "storage/crc32c.h"
#include "tests/support/fake_clock.h"
#include "storage/log.h"
#include "storage/ssd_row.h"
#include "tests/support/fault_injection_fs.h"
#include "tests/support/faulty_payload_ops.h"

namespace kvtier {
namespace {

using ::kvtier::testing::FakeClock;
using ::kvtier::testing::TempDir;

using ::kvtier::testing::FaultInjectionFs;
using ::kvtier::testing::FaultyPayloadOps;

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

  // Payload files of 1 MiB, written 256 KiB and checked 64 KiB at a time: a few chunks
  // fill one, so tests of files (their garbage, their deletion) stay small.
  void UseSmallFiles() {
    options_.file_bytes = kMiB;
    options_.io_bytes = 256 * 1024;
    options_.piece_bytes = 64 * 1024;
  }

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
    const absl::Status s = Put(id, data, parts);
    ASSERT_TRUE(s.ok()) << s;
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

// The start-up warning's advice: a capacity whose files fit the disk with their GC
// slack (x 17/16), the file being filled and the index's reserve. It once left out the
// first two: on a 200 MiB disk it advised 71 MiB, at which puts failed "disk full".
TEST(SsdTierOptionsTest, TheLargestCapacityForADiskLeavesRoomForGcAndTheReserve) {
  SsdTierOptions o;
  o.path = "/unused";
  o.write_buffer_bytes = 32 * kMiB;  // Reserve: 2 x 32 + 64 = 128 MiB.
  o.capacity_bytes = 1024 * kMiB;
  o.file_bytes = 8 * kMiB;
  ASSERT_EQ(o.MinFreeBytes(), 128 * kMiB);
  const uint64_t file = o.FileBytes();
  const uint64_t room = 200 * kMiB;
  const uint64_t fits = o.LargestCapacityFor(room);
  EXPECT_EQ(fits, (room - 128 * kMiB - file) / 17 * 16);
  EXPECT_GT(o.DiskBytesNeeded(), room);
  o.capacity_bytes = fits;
  EXPECT_LE(o.DiskBytesNeeded(), room) << "the advice fits, file size and all";
  o.capacity_bytes = fits + 2 * kMiB;
  EXPECT_GT(o.DiskBytesNeeded(), room);
  EXPECT_EQ(o.LargestCapacityFor(100 * kMiB), 0u);  // Not even the reserve fits.
}

TEST_F(SsdTierTest, PutGetRoundTripMultiPart) {
  const ChunkId big = Id(1), odd = Id(2), tiny = Id(3);
  const std::string big_data = Payload(big, 6 * kMiB);
  const std::string odd_data = Payload(odd, 3 * kMiB + 12345);
  const std::string tiny_data = Payload(tiny, 100);  // Shorter than one 4 KiB block.
  ASSERT_TRUE(Put(big, big_data, 7).ok());
  ASSERT_TRUE(Put(odd, odd_data, 3).ok());
  ASSERT_TRUE(Put(tiny, tiny_data, 1).ok());
  EXPECT_TRUE(tier_->Contains(big));
  EXPECT_FALSE(tier_->Contains(Id(4)));

  SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.chunks, 3u);
  EXPECT_EQ(s.payload_bytes, big_data.size() + odd_data.size() + tiny_data.size());
  // Capacity counts each chunk rounded up to 4 KiB, as it sits in its payload file.
  EXPECT_EQ(s.used_bytes, 6 * kMiB + (3 * kMiB + 16384) + 4096);
  EXPECT_EQ(s.capacity_bytes, 64 * kMiB);
  // Each payload byte is written once, into a payload file (padding to 4 KiB included).
  EXPECT_EQ(s.bytes_written, s.used_bytes);

  // Before and after a flush.
  ExpectStored(big, 6 * kMiB);
  ExpectStored(odd, 3 * kMiB + 12345);
  ExpectStored(tiny, 100);
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
    if (flushed) { ASSERT_TRUE(tier_->Flush().ok()); }
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
  EXPECT_EQ(s.payload_bytes, 4 * kMiB + 200);
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

// Stats (the Stats RPC) and GetStats (the metrics) agree: evictions are for room only,
// expirations are counted apart, in both.
TEST_F(SsdTierTest, StatsCountExpirationsApartFromEvictions) {
  options_.ttl = absl::Seconds(60);
  options_.capacity_bytes = 2 * kMiB;
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  PutOk(Id(3), kMiB);  // Evicts 1 for room.
  clock_.Advance(absl::Seconds(61));
  EXPECT_EQ(tier_->ExpireOld(), 2u);
  const SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.expirations, 2u);
  const TierStats t = tier_->Stats();
  EXPECT_EQ(t.evictions, s.evictions);
  EXPECT_EQ(t.expirations, s.expirations);
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

// The TTL sweep collects the expired chunks, then deletes them one by one. A put of one
// of them in between stores it afresh (the expired copy is replaced); the sweep once
// deleted that fresh copy too, acknowledged write-through bytes gone long before their
// TTL.
TEST_F(SsdTierTest, TheTtlSweepLeavesACopyStoredAfterItLooked) {
  options_.ttl = absl::Seconds(60);
  std::optional<ChunkId> refreshed;
  options_.on_evict = [&](const ChunkId& gone) {
    if (refreshed) return;
    refreshed = gone == Id(1) ? Id(2) : Id(1);  // Put again before the sweep gets to it.
    PutOk(*refreshed, kMiB);
  };
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  clock_.Advance(absl::Seconds(61));
  EXPECT_EQ(tier_->ExpireOld(), 1u);  // The other copy went as the put replaced it.
  ASSERT_TRUE(refreshed.has_value());
  EXPECT_TRUE(tier_->Contains(*refreshed)) << "the fresh copy was swept";
  EXPECT_EQ(tier_->GetStats().expirations, 2u);  // Once each, not 3.
  ExpectStored(*refreshed, kMiB);
  Open();
  ExpectStored(*refreshed, kMiB);
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

uint64_t DirBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

std::vector<std::string> PayloadFiles(const std::string& db) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(db + "/payload")) {
    if (e.path().extension() == ".kvp") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(SsdTierTest, PayloadsAreWrittenOnceAndNotIntoRocksDb) {
  for (uint64_t i = 0; i < 8; ++i) PutOk(Id(i), 4 * kMiB, 3);
  ASSERT_TRUE(tier_->Flush().ok());
  const uint64_t payload_dir = DirBytes(options_.path + "/payload");
  const uint64_t all = DirBytes(options_.path);
  EXPECT_EQ(payload_dir, 32 * kMiB);
  EXPECT_EQ(tier_->GetStats().bytes_written, 32 * kMiB);
  // RocksDB holds only the rows (and its own small files): far below one chunk.
  EXPECT_LT(all - payload_dir, kMiB) << "payload bytes went into RocksDB";
}

// Churn ten times the capacity through the tier with chunks of mixed sizes, deleting
// some and re-reading others (so LRU order and file order differ): the payload files
// never hold more than capacity * 17/16 plus one file being filled, and every chunk the
// index holds reads back exactly, before and after a reopen.
TEST_F(SsdTierTest, DiskSpaceStaysBoundedUnderChurn) {
  options_.capacity_bytes = 16 * kMiB;
  UseSmallFiles();
  Open();
  const uint64_t bound = options_.capacity_bytes + options_.capacity_bytes / 16 + options_.file_bytes;
  uint64_t written = 0, max_disk = 0;
  std::vector<std::pair<ChunkId, uint64_t>> live;
  uint64_t x = 12345;
  for (uint64_t i = 0; written < 10 * options_.capacity_bytes; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const uint64_t size = 64 * 1024 * (1 + x % 12) + (x % 3 == 0 ? 777 : 0);
    PutOk(Id(i), size, 1 + i % 3);
    written += size;
    live.emplace_back(Id(i), size);
    if (x % 5 == 0 && live.size() > 4) {  // Delete one from the middle.
      const size_t k = x % live.size();
      ASSERT_TRUE(tier_->Delete(live[k].first).ok());
      live.erase(live.begin() + static_cast<long>(k));
    }
    if (x % 7 == 0 && live.size() > 8) {  // Re-read an older one: it becomes recent.
      const auto& [id, sz] = live[x % (live.size() / 2)];
      if (tier_->Contains(id)) ExpectStored(id, sz);
    }
    const uint64_t disk = DirBytes(options_.path + "/payload");
    max_disk = std::max(max_disk, disk);
    ASSERT_LE(disk, bound) << "after " << written << " bytes";
    ASSERT_EQ(disk, tier_->GetStats().disk_bytes);
  }
  const SsdTierStats s = tier_->GetStats();
  EXPECT_GT(s.gc_files, 0u) << "churn never needed a garbage collection";
  EXPECT_LE(s.used_bytes, options_.capacity_bytes);
  // GC moves some bytes, but most dead space comes free with whole files.
  EXPECT_LT(s.bytes_written, 2 * written);
  uint64_t held = 0;
  for (const auto& [id, size] : live) {
    if (!tier_->Contains(id)) continue;
    ExpectStored(id, size);
    ++held;
  }
  EXPECT_EQ(held, s.chunks);
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, held);
  for (const auto& [id, size] : live) {
    if (tier_->Contains(id)) ExpectStored(id, size);
  }
  EXPECT_LE(DirBytes(options_.path + "/payload"), bound);
}

TEST_F(SsdTierTest, CorruptPayloadFileIsDataLossForItsChunkOnly) {
  PutOk(Id(1), 2 * kMiB, 2);
  PutOk(Id(2), 2 * kMiB);
  ASSERT_TRUE(tier_->Flush().ok());
  auto files = PayloadFiles(options_.path);
  ASSERT_EQ(files.size(), 1u);
  {
    // Chunk 1 is first in the file: flip a byte 1 MiB + 5 into it.
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(kMiB + 5));
    f.put('\x7f');
  }
  const ChunkMeta meta = MetaOf(Payload(Id(1), 2 * kMiB));
  std::string out(256 * 1024, '\0');
  // A streamed range clear of the bad piece still reads; the whole chunk does not.
  ASSERT_TRUE(tier_->ReadRange(Id(1), meta, 0, out.size(), out.data()).ok());
  EXPECT_EQ(tier_->Get(Id(1)).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(tier_->GetStats().checksum_failures, 1u);
  ExpectStored(Id(2), 2 * kMiB);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), 2 * kMiB);
}

TEST_F(SsdTierTest, CorruptIndexRowIsDroppedAtStartUp) {
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  tier_.reset();
  {
    // Rewrite chunk 1's row with one bit flipped, through RocksDB itself (so its own
    // block checksums are fine and only the row's CRC can tell).
    rocksdb::DBOptions o;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}, {"layouts", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    rocksdb::DB* raw;
    ASSERT_TRUE(rocksdb::DB::Open(o, options_.path, cfs, &h, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::string row;
    ASSERT_TRUE(db->Get({}, h[1], SsdRowKey(Id(1)), &row).ok());
    SsdRow decoded;
    ASSERT_TRUE(DecodeSsdRow(row, &decoded));
    row[14] ^= 0x10;  // In the token count.
    EXPECT_FALSE(DecodeSsdRow(row, &decoded));
    ASSERT_TRUE(db->Put({}, h[1], SsdRowKey(Id(1)), row).ok());
    for (auto* x : h) ASSERT_TRUE(db->DestroyColumnFamilyHandle(x).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
  EXPECT_EQ(tier_->GetStats().chunks, 1u);
}

// A flipped byte in one of RocksDB's own tables fails its block checksum before any row
// can be read: the tier once refused to start at all, every time (a systemd restart
// loop until someone wiped data_dir). It now repairs the index and starts with the rows
// it can read; chunks whose rows were lost are gone, none is served wrong.
TEST_F(SsdTierTest, ACorruptIndexTableIsRepairedAtStartUp) {
  constexpr int kChunks = 40;
  for (int i = 0; i < kChunks; ++i) PutOk(Id(i), 64 << 10);
  ASSERT_TRUE(tier_->Flush().ok());  // Rows into tables, out of the WAL.
  tier_.reset();
  int corrupted = 0;
  for (const auto& e : std::filesystem::directory_iterator(options_.path)) {
    if (e.path().extension() != ".sst") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(20);
    char c = 0;
    f.get(c);
    f.seekp(20);
    f.put(static_cast<char>(c ^ 0x40));  // In the first data block.
    ++corrupted;
  }
  ASSERT_GT(corrupted, 0);
  Open();
  int kept = 0;
  for (int i = 0; i < kChunks; ++i) {
    auto c = tier_->Get(Id(i));
    if (c.ok()) {
      ExpectStored(Id(i), 64 << 10);
      ++kept;
    } else {
      EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound) << i << ": " << c.status();
    }
  }
  EXPECT_EQ(tier_->GetStats().chunks, static_cast<uint64_t>(kept));
  EXPECT_EQ(tier_->GetStats().index_repairs, 1u);
  // The dropped chunks' payload is reclaimed like any other no row names.
  EXPECT_LE(tier_->GetStats().disk_bytes, static_cast<uint64_t>(kept) * (64 << 10))
      << kept << " kept";
  EXPECT_TRUE(std::filesystem::exists(options_.path + "/lost"));
  PutOk(Id(100), 64 << 10);
  Open();  // The repaired index opens as any other.
  ExpectStored(Id(100), 64 << 10);
  EXPECT_EQ(tier_->GetStats().index_repairs, 0u);
}

TEST_F(SsdTierTest, PayloadFileDeletedBehindTheDaemonsBack) {
  options_.file_bytes = 4 * kMiB;
  Open();
  PutOk(Id(1), 4 * kMiB);
  PutOk(Id(2), 4 * kMiB);  // In a second file.
  auto files = PayloadFiles(options_.path);
  ASSERT_EQ(files.size(), 2u);
  ASSERT_EQ(::unlink(files[0].c_str()), 0);
  // While running, the open descriptor still holds the bytes: served intact.
  ExpectStored(Id(1), 4 * kMiB);
  // At restart the chunk whose file is gone is dropped; the other is served.
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(tier_->Get(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier_->GetStats().lost_at_start, 1u);
  ExpectStored(Id(2), 4 * kMiB);
  // Truncated behind its back: the chunk past the new end is dropped too.
  tier_.reset();
  files = PayloadFiles(options_.path);
  ASSERT_EQ(files.size(), 1u);
  ASSERT_EQ(::truncate(files[0].c_str(), kMiB), 0);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(2)));
  EXPECT_TRUE(PayloadFiles(options_.path).empty()) << "a file holding nothing is deleted";
  PutOk(Id(3), kMiB);
  ExpectStored(Id(3), kMiB);
  // The whole directory removed: the next file is made in a new one, and puts go on.
  std::filesystem::remove_all(options_.path + "/payload");
  PutOk(Id(4), 4 * kMiB);
  PutOk(Id(5), 4 * kMiB);
  ExpectStored(Id(5), 4 * kMiB);
  ExpectStored(Id(3), kMiB);  // From its open descriptor.
  Open();
  EXPECT_FALSE(tier_->Contains(Id(3)));
  ExpectStored(Id(5), 4 * kMiB);
}

// A copy a caller found corrupt (a streamed frame's checksum) is deleted, counted as a
// checksum failure, and stays gone across a reopen; the other chunks are untouched.
TEST_F(SsdTierTest, DropCorruptDeletesCountsAndForgetsTheCopy) {
  std::vector<ChunkId> corrupt;
  options_.on_corrupt = [&corrupt](const ChunkId& id) { corrupt.push_back(id); };
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  const ChunkMeta meta = MetaOf(Payload(Id(1), kMiB));
  EXPECT_EQ(tier_->DropCorrupt(Id(1), meta).code(), absl::StatusCode::kDataLoss);
  // A second reader's verdict on the same copy: DataLoss again, but no second drop.
  EXPECT_EQ(tier_->DropCorrupt(Id(1), meta).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(corrupt, std::vector<ChunkId>{Id(1)});
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(tier_->GetStats().checksum_failures, 1u);
  ExpectStored(Id(2), kMiB);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
}

// A streamed reader holds the meta of the copy it started on. Once a put has stored the
// chunk afresh with other bytes, its next frame is refused (Aborted: read it again)
// rather than served from the new copy, and its verdict that its bytes were corrupt
// drops nothing: the new copy is good. Both once took the new copy: frames of two
// copies went out as one chunk, and the whole-chunk CRC32C mismatch that followed
// deleted the good one.
TEST_F(SsdTierTest, AReaderOfACopyStoredAfreshNeitherMixesNorDropsTheNewOne) {
  std::vector<ChunkId> corrupt;
  options_.on_corrupt = [&corrupt](const ChunkId& id) { corrupt.push_back(id); };
  Open();
  const std::string old_bytes = Payload(Id(1), kMiB);
  ASSERT_TRUE(Put(Id(1), old_bytes).ok());
  const ChunkMeta old_meta = MetaOf(old_bytes);
  std::string out(64 << 10, '\0');
  ASSERT_TRUE(tier_->ReadRange(Id(1), old_meta, 0, out.size(), out.data()).ok());
  std::string new_bytes = Payload(Id(2), kMiB);
  ASSERT_TRUE(tier_->Delete(Id(1)).ok());
  ASSERT_TRUE(Put(Id(1), new_bytes).ok());
  const absl::Status next =
      tier_->ReadRange(Id(1), old_meta, out.size(), out.size(), out.data());
  EXPECT_EQ(next.code(), absl::StatusCode::kAborted) << next;
  const absl::Status verdict = tier_->DropCorrupt(Id(1), old_meta);
  EXPECT_EQ(verdict.code(), absl::StatusCode::kAborted) << verdict;
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ(tier_->GetStats().checksum_failures, 0u);
  auto c = tier_->Get(Id(1));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->data == new_bytes);
}

// A chunk leaves the index before its row is deleted. A put of the same chunk in that
// gap once went ahead: its row landed first, the deletion after it, and the chunk was
// acknowledged and served until a restart lost it. The put now waits for the row to go.
// RaceAPutAgainstTheRowDeletion starts that put from inside the gap (the
// before_row_delete sync point) and holds the deletion until the put has either stored
// its chunk or is waiting.
class SsdTierRowRaceTest : public SsdTierTest {
 protected:
  void RaceAPutAgainstTheRowDeletion(const ChunkId& id, absl::string_view fresh) {
    options_.before_row_delete = [this, id, fresh](const ChunkId& deleting) {
      if (deleting != id || putter_.joinable()) return;
      putter_ = std::thread([this, id, fresh] {
        const absl::Status s = Put(id, fresh);
        EXPECT_TRUE(s.ok()) << s;
        absl::MutexLock lock(&mu_);
        put_done_ = true;
      });
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](SsdTierRowRaceTest* t) { return t->put_done_ || t->put_waits_; }, this));
    };
    options_.put_waits_for_row_delete = [this](const ChunkId&) {
      absl::MutexLock lock(&mu_);
      put_waits_ = true;
    };
  }

  // After the race: the put's bytes are what the tier serves, before and after a restart.
  void ExpectThePutSurvives(const ChunkId& id, absl::string_view fresh) {
    ASSERT_TRUE(putter_.joinable()) << "the sync point never ran";
    putter_.join();
    for (int pass = 0; pass < 2; ++pass) {
      auto c = tier_->Get(id);
      ASSERT_TRUE(c.ok()) << (pass == 0 ? "before" : "after") << " a restart: " << c.status();
      EXPECT_TRUE(c->data == fresh);
      options_.before_row_delete = nullptr;
      Open();
    }
  }

  absl::Mutex mu_;
  bool put_done_ ABSL_GUARDED_BY(mu_) = false;
  bool put_waits_ ABSL_GUARDED_BY(mu_) = false;
  std::thread putter_;
};

TEST_F(SsdTierRowRaceTest, APutOfAChunkBeingDeletedKeepsItsRow) {
  const std::string fresh = Payload(Id(9), kMiB);  // Other bytes than Id(1)'s.
  RaceAPutAgainstTheRowDeletion(Id(1), fresh);
  Open();
  PutOk(Id(1), kMiB);
  absl::StatusOr<bool> gone = tier_->Delete(Id(1));
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_TRUE(*gone);
  ExpectThePutSurvives(Id(1), fresh);
}

TEST_F(SsdTierRowRaceTest, APutOfAChunkBeingEvictedKeepsItsRow) {
  options_.capacity_bytes = 2 * kMiB;
  const std::string fresh = Payload(Id(9), kMiB);
  RaceAPutAgainstTheRowDeletion(Id(1), fresh);
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  PutOk(Id(3), kMiB);  // Evicts Id(1), whose put again races the eviction.
  ExpectThePutSurvives(Id(1), fresh);
}

TEST_F(SsdTierTest, BytesOfAPutCutOffBeforeItsRowAreReclaimed) {
  options_.file_bytes = 2 * kMiB;
  options_.io_bytes = kMiB;
  Open();
  PutOk(Id(1), 2 * kMiB);
  tier_.reset();
  // What a crash between the payload write and the row leaves: a payload file no row
  // points into (and a stray file from an interrupted probe).
  const std::string orphan = options_.path + "/payload/" + PayloadLog::FileName(77);
  std::ofstream(orphan) << std::string(8192, 'x');
  std::ofstream(options_.path + "/payload/.direct-probe") << "x";
  Open();
  EXPECT_FALSE(std::filesystem::exists(orphan));
  EXPECT_FALSE(std::filesystem::exists(options_.path + "/payload/.direct-probe"));
  ExpectStored(Id(1), 2 * kMiB);
  EXPECT_EQ(tier_->GetStats().disk_bytes, 2 * kMiB);
}

TEST_F(SsdTierTest, AVersionOneDatabaseOpensWithItsChunksDroppedAndLayoutsKept) {
  tier_.reset();
  std::filesystem::remove_all(options_.path);
  {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.create_missing_column_families = true;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}, {"data", {}},
        {"layouts", {}}, {"pending", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    rocksdb::DB* raw;
    ASSERT_TRUE(rocksdb::DB::Open(o, options_.path, cfs, &h, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    // A version-1 meta row (32 bytes ending in version 1) and its one segment.
    std::string v1(32, '\0');
    v1[0] = 16;
    v1[28] = 1;
    ASSERT_TRUE(db->Put({}, h[1], SsdRowKey(Id(1)), v1).ok());
    ASSERT_TRUE(db->Put({}, h[2], SsdRowKey(Id(1)) + std::string(4, '\0'), std::string(16, 'a')).ok());
    ASSERT_TRUE(db->Put({}, h[3], std::string(8, '\x01'), "a layout").ok());
    for (auto* x : h) ASSERT_TRUE(db->DestroyColumnFamilyHandle(x).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  Open();
  EXPECT_EQ(tier_->GetStats().chunks, 0u);
  auto layouts = tier_->LoadLayouts();
  ASSERT_TRUE(layouts.ok());
  ASSERT_EQ(layouts->size(), 1u);
  EXPECT_EQ((*layouts)[0].second, "a layout");
  PutOk(Id(2), kMiB);
  Open();  // The old families are gone for good.
  ExpectStored(Id(2), kMiB);
  std::vector<std::string> families;
  tier_.reset();
  ASSERT_TRUE(rocksdb::DB::ListColumnFamilies({}, options_.path, &families).ok());
  EXPECT_EQ(std::count(families.begin(), families.end(), "data"), 0);
  EXPECT_EQ(std::count(families.begin(), families.end(), "pending"), 0);
}

TEST(SsdRowTest, RoundTripsAndRejectsDamage) {
  SsdRow row;
  row.meta = ChunkMeta{5 * 65536 + 3, 0xdeadbeef, 256, 0};
  row.written_at = absl::FromUnixMicros(1234567);
  row.extent = PayloadExtent{7, 8192, row.meta.size};
  row.piece_bytes = 65536;
  row.piece_crcs = {1, 2, 3, 4, 5, 6};
  row.meta.lineage = ChunkLineage{41, true, ChunkKey{7, 9}};
  const std::string enc = EncodeSsdRow(row);
  SsdRow back;
  ASSERT_TRUE(DecodeSsdRow(enc, &back));
  EXPECT_EQ(back.meta, row.meta);
  EXPECT_EQ(back.meta.lineage, row.meta.lineage);
  EXPECT_EQ(back.written_at, row.written_at);
  EXPECT_EQ(back.extent, row.extent);
  EXPECT_EQ(back.piece_crcs, row.piece_crcs);
  for (size_t i = 0; i < enc.size(); ++i) {
    std::string bad = enc;
    bad[i] ^= 0x04;
    EXPECT_FALSE(DecodeSsdRow(bad, &back)) << "flipped byte " << i;
  }
  EXPECT_FALSE(DecodeSsdRow(enc.substr(0, enc.size() - 1), &back));
  SsdRow wrong = row;
  wrong.piece_crcs.pop_back();  // Too few checksums for the size.
  EXPECT_FALSE(DecodeSsdRow(EncodeSsdRow(wrong), &back));
}

TEST(SsdRowTest, AVersionTwoRowDecodesWithAnUnknownLineage) {
  SsdRow row;
  row.meta = ChunkMeta{65536, 0xfeed, 16, 0};
  row.meta.lineage = ChunkLineage{3, true, ChunkKey{1, 2}};
  row.extent = PayloadExtent{1, 0, row.meta.size};
  row.piece_bytes = 65536;
  row.piece_crcs = {42};
  // Version 2 is version 3 without the 21 lineage bytes before the trailing CRC.
  std::string v2 = EncodeSsdRow(row);
  v2.resize(v2.size() - 4 - 21);
  v2[0] = 2;
  const uint32_t crc = crc32c::Value(v2);
  for (int i = 0; i < 4; ++i) v2.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
  SsdRow back;
  back.meta.lineage = ChunkLineage{9, true, ChunkKey{5, 5}};  // Overwritten by Decode.
  ASSERT_TRUE(DecodeSsdRow(v2, &back));
  EXPECT_EQ(back.meta, row.meta);
  EXPECT_EQ(back.meta.lineage, ChunkLineage{});
  EXPECT_EQ(back.piece_crcs, row.piece_crcs);
  // A version-3 row's has_parent byte must be 0 or 1, even with a matching CRC.
  std::string v3 = EncodeSsdRow(row);
  v3.resize(v3.size() - 4);
  v3[v3.size() - 17] = 2;
  const uint32_t crc3 = crc32c::Value(v3);
  for (int i = 0; i < 4; ++i) v3.push_back(static_cast<char>((crc3 >> (8 * i)) & 0xff));
  EXPECT_FALSE(DecodeSsdRow(v3, &back));
}

// ---------------------------------------------------------------------------------
// Faults.

class SsdTierFaultTest : public SsdTierTest {
 protected:
  void SetUp() override {
    fs_ = std::make_shared<FaultInjectionFs>(/*seed=*/42);
    ops_ = std::make_shared<FaultyPayloadOps>();
    options_.file_system = fs_;
    options_.file_ops = ops_;
    SsdTierTest::SetUp();
  }
  // The whole disk: payload files and RocksDB alike.
  void SetNoSpace(bool on) {
    fs_->SetNoSpace(on);
    ops_->SetNoSpace(on);
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
  std::shared_ptr<FaultyPayloadOps> ops_;
};

// A file system smaller than ssd_capacity (a capacity set too large, or someone else's
// files). Once every put past its room failed "disk full", for good: nothing evicted,
// because the tier was not full. Now the tier keeps to what the disk holds, evicting
// the least recently used, and goes back to its capacity once the disk has room.
TEST_F(SsdTierFaultTest, AFullFileSystemHoldsTheTierToWhatFits) {
  UseSmallFiles();
  options_.capacity_bytes = 64 * kMiB;
  options_.min_free_bytes = kMiB;
  ops_->SetDiskOf(options_.path, 12 * kMiB);  // The index's files count too.
  Open();
  constexpr uint64_t kChunk = 256 * 1024;
  constexpr int kChunks = 64;  // 16 MiB through a 12 MiB disk.
  for (int i = 1; i <= kChunks; ++i) PutOk(Id(i), kChunk);
  SsdTierStats s = tier_->GetStats();
  EXPECT_LT(s.limit_bytes, 12 * kMiB);
  EXPECT_EQ(s.capacity_bytes, 64 * kMiB);
  EXPECT_GT(s.evictions, 0u);
  EXPECT_LE(s.used_bytes, s.limit_bytes);
  EXPECT_LE(s.disk_bytes, 11 * kMiB) << "the payload files ate into the index's reserve";
  EXPECT_FALSE(tier_->Contains(Id(1))) << "the least recently used chunk was kept";
  // It keeps what fits, less a file's worth at most, rather than emptying itself.
  EXPECT_GE(s.used_bytes + kMiB + kChunk, s.limit_bytes);
  for (int i = kChunks - 7; i <= kChunks; ++i) ExpectStored(Id(i), kChunk);

  // A chunk the disk cannot hold even with the tier emptied fails, and evicts nothing.
  const uint64_t held = s.chunks;
  const std::string big = Payload(Id(100), 16 * kMiB);
  const absl::Status refused = Put(Id(100), big);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "disk full")) << refused;
  EXPECT_FALSE(tier_->Contains(Id(100)));
  EXPECT_EQ(tier_->GetStats().chunks, held);

  // Room again: the next put finds it and the tier keeps to its capacity once more.
  ops_->SetDiskOf(options_.path, 1024 * kMiB);
  PutOk(Id(kChunks + 1), kChunk);
  s = tier_->GetStats();
  EXPECT_EQ(s.limit_bytes, 64 * kMiB);
  EXPECT_EQ(s.chunks, held + 1);
}

// A full disk whose least recently used chunks lie in every payload file (each file
// holds one chunk read since): evicting in the policy's order frees no file until it
// has evicted nearly everything, and garbage collection needs the room that is
// missing. A put once emptied the tier that way, a chunk at a time. It now evicts the
// file with the fewest live bytes, and the tier keeps the rest of what fits.
TEST_F(SsdTierFaultTest, AFullDiskCostsAPutAFilesWorthNotTheTier) {
  UseSmallFiles();  // Four 256 KiB chunks a file.
  options_.capacity_bytes = 64 * kMiB;
  options_.min_free_bytes = kMiB;
  Open();
  constexpr uint64_t kChunk = 256 * 1024;
  for (int i = 1; i <= 32; ++i) PutOk(Id(i), kChunk);
  for (int i = 1; i <= 32; i += 4) ExpectStored(Id(i), kChunk);  // One read per file.
  // A disk with just less room than the next put needs: full, at what the tier holds.
  uint64_t used = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(options_.path)) {
    if (e.is_regular_file()) used += e.file_size();
  }
  ops_->SetDiskOf(options_.path, used + options_.min_free_bytes + kChunk / 2);
  PutOk(Id(33), kChunk);
  const SsdTierStats s = tier_->GetStats();
  EXPECT_LT(s.limit_bytes, 64 * kMiB);
  EXPECT_GE(s.used_bytes + kMiB + kChunk, s.limit_bytes)
      << "evicted " << s.evictions << " chunks for one";
  EXPECT_GE(s.chunks, 20u) << "evicted " << s.evictions << " chunks for one";
  ExpectStored(Id(33), kChunk);
}

// A disk with less room than two payload files: the file being filled is the only one,
// and on a full disk it is sealed and its chunks evicted so that it goes. Once such a
// disk left the tier no room at all (its limit 0), and every put failed.
TEST_F(SsdTierFaultTest, ADiskSmallerThanTwoPayloadFilesStillCaches) {
  options_.capacity_bytes = 64 * kMiB;
  options_.file_bytes = 8 * kMiB;
  options_.io_bytes = 256 * 1024;
  options_.piece_bytes = 64 * 1024;
  options_.min_free_bytes = kMiB;
  ops_->SetDiskOf(options_.path, 6 * kMiB);
  Open();
  constexpr uint64_t kChunk = 256 * 1024;
  for (int i = 1; i <= 64; ++i) PutOk(Id(i), kChunk);  // 16 MiB through a 6 MiB disk.
  const SsdTierStats s = tier_->GetStats();
  EXPECT_GT(s.chunks, 0u);
  EXPECT_LE(s.disk_bytes, 5 * kMiB);
  ExpectStored(Id(64), kChunk);
}

// A put that replaces an expired copy (not swept yet) and then fails stores nothing:
// the expired copy, whose row still points at its bytes, goes back for the sweep. It
// once left the index with its bytes counted live for ever, so its payload file could
// never be deleted or collected.
TEST_F(SsdTierFaultTest, AFailedPutOverAnExpiredCopyLeavesItToTheSweep) {
  options_.ttl = absl::Seconds(60);
  UseSmallFiles();
  Open();
  for (uint64_t i = 1; i <= 4; ++i) PutOk(Id(i), kMiB / 4);  // Fills the first file.
  clock_.Advance(absl::Seconds(61));
  ops_->SetNoSpace(true);  // The payload files only: RocksDB still writes.
  EXPECT_EQ(Put(Id(1), Payload(Id(1), kMiB / 4)).code(), absl::StatusCode::kResourceExhausted);
  ops_->SetNoSpace(false);
  EXPECT_FALSE(tier_->Contains(Id(1)));  // Expired: hidden.
  EXPECT_EQ(tier_->ExpireOld(), 4u) << "the expired copy the failed put took was lost";
  const SsdTierStats s = tier_->GetStats();
  EXPECT_EQ(s.chunks, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_LT(s.disk_bytes, kMiB) << "a payload file of dead chunks was kept";
}

// An eviction takes a chunk out of the index, then fails to delete its row (a full
// disk) and puts it back. A client's delete of the chunk in between once found it gone
// and answered "done", and the chunk was served again, and after a restart too. The
// delete now waits for the eviction's outcome: here it runs after the eviction failed,
// with the disk still full, fails too and says so. Either way a delete answered OK
// leaves no chunk.
class SsdTierDeleteRaceTest : public SsdTierFaultTest,
                              public ::testing::WithParamInterface<bool> {
 protected:
  // Delete(Id(1)), or (the parameter) a Clear of its namespace.
  absl::StatusOr<bool> DeleteIt() {
    if (!GetParam()) return tier_->Delete(Id(1));
    absl::StatusOr<uint64_t> n = tier_->DeleteNamespace(Id(1).ns, nullptr);
    if (!n.ok()) return n.status();
    return *n > 0;
  }
};

TEST_P(SsdTierDeleteRaceTest, ADeleteDuringAFailedEvictionIsNotUndone) {
  options_.capacity_bytes = 2 * kMiB;
  absl::Mutex mu;
  bool waiting = false, done = false;
  absl::StatusOr<bool> deleted = absl::UnknownError("never ran");
  std::thread deleter;
  options_.before_row_delete = [&](const ChunkId& id) {
    if (id != Id(1) || deleter.joinable()) return;
    fs_->SetNoSpace(true);  // The eviction's row deletion fails.
    deleter = std::thread([&] {
      absl::StatusOr<bool> r = DeleteIt();
      absl::MutexLock lock(&mu);
      deleted = std::move(r);
      done = true;
    });
    absl::MutexLock lock(&mu);
    struct Flags {
      bool* waiting;
      bool* done;
    } flags{&waiting, &done};
    mu.Await(absl::Condition(+[](Flags* f) { return *f->waiting || *f->done; }, &flags));
  };
  options_.delete_waits_for_row_delete = [&](const ChunkId&) {
    absl::MutexLock lock(&mu);
    waiting = true;
  };
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2, /*ns=*/0x2222), kMiB);  // Not in Id(1)'s namespace: a Clear finds none.
  EXPECT_EQ(Put(Id(3), Payload(Id(3), kMiB)).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(deleter.joinable()) << "the eviction never reached its row deletion";
  deleter.join();
  EXPECT_TRUE(!deleted.ok() || !tier_->Contains(Id(1)))
      << "a delete answered " << *deleted << " and the chunk is still served";
  EXPECT_FALSE(deleted.ok());
  EXPECT_TRUE(tier_->Contains(Id(1)));  // Its row is there: so is it.
  // Room again, and a restart: the chunk is still there, and a delete now deletes it.
  options_.before_row_delete = nullptr;
  fs_->SetNoSpace(false);
  Open();
  EXPECT_TRUE(tier_->Contains(Id(1)));
  absl::StatusOr<bool> again = DeleteIt();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
}

INSTANTIATE_TEST_SUITE_P(DeleteOrClear, SsdTierDeleteRaceTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Clear" : "Delete"; });

// A corrupt copy whose row cannot be deleted (a full disk) stays hidden: it was once put
// back in the index as it was, served again (DATA_LOSS each time), and a put of the
// chunk, seeing it present, was acknowledged without storing anything. A put now
// replaces it, and the sweep deletes the row of one no put replaced.
TEST_F(SsdTierFaultTest, ACorruptCopyWhoseRowCannotBeDeletedStaysHiddenUntilReplaced) {
  PutOk(Id(1), 2 * kMiB, 2);
  PutOk(Id(2), 2 * kMiB, 2);
  ASSERT_TRUE(tier_->Flush().ok());
  auto files = PayloadFiles(options_.path);
  ASSERT_EQ(files.size(), 1u);
  {
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    for (uint64_t at : {kMiB + 5, 3 * kMiB + 5}) {  // A byte in each chunk.
      f.seekp(static_cast<std::streamoff>(at));
      f.put('\x7f');
    }
  }
  SetNoSpace(true);
  for (uint64_t n : {1, 2}) {
    EXPECT_EQ(tier_->Get(Id(n)).status().code(), absl::StatusCode::kDataLoss) << n;
    EXPECT_FALSE(tier_->Contains(Id(n))) << n;
    EXPECT_EQ(tier_->Get(Id(n)).status().code(), absl::StatusCode::kNotFound) << n;
  }
  EXPECT_EQ(tier_->GetStats().checksum_failures, 2u);  // Once each, not per read.
  SetNoSpace(false);
  clock_.Advance(absl::Seconds(2));  // The index reopens (a second after its last try).
  const std::string good = Payload(Id(1), 2 * kMiB);
  ASSERT_TRUE(Put(Id(1), good, 2).ok());
  ExpectStored(Id(1), 2 * kMiB);
  EXPECT_EQ(tier_->ExpireOld(), 0u);  // Id(2)'s row goes; no expiration.
  EXPECT_EQ(tier_->GetStats().chunks, 1u);
  Open();
  ExpectStored(Id(1), 2 * kMiB);
  EXPECT_FALSE(tier_->Contains(Id(2))) << "the corrupt copy's row survived the sweep";
  EXPECT_EQ(tier_->GetStats().checksum_failures, 0u);
}

// An index write that fails on a full disk (a delete's, here, with the memtables just
// flushed) leaves RocksDB 7.8 with a broken WAL writer: once the disk had room again, the
// next write aborted the daemon (Debian's RocksDB keeps its assertions). The index is
// reopened instead, and every write after it lands.
TEST_F(SsdTierFaultTest, WritesGoOnAfterAFailedIndexWriteOnceTheDiskHasRoom) {
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  ASSERT_TRUE(tier_->Flush().ok());
  SetNoSpace(true);
  for (int attempt = 0; attempt < 2; ++attempt) {  // The second one tries to reopen.
    EXPECT_EQ(tier_->Delete(Id(1)).status().code(), absl::StatusCode::kResourceExhausted);
  }
  EXPECT_TRUE(tier_->Contains(Id(1)));
  SetNoSpace(false);
  clock_.Advance(absl::Seconds(2));
  auto deleted = tier_->Delete(Id(1));
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_TRUE(*deleted);
  PutOk(Id(3), kMiB);
  ExpectStored(Id(3), kMiB);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
  ExpectStored(Id(3), kMiB);
}

// A read of an expired chunk whose row cannot be deleted is NotFound, as any other
// expired chunk: it once answered the delete's ResourceExhausted, which the tiered store
// passed on (a retry) instead of trying the shared tier.
TEST_F(SsdTierFaultTest, AnExpiredChunkIsNotFoundEvenWhenItsRowCannotBeDeleted) {
  options_.ttl = absl::Seconds(60);
  Open();
  PutOk(Id(1), kMiB);
  ASSERT_TRUE(tier_->Flush().ok());
  clock_.Advance(absl::Seconds(61));
  SetNoSpace(true);
  EXPECT_EQ(tier_->ReadMeta(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier_->Get(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier_->GetStats().expirations, 0u);  // Not gone yet.
  SetNoSpace(false);
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(tier_->ExpireOld(), 1u);
  EXPECT_EQ(tier_->GetStats().expirations, 1u);
}

// A payload file whose deletion fails (EIO) once nothing in it is live is deleted by a
// later sweep: no release would try it again, so its space was lost until a restart,
// and garbage collection picked it (all garbage) hundreds of times per put.
TEST_F(SsdTierFaultTest, AFileThatCouldNotBeDeletedIsDeletedLater) {
  options_.capacity_bytes = 2 * kMiB;
  UseSmallFiles();
  Open();
  for (uint64_t i = 1; i <= 5; ++i) PutOk(Id(i), kMiB / 4);  // A first file, full.
  ASSERT_EQ(PayloadFiles(options_.path).size(), 2u);
  ops_->SetFailUnlink(true);
  for (uint64_t i = 1; i <= 4; ++i) ASSERT_TRUE(tier_->Delete(Id(i)).ok()) << i;
  EXPECT_EQ(PayloadFiles(options_.path).size(), 2u);  // Dead, not deleted.
  const uint64_t gc_before = tier_->GetStats().gc_files;
  for (uint64_t i = 10; i < 22; ++i) PutOk(Id(i), kMiB / 4);  // Churn past capacity.
  EXPECT_LT(tier_->GetStats().gc_files - gc_before, 24u) << "GC kept picking the dead file";
  // The bound: capacity x 17/16 and the file being filled. Every file emptied while
  // unlinks failed is still there.
  const uint64_t bound = options_.capacity_bytes * 17 / 16 + kMiB;
  EXPECT_GT(tier_->GetStats().disk_bytes, bound);
  ops_->SetFailUnlink(false);
  tier_->ExpireOld();  // The sweep.
  EXPECT_LE(tier_->GetStats().disk_bytes, bound);
  EXPECT_LE(PayloadFiles(options_.path).size(), 4u);
  for (uint64_t i = 18; i < 22; ++i) ExpectStored(Id(i), kMiB / 4);
}

TEST_F(SsdTierFaultTest, FullDiskIsResourceExhaustedAndRecovers) {
  PutOk(Id(1), 2 * kMiB, 2);
  PutOk(Id(2), 100);
  ASSERT_TRUE(tier_->Flush().ok());
  PutOk(Id(3), kMiB);  // Still in the WAL and memtable.

  SetNoSpace(true);
  const std::string data = Payload(Id(4), 2 * kMiB);
  const absl::Status full = Put(Id(4), data, 3);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_GT(ops_->no_space_errors(), 0u);
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
  SetNoSpace(false);
  ASSERT_TRUE(PutOnceRecovered(Id(4), data, 3).ok());
  ExpectStored(Id(4), 2 * kMiB);
  PutOk(Id(5), kMiB);
  Open();
  for (uint64_t i : {1, 3, 5}) ExpectStored(Id(i), i == 1 ? 2 * kMiB : kMiB);
  ExpectStored(Id(2), 100);
  ExpectStored(Id(4), 2 * kMiB);
}

// RocksDB writes no LOG file on the disk it shares with the payload (a LOG writer that
// hit a full disk aborted kvtierd on its next line); its errors reach the daemon's log.
TEST_F(SsdTierFaultTest, RocksDbLogsToTheDaemonsLogNotToAFile) {
  PutOk(Id(1), kMiB);
  ASSERT_TRUE(tier_->Flush().ok());
  for (const auto& e : std::filesystem::directory_iterator(options_.path)) {
    EXPECT_FALSE(absl::StartsWith(e.path().filename().string(), "LOG")) << e.path();
  }
  SetMinLogLevel(LogLevel::kWarning);
  ::testing::internal::CaptureStderr();
  fs_->SetNoSpace(true);
  EXPECT_EQ(Put(Id(2), Payload(Id(2), kMiB)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(tier_->Flush().ok());
  const std::string log = ::testing::internal::GetCapturedStderr();
  SetMinLogLevel(LogLevel::kError);
  EXPECT_NE(log.find("rocksdb: "), std::string::npos) << log;
  fs_->SetNoSpace(false);
}

TEST_F(SsdTierFaultTest, FailedPutEvictsNothing) {
  options_.capacity_bytes = 3 * kMiB;
  Open();
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  PutOk(Id(3), kMiB);
  SetNoSpace(true);
  // The tier is at capacity, so this put would evict 1 to make room; it fails, and
  // 1 must still be there.
  EXPECT_EQ(Put(Id(4), Payload(Id(4), kMiB)).code(), absl::StatusCode::kResourceExhausted);
  SetNoSpace(false);
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

// Chunks enter the eviction order in the order of their places in the payload files,
// whatever order their writes finish in (write-back writes several at once): so plain
// LRU churn empties the oldest file first and it goes whole, with nothing left for
// garbage collection to copy. Here 1 is placed first but written last; 1 is still the
// least recently used.
TEST_F(SsdTierFaultTest, EvictionOrderIsPayloadOrderWhateverOrderWritesFinish) {
  options_.capacity_bytes = 3 * kMiB;
  Open();
  absl::Notification first_writing, finish_first;
  ops_->BeforeNextWrite([&] {
    first_writing.Notify();
    finish_first.WaitForNotification();
  });
  std::thread first([&] { PutOk(Id(1), kMiB); });
  first_writing.WaitForNotification();  // 1 has its place; its write waits.
  PutOk(Id(2), kMiB);                   // Placed after 1, stored before it.
  finish_first.Notify();
  first.join();
  PutOk(Id(3), kMiB);
  PutOk(Id(4), kMiB);  // Full: evicts the least recently used.
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_TRUE(tier_->Contains(Id(2)));
  EXPECT_EQ(tier_->GetStats().evictions, 1u);
  // A put whose write fails after it took its place (having evicted 2 for room) leaves
  // the order as it was: 3, 4, then 6.
  ops_->SetNoSpace(true);
  EXPECT_FALSE(Put(Id(5), Payload(Id(5), kMiB)).ok());
  ops_->SetNoSpace(false);
  EXPECT_FALSE(tier_->Contains(Id(2)));
  EXPECT_FALSE(tier_->Contains(Id(5)));
  PutOk(Id(6), kMiB);
  PutOk(Id(7), kMiB);
  EXPECT_FALSE(tier_->Contains(Id(3)));
  EXPECT_TRUE(tier_->Contains(Id(4)));
  EXPECT_TRUE(tier_->Contains(Id(6)));
}

TEST_F(SsdTierFaultTest, CorruptReadIsDataLossAndDeletesTheChunk) {
  PutOk(Id(1), 2 * kMiB, 3);
  PutOk(Id(2), kMiB);

  ops_->SetCorruptReads(true);
  auto bad = tier_->Get(Id(1));
  ops_->SetCorruptReads(false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_GT(ops_->corrupted_reads(), 0u) << "the fault never fired";
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
  ops_->SetCorruptReads(true);
  absl::Status st = tier_->ReadRange(Id(1), meta, 3 * kMiB, out.size(), out.data());
  ops_->SetCorruptReads(false);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_GT(ops_->corrupted_reads(), 0u) << "the fault never fired";
  EXPECT_EQ(tier_->GetStats().checksum_failures, 1u);
  EXPECT_FALSE(tier_->Contains(Id(1)));
  // A streamed Get reads several frames of a chunk at once: the frames that look for it
  // after one found it corrupt get the same answer, DataLoss, not "deleted meanwhile"
  // (which a Get ends ABORTED, a retry), and it is counted once.
  st = tier_->ReadRange(Id(1), meta, 0, out.size(), out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_EQ(tier_->GetStats().checksum_failures, 1u);
  // Put afresh, it reads whole; deleted then, a reader is told it was deleted.
  PutOk(Id(1), 6 * kMiB, 2);
  ASSERT_TRUE(tier_->ReadRange(Id(1), meta, 0, out.size(), out.data()).ok());
  ASSERT_TRUE(tier_->Delete(Id(1)).ok());
  st = tier_->ReadRange(Id(1), meta, 0, out.size(), out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
}

TEST_F(SsdTierFaultTest, NeverReturnsCorruptBytes) {
  constexpr int kChunks = 12;
  for (int i = 0; i < kChunks; ++i) PutOk(Id(i), 64 * 1024 + 4096 * i, 1 + i % 3);
  ASSERT_TRUE(tier_->Flush().ok());
  ops_->SetCorruptReads(true);
  for (int i = 0; i < kChunks; ++i) {
    auto c = tier_->Get(Id(i));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << "chunk " << i;
  }
  ops_->SetCorruptReads(false);
  EXPECT_GE(ops_->corrupted_reads(), static_cast<uint64_t>(kChunks));
  EXPECT_EQ(tier_->GetStats().checksum_failures, static_cast<uint64_t>(kChunks));
  EXPECT_EQ(tier_->GetStats().chunks, 0u);
  // The tier still works.
  PutOk(Id(100), kMiB);
  ASSERT_TRUE(tier_->Flush().ok());
  ExpectStored(Id(100), kMiB);
}

// A delete whose row deletion fails (here: the disk is full) leaves the chunk stored,
// in the index as in RocksDB: a retried delete must find it, not report it gone while a
// restart would bring it back (and its bytes would never be freed).
TEST_F(SsdTierFaultTest, AFailedDeleteLeavesTheChunkStored) {
  PutOk(Id(1), kMiB);
  PutOk(Id(2), kMiB);
  const SsdTierStats before = tier_->GetStats();
  SetNoSpace(true);
  auto deleted = tier_->Delete(Id(1));
  EXPECT_FALSE(deleted.ok());
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kResourceExhausted) << deleted.status();
  auto cleared = tier_->DeleteNamespace(Id(2).ns);
  EXPECT_FALSE(cleared.ok());
  EXPECT_EQ(cleared.status().code(), absl::StatusCode::kResourceExhausted) << cleared.status();
  SetNoSpace(false);
  EXPECT_TRUE(tier_->Contains(Id(1)));
  EXPECT_TRUE(tier_->Contains(Id(2)));
  const SsdTierStats after = tier_->GetStats();
  EXPECT_EQ(after.chunks, before.chunks);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.payload_bytes, before.payload_bytes);
  ExpectStored(Id(1), kMiB);
  ExpectStored(Id(2), kMiB);
  // A restart finds the same; there, with writes working again, the delete goes through.
  Open();
  ExpectStored(Id(1), kMiB);
  auto again = tier_->Delete(Id(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  ExpectStored(Id(2), kMiB);
}

// A read that fails its check after the chunk was deleted and stored afresh elsewhere
// (here, from inside the read) deletes nothing: the bad bytes were the old copy's, and
// the read is made again from the new one.
TEST_F(SsdTierFaultTest, ABadReadOfAReplacedCopyDeletesNotTheNewOne) {
  const std::string data = Payload(Id(1), kMiB);
  ASSERT_TRUE(Put(Id(1), data).ok());
  ops_->CorruptNextRead([&] {
    auto deleted = tier_->Delete(Id(1));
    ASSERT_TRUE(deleted.ok() && *deleted);
    ASSERT_TRUE(Put(Id(1), data).ok());  // A new extent: the old file holds it no more.
  });
  auto got = tier_->Get(Id(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->data == data);
  EXPECT_EQ(ops_->corrupted_reads(), 1u) << "the fault never fired";
  EXPECT_TRUE(tier_->Contains(Id(1)));
  ExpectStored(Id(1), kMiB);
}

// A device that cannot read a chunk's bytes (EIO) gives DataLoss and drops the chunk,
// as a failed checksum does: UNAVAILABLE would have clients retry a read that fails
// every time, with the chunk still listed.
TEST_F(SsdTierFaultTest, AnUnreadableChunkIsDataLossAndDropped) {
  PutOk(Id(1), 2 * kMiB, 2);
  PutOk(Id(2), kMiB);
  ops_->SetReadError(EIO);
  auto bad = tier_->Get(Id(1));
  ops_->SetReadError(0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(tier_->GetStats().checksum_failures, 1u);
  ExpectStored(Id(2), kMiB);
  Open();
  EXPECT_FALSE(tier_->Contains(Id(1)));
}

// The SSD's piece checksums are of the bytes written; if those are not the bytes the
// chunk's CRC32C vouches for (a RAM copy that changed after its put was checked), the
// put stores nothing: pieces that check out would otherwise serve wrong bytes as sound.
TEST_F(SsdTierTest, BytesThatDoNotMatchTheChunksChecksumAreNotStored) {
  const std::string data = Payload(Id(1), 3 * kMiB + 100);
  ChunkMeta meta = MetaOf(data);
  meta.crc32c ^= 1;
  const auto parts = Parts(data, 3);
  const absl::Status s = tier_->Put(Id(1), meta, parts);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_FALSE(tier_->Contains(Id(1)));
  EXPECT_EQ(tier_->GetStats().used_bytes, 0u);
  EXPECT_EQ(tier_->GetStats().chunks, 0u);
  // The same bytes with their true checksum are stored.
  ASSERT_TRUE(tier_->Put(Id(1), MetaOf(data), parts).ok());
  ExpectStored(Id(1), 3 * kMiB + 100);
}

}  // namespace
}  // namespace kvtier
