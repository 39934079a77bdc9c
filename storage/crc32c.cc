#include "storage/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>
#include <cstring>

namespace kvtier::crc32c {

uint32_t Extend(uint32_t crc, const void* data, size_t n) {
  // ISA-L's register convention: crc32_iscsi(p, n, r) runs the register r over p without
  // the pre- and post-inversion, so ours is ~crc32_iscsi(p, n, ~crc). Its length is an
  // int: longer buffers go in 1 GiB pieces.
  constexpr size_t kMaxPiece = 1u << 30;
  static_assert(kMaxPiece <= INT_MAX);
  // crc32_iscsi only reads the buffer; its prototype lacks the const.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t r = ~crc;
  while (n > 0) {
    const size_t len = std::min(n, kMaxPiece);
    r = crc32_iscsi(p, static_cast<int>(len), r);
    p += len;
    n -= len;
  }
  return ~r;
}

uint32_t CopyAndExtend(uint32_t crc, void* dst, const void* src, size_t n, CrcOver over) {
  // 16 KiB blocks: two of them (source and destination) fit in any L1 data cache, so the
  // checksum reads the block the copy just brought in.
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

namespace {

constexpr uint32_t kPolynomial = 0x82f63b78u;  // CRC32C, bit-reflected.

// a * b mod P(x), both in the reflected representation (x^0 is the top bit).
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) {
      product ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;
  }
  return product;
}

// kPowers[k] = x^(2^k) mod P(x).
struct Powers {
  uint32_t p[64];
  Powers() {
    uint32_t x = 1u << 30;  // x^1.
    for (uint32_t& v : p) {
      v = x;
      x = MultiplyModP(x, x);
    }
  }
};

}  // namespace

uint32_t Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // Appending len_b bytes multiplies A's register by x^(8 len_b); the pre- and
  // post-inversions of the two CRCs cancel out (as in zlib's crc32_combine).
  static const Powers kPowers;
  uint32_t shift = 1u << 31;  // x^0.
  uint64_t bits = len_b;
  for (int k = 3; bits != 0; bits >>= 1, ++k) {  // 8 len_b = len_b << 3.
    if (bits & 1) shift = MultiplyModP(kPowers.p[k & 63], shift);  // k < 64 below 2^60 bytes.
  }
  return MultiplyModP(shift, crc_a) ^ crc_b;
}

}  // namespace kvtier::crc32c
