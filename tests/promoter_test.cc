// Promoter over a real RAM pool and SSD tier: a read from SSD lands in fresh pool slots
// when there is room (a promotion, indexed clean and reported once), in the caller's
// sink when there is none (dirty chunks are not demoted for it), or nowhere; a miss is
// NotFound with no meta.
#include "storage/promoter.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/lru_policy.h"
#include "storage/ssd_tier.h"
#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

constexpr uint64_t kChunk = 256 << 10;
constexpr uint64_t kPoolChunks = 4;

std::string Payload(uint64_t n) {
  std::string s(kChunk, '\0');
  for (uint64_t i = 0; i < kChunk; ++i) s[i] = static_cast<char>(n * 131 + i * 7);
  return s;
}
ChunkId Id(uint64_t n) { return ChunkId{0x77, ChunkKey{0x5000 + n, n}}; }
ChunkMeta MetaOf(const std::string& data) { return ChunkMeta{data.size(), crc32c::Value(data), 16, 0}; }

class PromoterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    HostPoolOptions ram;
    ram.arena.capacity_bytes = kPoolChunks * kChunk;
    ram.arena.slot_bytes = 64 << 10;
    auto pool = HostPool::Create(ram, std::make_unique<LruPolicy>());
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    SsdTierOptions ssd;
    ssd.path = dir_.path() + "/db";
    ssd.capacity_bytes = 64 << 20;
    ssd.write_buffer_bytes = 8 << 20;
    auto tier = SsdTier::Open(ssd);
    ASSERT_TRUE(tier.ok()) << tier.status();
    ssd_ = *std::move(tier);
    promoter_ = std::make_unique<Promoter>(pool_.get(), ssd_.get(),
                                           [this](const ChunkId& id, const ChunkMeta&) {
                                             reported_.push_back(id);
                                           });
    for (uint64_t n = 0; n < 3; ++n) {
      const std::string data = Payload(n);
      ASSERT_TRUE(ssd_->Put(Id(n), MetaOf(data), {data}).ok());
    }
  }

  // Fills the pool with dirty chunks (not on SSD: never evicted for a promotion).
  void FillPoolWithDirtyChunks() {
    for (uint64_t n = 100; n < 100 + kPoolChunks; ++n) {
      auto room = pool_->Allocate(kChunk);
      ASSERT_TRUE(room.ok()) << room.status();
      const std::string data = Payload(n);
      (*room)->Write(0, data);
      ASSERT_TRUE(pool_->Insert(Id(n), *room, MetaOf(data), /*dirty=*/true));
    }
  }

  static std::string Bytes(const PoolChunk& chunk) {
    std::string out;
    chunk.ForEachPiece(0, chunk.size(), [&](absl::string_view p) { out.append(p.data(), p.size()); });
    return out;
  }

  testing::TempDir dir_{"kvtier_promoter"};
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<SsdTier> ssd_;
  std::unique_ptr<Promoter> promoter_;
  std::vector<ChunkId> reported_;
};

TEST_F(PromoterTest, WithRoomTheChunkLandsInRamCleanAndIsReportedOnce) {
  int asked = 0;
  Promoter::Result r = promoter_->Read(Id(1), [&](const ChunkMeta&) -> ChunkSink* {
    ++asked;
    return nullptr;
  });
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(asked, 0) << "the caller's sink was asked for though RAM had room";
  ASSERT_NE(r.room, nullptr);
  ASSERT_TRUE(r.meta.has_value());
  EXPECT_EQ(*r.meta, MetaOf(Payload(1)));
  EXPECT_TRUE(Bytes(*r.room) == Payload(1));
  EXPECT_TRUE(pool_->Contains(Id(1)));
  EXPECT_EQ(pool_->GetStats().dirty_chunks, 0u);  // Clean: it is on SSD.
  EXPECT_EQ(promoter_->promotions(), 1u);
  EXPECT_EQ(reported_, std::vector<ChunkId>{Id(1)});
  EXPECT_EQ(ssd_->GetStats().hits, 1u);  // One read of the tier below, one hit.
}

TEST_F(PromoterTest, WithoutRoomTheBytesGoToTheCallersSinkAndNothingIsEvicted) {
  FillPoolWithDirtyChunks();
  std::string buffer;
  std::optional<StringSink> sink;
  Promoter::Result r = promoter_->Read(Id(2), [&](const ChunkMeta& meta) -> ChunkSink* {
    buffer.resize(meta.size);
    sink.emplace(&buffer);
    return &*sink;
  });
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.room, nullptr);
  EXPECT_TRUE(buffer == Payload(2));
  EXPECT_FALSE(pool_->Contains(Id(2)));
  EXPECT_EQ(pool_->GetStats().chunks, kPoolChunks);  // No dirty chunk made way.
  EXPECT_EQ(promoter_->promotions(), 0u);
  EXPECT_TRUE(reported_.empty());

  // Nowhere to go: the read stops at the meta.
  Promoter::Result nowhere =
      promoter_->Read(Id(2), [](const ChunkMeta&) -> ChunkSink* { return nullptr; });
  EXPECT_EQ(nowhere.status.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(nowhere.meta.has_value());
  EXPECT_EQ(nowhere.meta->size, kChunk);
  EXPECT_EQ(nowhere.room, nullptr);
}

TEST_F(PromoterTest, AMissIsNotFoundWithoutMeta) {
  Promoter::Result r =
      promoter_->Read(Id(9), [](const ChunkMeta&) -> ChunkSink* { return nullptr; });
  EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(r.meta.has_value());
  EXPECT_EQ(r.room, nullptr);
  EXPECT_EQ(pool_->GetStats().chunks, 0u);
  EXPECT_EQ(pool_->GetStats().used_bytes, 0u);  // No slots left behind.
}

}  // namespace
}  // namespace kvtier
