#include "storage/crc32c.h"

#include <array>
#include <cstring>

namespace kvtier::crc32c {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // Reflected Castagnoli polynomial.

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t;
  constexpr Tables() : t() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s) {
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};
constexpr Tables kTables;

uint32_t ExtendSoftware(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = kTables.t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
          t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
          t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

// The CRC register update is linear over GF(2): running bytes D from register r gives
// Shift(r, |D|) ^ Run(0, D), where Shift(r, L) is r followed by L zero bytes, i.e.
// r * x^(8L) mod P. That is what lets three streams run over three blocks independently
// and be joined afterwards. Polynomials below are bit-reflected like the register: bit 31
// is x^0.

// a * b mod P.
constexpr uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 * bytes) mod P, by square-and-multiply over the bits of 8 * bytes.
constexpr uint32_t XPowBytesModP(uint64_t bytes) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t square = 1u << 30;  // x^1, then x^2, x^4, ...
  for (uint64_t n = bytes * 8; n != 0; n >>= 1) {
    if (n & 1) result = MultModP(square, result);
    square = MultModP(square, square);
  }
  return result;
}

// Shift(r, L) for one L as four byte-indexed tables: Shift is linear, so it is the XOR
// of the shifts of r's four bytes. 4 KiB per table set.
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t;
  constexpr explicit ShiftTable(uint64_t bytes) : t() {
    const uint32_t xpow = XPowBytesModP(bytes);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = MultModP(xpow, i << (8 * k));
    }
  }
  uint32_t Shift(uint32_t r) const {
    return t[0][r & 0xff] ^ t[1][(r >> 8) & 0xff] ^ t[2][(r >> 16) & 0xff] ^ t[3][r >> 24];
  }
};

// Block sizes of the three-stream loop, per stream. crc32q has a latency of 3 cycles and
// a throughput of 1 per cycle, so one dependency chain runs at a third of the
// instruction's rate; three chains over three adjacent blocks fill the pipeline. Joining
// them costs two table shifts (8 loads) per round, about a dozen cycles: 4 KiB blocks
// make that noise for large buffers, and 256-byte blocks still pay for it on the
// kilobyte-sized pieces a network stack hands over (a round of 256-byte blocks is
// 96 crc32q; its join costs what ~10 more would). Multiples of 8 so the streams stay in
// 8-byte steps.
constexpr size_t kLongBlock = 4096;
constexpr size_t kShortBlock = 256;

struct JoinTables {
  ShiftTable long1{kLongBlock}, long2{2 * kLongBlock};
  ShiftTable short1{kShortBlock}, short2{2 * kShortBlock};
};
constexpr JoinTables kJoin;

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint64_t Crc8(uint64_t c, const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return __builtin_ia32_crc32di(c, w);
}

// Runs whole rounds of 3 * block bytes from register `c` while n allows, advancing p
// and n.
template <size_t kBlock>
__attribute__((target("sse4.2"))) inline uint64_t ThreeWay(uint64_t c, const uint8_t*& p,
                                                            size_t& n, const ShiftTable& by1,
                                                            const ShiftTable& by2) {
  while (n >= 3 * kBlock) {
    uint64_t c0 = c, c1 = 0, c2 = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      c0 = Crc8(c0, p + i);
      c1 = Crc8(c1, p + kBlock + i);
      c2 = Crc8(c2, p + 2 * kBlock + i);
    }
    c = by2.Shift(static_cast<uint32_t>(c0)) ^ by1.Shift(static_cast<uint32_t>(c1)) ^
        static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  return c;
}

__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc, const uint8_t* p,
                                                          size_t n) {
  uint64_t c = crc;
  c = ThreeWay<kLongBlock>(c, p, n, kJoin.long1, kJoin.long2);
  c = ThreeWay<kShortBlock>(c, p, n, kJoin.short1, kJoin.short2);
  // The tail (under 768 bytes) in one chain.
  while (n >= 8) {
    c = Crc8(c, p);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
bool HaveSse42() { return __builtin_cpu_supports("sse4.2"); }
#else
uint32_t ExtendHardware(uint32_t crc, const uint8_t* p, size_t n) {
  return ExtendSoftware(crc, p, n);
}
bool HaveSse42() { return false; }
#endif

const bool kHardware = HaveSse42();

}  // namespace

uint32_t Extend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  crc = kHardware ? ExtendHardware(crc, p, n) : ExtendSoftware(crc, p, n);
  return ~crc;
}

uint32_t CopyAndExtend(uint32_t crc, void* dst, const void* src, size_t n, CrcOver over) {
  // 16 KiB blocks: two of them (source and destination) fit in any L1 data cache, and
  // the three-way loop still runs on 4 KiB strides.
  constexpr size_t kBlock = 16 << 10;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  while (n > 0) {
    const size_t len = n < kBlock ? n : kBlock;
    std::memcpy(d, s, len);
    crc = Extend(crc, over == CrcOver::kSource ? s : d, len);
    d += len;
    s += len;
    n -= len;
  }
  return crc;
}

bool IsHardwareAccelerated() { return kHardware; }

}  // namespace kvtier::crc32c
