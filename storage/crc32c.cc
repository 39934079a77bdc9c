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

}  // namespace kvtier::crc32c
