// CRC32C (Castagnoli). The vectors are the standard check value and the RFC 3720
// (iSCSI) appendix B.4 vectors; the 1 MiB one was computed with a bitwise reference
// implementation in Python:
//
//   def crc32c(data, crc=0):
//       crc ^= 0xffffffff
//       for b in data:
//           crc ^= b
//           for _ in range(8):
//               crc = (crc >> 1) ^ (0x82f63b78 if crc & 1 else 0)
//       return crc ^ 0xffffffff
//   crc32c(bytes(((i*131 + (i>>8)*7 + 17) & 0xff) for i in range(1 << 20)))  # 0xdae96912
#include "storage/crc32c.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kvtier {
namespace {

std::string Bytes(std::initializer_list<int> v) {
  std::string s;
  for (int b : v) s.push_back(static_cast<char>(b));
  return s;
}

// A byte-at-a-time reference, to check the fast paths against on random input.
uint32_t Reference(const std::string& data, uint32_t crc = 0) {
  crc = ~crc;
  for (unsigned char b : data) {
    crc ^= b;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ ((crc & 1) ? 0x82f63b78u : 0u);
  }
  return ~crc;
}

TEST(Crc32c, StandardVectors) {
  EXPECT_EQ(crc32c::Value("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c::Value(""), 0u);
  EXPECT_EQ(crc32c::Value("a"), 0xC1D04330u);
  EXPECT_EQ(crc32c::Value("The quick brown fox jumps over the lazy dog"), 0x22620404u);
}

TEST(Crc32c, Rfc3720Vectors) {
  EXPECT_EQ(crc32c::Value(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c::Value(std::string(32, '\xff')), 0x62A8AB43u);
  std::string inc, dec;
  for (int i = 0; i < 32; ++i) {
    inc.push_back(static_cast<char>(i));
    dec.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c::Value(inc), 0x46DD794Eu);
  EXPECT_EQ(crc32c::Value(dec), 0x113FDB5Cu);
  // iSCSI read command PDU.
  const std::string pdu = Bytes({0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00,
                                 0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
  EXPECT_EQ(crc32c::Value(pdu), 0xD9963A56u);
}

TEST(Crc32c, OneMebibyte) {
  std::string data(1 << 20, '\0');
  for (size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<char>((i * 131 + (i >> 8) * 7 + 17) & 0xff);
  }
  EXPECT_EQ(crc32c::Value(data), 0xdae96912u);
}

TEST(Crc32c, ExtendOverSplitBuffersEqualsWhole) {
  const std::string data = "The quick brown fox jumps over the lazy dog, twice over: "
                           "the quick brown fox jumps over the lazy dog.";
  const uint32_t whole = crc32c::Value(data);
  for (size_t cut = 0; cut <= data.size(); ++cut) {
    uint32_t crc = crc32c::Extend(0, data.data(), cut);
    crc = crc32c::Extend(crc, data.data() + cut, data.size() - cut);
    EXPECT_EQ(crc, whole) << "cut at " << cut;
  }
  // Many small pieces of uneven sizes.
  uint32_t crc = 0;
  size_t at = 0;
  for (size_t step = 1; at < data.size(); step = step % 13 + 1) {
    const size_t n = std::min(step, data.size() - at);
    crc = crc32c::Extend(crc, data.data() + at, n);
    at += n;
  }
  EXPECT_EQ(crc, whole);
  // Extending by nothing changes nothing.
  EXPECT_EQ(crc32c::Extend(whole, data.data(), 0), whole);
}

TEST(Crc32c, UnalignedInputsGiveTheSameValue) {
  const std::string payload = "123456789abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ";
  const uint32_t expect = crc32c::Value(payload);
  // Copy the payload at every offset 0..15 within an over-aligned buffer.
  alignas(64) char buf[256];
  for (size_t off = 0; off < 16; ++off) {
    std::memset(buf, 0x5a, sizeof(buf));
    std::memcpy(buf + off, payload.data(), payload.size());
    EXPECT_EQ(crc32c::Value(buf + off, payload.size()), expect) << "offset " << off;
  }
  EXPECT_EQ(crc32c::Value("123456789"), 0xE3069283u);
  alignas(16) char nine[32];
  for (size_t off = 1; off < 16; ++off) {
    std::memcpy(nine + off, "123456789", 9);
    EXPECT_EQ(crc32c::Value(nine + off, 9), 0xE3069283u) << "offset " << off;
  }
}

TEST(Crc32c, MatchesBytewiseReferenceOnRandomInput) {
  std::mt19937_64 rng(20240611);
  for (int round = 0; round < 200; ++round) {
    const size_t n = rng() % 2000;
    std::string data(n, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    const uint32_t seed_crc = static_cast<uint32_t>(rng());
    ASSERT_EQ(crc32c::Value(data), Reference(data)) << "n=" << n;
    ASSERT_EQ(crc32c::Extend(seed_crc, data.data(), data.size()), Reference(data, seed_crc))
        << "n=" << n;
  }
}

// The hardware path runs three interleaved streams over rounds of 3 x 4096 bytes, then
// rounds of 3 x 256 bytes, then one stream over the rest (< 768 bytes), and joins the
// streams with shift tables. Every length around those thresholds, at several
// alignments and with a non-zero starting CRC, must match the bytewise reference.
TEST(Crc32c, MatchesReferenceAroundBlockThresholds) {
  std::mt19937_64 rng(7);
  std::string buf((3 * 4096) * 2 + 3 * 256 * 2 + 64, '\0');
  for (char& c : buf) c = static_cast<char>(rng());
  std::vector<size_t> lengths;
  for (size_t base : {size_t{3 * 256}, size_t{2 * 3 * 256}, size_t{3 * 4096},
                      size_t{3 * 4096 + 3 * 256}, size_t{2 * 3 * 4096},
                      size_t{2 * 3 * 4096 + 2 * 3 * 256}}) {
    for (size_t d = 0; d <= 17; ++d) {
      lengths.push_back(base - d);
      lengths.push_back(base + d);
    }
  }
  for (size_t n : lengths) {
    for (size_t off : {0, 1, 3, 7, 8, 13}) {
      ASSERT_LE(off + n, buf.size());
      const std::string data = buf.substr(off, n);
      ASSERT_EQ(crc32c::Value(buf.data() + off, n), Reference(data)) << "n=" << n << " off=" << off;
      ASSERT_EQ(crc32c::Extend(0xdeadbeef, buf.data() + off, n), Reference(data, 0xdeadbeef))
          << "n=" << n << " off=" << off;
    }
  }
}

TEST(Crc32c, MatchesReferenceOnRandomLongBuffers) {
  std::mt19937_64 rng(20240612);
  std::string buf(6 << 20, '\0');
  for (char& c : buf) c = static_cast<char>(rng());
  // About 20 MiB through the (slow) bitwise reference in all.
  for (int round = 0; round < 8; ++round) {
    const size_t n = round == 0 ? buf.size() - 5 : rng() % (buf.size() - 16);
    const size_t off = rng() % 16;
    const std::string data = buf.substr(off, n);
    const uint32_t seed_crc = static_cast<uint32_t>(rng());
    const uint32_t expect = Reference(data, seed_crc);
    ASSERT_EQ(crc32c::Extend(seed_crc, buf.data() + off, n), expect) << "n=" << n;
    // Split at a random point: Extend over the halves equals the whole.
    const size_t cut = n == 0 ? 0 : rng() % n;
    uint32_t crc = crc32c::Extend(seed_crc, buf.data() + off, cut);
    ASSERT_EQ(crc32c::Extend(crc, buf.data() + off + cut, n - cut), expect)
        << "n=" << n << " cut=" << cut;
  }
}

TEST(Crc32c, DetectsEverySingleBitFlip) {
  std::string data(300, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  const uint32_t good = crc32c::Value(data);
  for (size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      data[i] ^= static_cast<char>(1 << bit);
      ASSERT_NE(crc32c::Value(data), good) << "byte " << i << " bit " << bit;
      data[i] ^= static_cast<char>(1 << bit);
    }
  }
}

TEST(Crc32c, CopyAndExtendCopiesAndChecksumsEitherSide) {
  std::string src(100000 + 13, '\0');
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 131 + (i >> 7));
  for (size_t n : {size_t{0}, size_t{1}, size_t{16383}, size_t{16384}, size_t{16385}, src.size()}) {
    std::string dst(n, '\x55');
    for (auto over : {crc32c::CrcOver::kSource, crc32c::CrcOver::kDestination}) {
      const uint32_t crc = crc32c::CopyAndExtend(7, dst.data(), src.data(), n, over);
      EXPECT_EQ(dst, src.substr(0, n));
      EXPECT_EQ(crc, crc32c::Extend(7, src.data(), n)) << n;
    }
  }
}

TEST(Crc32c, CombineOfTwoPartsIsTheCrcOfTheWhole) {
  std::mt19937_64 rng(42);
  std::string data(3 << 20, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  std::vector<size_t> cuts = {0, 1, 7, 8, 9, 4095, 4096, 65536, (1u << 20) + 3, data.size() - 1,
                              data.size()};
  for (int i = 0; i < 20; ++i) cuts.push_back(rng() % (data.size() + 1));
  const uint32_t whole = crc32c::Value(data);
  for (size_t cut : cuts) {
    const absl::string_view a = absl::string_view(data).substr(0, cut);
    const absl::string_view b = absl::string_view(data).substr(cut);
    EXPECT_EQ(crc32c::Combine(crc32c::Value(a), crc32c::Value(b), b.size()), whole) << cut;
  }
  // Against the bitwise reference on short inputs, every split.
  const std::string small = data.substr(0, 40);
  for (size_t cut = 0; cut <= small.size(); ++cut) {
    EXPECT_EQ(crc32c::Combine(Reference(small.substr(0, cut)), Reference(small.substr(cut)),
                              small.size() - cut),
              Reference(small))
        << cut;
  }
  // Many parts folded left to right, as ParallelCopy does.
  uint32_t folded = 0;
  for (size_t at = 0; at < data.size(); at += 300007) {
    const absl::string_view part = absl::string_view(data).substr(at, 300007);
    folded = crc32c::Combine(folded, crc32c::Value(part), part.size());
  }
  EXPECT_EQ(folded, whole);
}

}  // namespace
}  // namespace kvtier
