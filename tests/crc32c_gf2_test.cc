// The GPU CRC32C check's arithmetic, on the host: the byte table, the shift matrices,
// the kernels' layout with its zero padding, and the whole two-kernel computation
// (RawCrcLikeTheGpu) against the one-pass CRC32C, for block counts that need no
// padding, some, and several blocks per combining thread.
#include "storage/crc32c_gf2.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

using crc32c_gf2::kBlockBytes;

std::string Bytes(uint64_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

class Crc32cGf2Test : public ::testing::Test {
 protected:
  void SetUp() override { crc32c_gf2::MakeTables(tables_.get()); }
  std::unique_ptr<crc32c_gf2::Tables> tables_ = std::make_unique<crc32c_gf2::Tables>();
};

TEST_F(Crc32cGf2Test, RawExtendFromOnesIsTheStandardCrc) {
  const std::string d = Bytes(1000, 1);
  const auto* p = reinterpret_cast<const uint8_t*>(d.data());
  EXPECT_EQ(crc32c_gf2::RawExtend(0xffffffffu, p, d.size(), tables_->table) ^ 0xffffffffu,
            crc32c::Value(d));
  // The check value of the CRC-32C catalogue.
  EXPECT_EQ(crc32c::Value("123456789"), 0xe3069283u);
}

TEST_F(Crc32cGf2Test, ShiftMatricesJoinRawCrcs) {
  const std::string a = Bytes(256, 2), b = Bytes(256, 3);
  const auto raw = [&](const std::string& s) {
    return crc32c_gf2::RawExtend(0, reinterpret_cast<const uint8_t*>(s.data()), s.size(),
                                 tables_->table);
  };
  EXPECT_EQ(crc32c_gf2::Apply(tables_->segment_shift[0], raw(a)) ^ raw(b), raw(a + b));
  const std::string c = Bytes(kBlockBytes, 4), e = Bytes(kBlockBytes * 2, 5);
  EXPECT_EQ(crc32c_gf2::Apply(tables_->block_shift[1], raw(c)) ^ raw(e), raw(c + e));
  // Leading zeros leave a raw CRC unchanged: the kernels' padding.
  EXPECT_EQ(raw(std::string(kBlockBytes, '\0') + c), raw(c));
}

TEST_F(Crc32cGf2Test, GeometryPadsToWholeCombiningThreads) {
  auto g = crc32c_gf2::GeometryFor(512 * kBlockBytes);  // 32 MiB.
  EXPECT_EQ(g.blocks, 512u);
  EXPECT_EQ(g.per_thread, 1u);
  EXPECT_EQ(g.padding, 512u);
  g = crc32c_gf2::GeometryFor(2048 * kBlockBytes);  // 128 MiB.
  EXPECT_EQ(g.per_thread, 2u);
  EXPECT_EQ(g.per_thread_log2, 1);
  EXPECT_EQ(g.padding, 0u);
  g = crc32c_gf2::GeometryFor(3000 * kBlockBytes);
  EXPECT_EQ(g.per_thread, 4u);
  EXPECT_EQ(g.padding, 4096u - 3000u);
}

TEST_F(Crc32cGf2Test, TheGpusComputationIsTheStandardCrc) {
  for (uint64_t blocks : {1u, 2u, 3u, 17u, 1024u, 1025u, 2500u}) {
    const std::string d = Bytes(blocks * kBlockBytes, static_cast<uint32_t>(blocks));
    const uint32_t raw = crc32c_gf2::RawCrcLikeTheGpu(
        *tables_, reinterpret_cast<const uint8_t*>(d.data()), d.size());
    EXPECT_EQ(crc32c_gf2::StandardFromRaw(*tables_, raw, d.size()), crc32c::Value(d))
        << blocks << " blocks";
  }
  // One flipped bit anywhere changes it.
  std::string d = Bytes(5 * kBlockBytes, 9);
  const auto check = [&] {
    return crc32c_gf2::StandardFromRaw(
        *tables_,
        crc32c_gf2::RawCrcLikeTheGpu(*tables_, reinterpret_cast<const uint8_t*>(d.data()),
                                     d.size()),
        d.size());
  };
  const uint32_t clean = check();
  d[3 * kBlockBytes + 77] ^= 0x10;
  EXPECT_NE(check(), clean);
}

}  // namespace
}  // namespace kvtier
