// The shared tier's pure pieces: Redis Cluster's key-to-slot function, the commit
// record's encoding and the checks that reject a damaged one, and the degraded-mode
// backoff on an injected clock.
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "storage/redis/hash_slot.h"
#include "storage/redis/redis_connection.h"
#include "storage/remote_health.h"
#include "storage/remote_record.h"

namespace kvtier {
namespace {

TEST(RedisHashSlotTest, MatchesTheClusterSpecification) {
  // The specification's check value for CRC16/XMODEM, and slots redis-cli reports.
  EXPECT_EQ(RedisCrc16("123456789"), 0x31C3);
  EXPECT_EQ(RedisHashSlot("foo"), 12182);
  EXPECT_EQ(RedisHashSlot("bar"), 5061);
  EXPECT_EQ(RedisHashSlot(""), 0);
  // Hash tags: only the first {...} counts, and an empty one does not.
  EXPECT_EQ(RedisHashSlot("{user1000}.following"), RedisHashSlot("user1000"));
  EXPECT_EQ(RedisHashSlot("{user1000}.followers"), RedisHashSlot("{user1000}.following"));
  EXPECT_EQ(RedisHashSlot("foo{}{bar}"), RedisHashSlot("foo{}{bar}"));
  EXPECT_NE(RedisHashSlot("foo{}{bar}"), RedisHashSlot("bar"));
  EXPECT_EQ(RedisHashSlot("foo{{bar}}zap"), RedisHashSlot("{bar"));
  EXPECT_EQ(RedisHashSlot("foo{bar}{zap}"), RedisHashSlot("bar"));
}

TEST(RedisEndpointTest, ParsesHostAndPort) {
  auto e = RedisEndpoint::Parse("10.0.0.7:7001");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->host, "10.0.0.7");
  EXPECT_EQ(e->port, 7001);
  auto v6 = RedisEndpoint::Parse("[::1]:6379");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->ToString(), "[::1]:6379");
  for (const char* bad : {"", "host", ":6379", "host:", "host:0", "host:70000", "host:x"}) {
    EXPECT_EQ(RedisEndpoint::Parse(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

RemoteRecord SampleRecord() {
  RemoteRecord r;
  r.meta.size = 10000;
  r.meta.crc32c = 0xdeadbeef;
  r.meta.token_count = 16;
  r.meta.lineage.position = 3;
  r.meta.lineage.has_parent = true;
  r.meta.lineage.parent = ChunkKey{0x1122334455667788, 0x99aabbccddeeff00};
  r.layout_fingerprint = 0x0123456789abcdef;
  r.generation = 42;
  r.segment_bytes = 4096;
  r.segment_crc32c = {1, 2, 3};
  return r;
}

TEST(RemoteRecordTest, RoundTrips) {
  const RemoteRecord r = SampleRecord();
  auto back = DecodeRemoteRecord(EncodeRemoteRecord(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->meta, r.meta);
  EXPECT_EQ(back->meta.lineage, r.meta.lineage);
  EXPECT_EQ(back->layout_fingerprint, r.layout_fingerprint);
  EXPECT_EQ(back->generation, r.generation);
  EXPECT_EQ(back->segment_bytes, r.segment_bytes);
  EXPECT_EQ(back->segment_crc32c, r.segment_crc32c);
  EXPECT_EQ(back->SegmentSize(0), 4096u);
  EXPECT_EQ(back->SegmentSize(2), 10000u - 8192u);
}

TEST(RemoteRecordTest, EveryDamagedByteIsRejected) {
  const std::string good = EncodeRemoteRecord(SampleRecord());
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= 0x40;
    EXPECT_EQ(DecodeRemoteRecord(bad).status().code(), absl::StatusCode::kDataLoss) << i;
  }
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(DecodeRemoteRecord(good.substr(0, n)).status().code(),
              absl::StatusCode::kDataLoss)
        << n;
  }
  EXPECT_FALSE(DecodeRemoteRecord(good + "x").ok());
}

// A whole record of another version (another release's, mid rolling upgrade) is not
// corrupt: Unimplemented, which the tier reads as foreign and leaves alone.
TEST(RemoteRecordTest, AnotherVersionIsNotCorruption) {
  std::string next = EncodeRemoteRecord(SampleRecord());
  next[4] = static_cast<char>(next[4] + 1);  // The version, after the magic.
  const uint32_t crc = crc32c::Value(absl::string_view(next).substr(0, next.size() - 4));
  for (int i = 0; i < 4; ++i) next[next.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  EXPECT_EQ(DecodeRemoteRecord(next).status().code(), absl::StatusCode::kUnimplemented);
  next[10] ^= 1;  // The same with a damaged byte: corrupt.
  EXPECT_EQ(DecodeRemoteRecord(next).status().code(), absl::StatusCode::kDataLoss);
}

TEST(RemoteRecordTest, SegmentCountMustMatchTheSize) {
  RemoteRecord r = SampleRecord();
  r.segment_crc32c = {1, 2};  // 10000 bytes need 3 segments of 4096.
  EXPECT_EQ(DecodeRemoteRecord(EncodeRemoteRecord(r)).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(RemoteSegmentCount(0, 4096), 1u);
  EXPECT_EQ(RemoteSegmentCount(4096, 4096), 1u);
  EXPECT_EQ(RemoteSegmentCount(4097, 4096), 2u);
  EXPECT_EQ(RemoteSegmentCount(~uint64_t{0}, 4096), uint64_t{1} << 52);  // No wrap.
}

// A size of 2^44 + 4096 at 4 KiB segments is 2^32 + 1 segments, which a 32-bit count
// wrapped to 1: a record of one segment claiming that size decoded as whole.
TEST(RemoteRecordTest, ASegmentCountPast32BitsIsRejected) {
  RemoteRecord r = SampleRecord();
  r.meta.size = (uint64_t{1} << 44) + 4096;
  r.segment_bytes = 4096;
  r.segment_crc32c = {1};
  EXPECT_EQ(RemoteSegmentCount(r.meta.size, r.segment_bytes), (uint64_t{1} << 32) + 1);
  EXPECT_EQ(DecodeRemoteRecord(EncodeRemoteRecord(r)).status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(RemoteRecordTest, KeysSpreadSegmentsOverSlots) {
  const ChunkId id{0xabc, ChunkKey{1, 2}};
  EXPECT_EQ(RemoteRecordKey("kvt", id), "kvt:0000000000000abc:" + id.key.ToHex());
  EXPECT_EQ(RemoteSegmentKey("kvt", id, 0x10, 7),
            "kvt:0000000000000abc:" + id.key.ToHex() + ":0000000000000010:7");
  EXPECT_EQ(RemoteNamespacePattern("kvt", 0xabc), "kvt:0000000000000abc:*");
  // No hash tag: 64 segments land on many slots (and so on every master).
  std::set<int> slots;
  for (uint32_t i = 0; i < 64; ++i) slots.insert(RedisHashSlot(RemoteSegmentKey("kvt", id, 9, i)));
  EXPECT_GT(slots.size(), 60u);
}

TEST(RemoteHealthTest, DegradesBacksOffAndRecovers) {
  absl::Time now = absl::UnixEpoch();
  RemoteHealth h(absl::Milliseconds(100), absl::Milliseconds(400), [&] { return now; });
  int probes = 0;
  absl::Status cluster = absl::UnavailableError("still down");
  auto probe = [&] {
    ++probes;
    return cluster;
  };
  EXPECT_TRUE(h.Allow(probe));
  EXPECT_EQ(probes, 0);  // Healthy: nothing to probe.
  EXPECT_FALSE(h.degraded());
  h.Failed(absl::UnavailableError("down"));
  EXPECT_TRUE(h.degraded());
  EXPECT_EQ(h.degradations(), 1u);
  EXPECT_FALSE(h.Allow(probe));  // Within the backoff: refused at once.
  EXPECT_FALSE(h.ProbeDue());
  EXPECT_EQ(probes, 0);
  now += absl::Milliseconds(100);
  EXPECT_TRUE(h.ProbeDue());
  EXPECT_TRUE(h.ProbeDue());  // Asking takes nothing...
  EXPECT_FALSE(h.Allow(probe));  // One probe, which fails...
  EXPECT_EQ(probes, 1);
  EXPECT_FALSE(h.Allow(probe));  // ...and only one.
  EXPECT_EQ(probes, 1);
  EXPECT_EQ(h.backoff(), absl::Milliseconds(200));
  // More failed replies of operations begun before double nothing more.
  h.Failed(absl::UnavailableError("still down"));
  h.Failed(absl::UnavailableError("still down"));
  EXPECT_EQ(h.backoff(), absl::Milliseconds(200));
  for (int i = 0; i < 3; ++i) {
    now += h.backoff();
    ASSERT_FALSE(h.Allow(probe));
  }
  EXPECT_EQ(probes, 4);
  EXPECT_EQ(h.backoff(), absl::Milliseconds(400));  // Capped.
  EXPECT_EQ(h.degradations(), 1u);
  now += absl::Milliseconds(400);
  cluster = absl::OkStatus();
  EXPECT_TRUE(h.Allow(probe));  // The probe reached the cluster: healthy again.
  EXPECT_EQ(probes, 5);
  EXPECT_FALSE(h.degraded());
  EXPECT_TRUE(h.Allow(probe));
  EXPECT_TRUE(h.Allow(probe));
  EXPECT_EQ(probes, 5);
  h.Failed(absl::UnavailableError("again"));
  EXPECT_EQ(h.degradations(), 2u);
  EXPECT_EQ(h.backoff(), absl::Milliseconds(100));  // Starts over.
}

// A blip that fails many replies of operations begun while healthy degrades once and
// leaves the backoff at its minimum: the tier is probed again 100 ms on, not 10 s.
TEST(RemoteHealthTest, ManyFailedRepliesOfOneBlipBackOffOnce) {
  absl::Time now = absl::UnixEpoch();
  RemoteHealth h(absl::Milliseconds(100), absl::Seconds(10), [&] { return now; });
  for (int reply = 0; reply < 64; ++reply) h.Failed(absl::UnavailableError("timeout"));
  EXPECT_TRUE(h.degraded());
  EXPECT_EQ(h.backoff(), absl::Milliseconds(100));
  now += absl::Milliseconds(100);
  EXPECT_TRUE(h.Allow([] { return absl::OkStatus(); }));
  EXPECT_FALSE(h.degraded());
}

}  // namespace
}  // namespace kvtier
