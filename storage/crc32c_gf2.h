// CRC32C as linear algebra over GF(2), for checking a chunk on the GPU: the bytes are
// cut into 256-byte segments, each segment's "raw" CRC (register starting at 0, no
// final xor) is computed on its own, and neighbours are joined with
//   raw(A || B) = Shift_|B|(raw(A)) ^ raw(B),
// where Shift_n (appending n zero bytes) is a 32x32 bit matrix. The standard CRC32C
// (register starting at ~0, final xor ~0) of D is then Shift_|D|(~0) ^ raw(D) ^ ~0.
//
// Everything here runs on the host and, compiled by nvcc, on the device
// (KVTIER_HOST_DEVICE), so that the GPU kernels' arithmetic is tested on any machine.
// The layout the kernels use (Crc32cGeometry) and a host reference of their whole
// computation (RawCrcLikeTheGpu) are here for the same reason.
#ifndef KVTIER_STORAGE_CRC32C_GF2_H_
#define KVTIER_STORAGE_CRC32C_GF2_H_

#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define KVTIER_HOST_DEVICE __host__ __device__
#else
#define KVTIER_HOST_DEVICE
#endif

namespace kvtier::crc32c_gf2 {

inline constexpr uint32_t kPoly = 0x82F63B78;  // CRC32C (Castagnoli), reflected.
inline constexpr uint32_t kSegmentBytes = 256;   // One GPU thread's bytes.
inline constexpr uint32_t kThreadsPerBlock = 256;
inline constexpr uint64_t kBlockBytes = uint64_t{kSegmentBytes} * kThreadsPerBlock;  // 64 KiB.
inline constexpr uint32_t kCombineThreads = 1024;  // The second kernel's one block.
inline constexpr int kSegmentLevels = 8;           // log2(kThreadsPerBlock).
inline constexpr int kBlockLevels = 32;            // Shifts by kBlockBytes << j.

// A linear map of the 32-bit register: column i is the image of bit i.
struct Matrix {
  uint32_t col[32];
};

// Everything the kernels read: the byte table and the shift matrices.
struct Tables {
  uint32_t table[256];
  Matrix segment_shift[kSegmentLevels];  // Shift by kSegmentBytes << l bytes.
  Matrix block_shift[kBlockLevels];      // Shift by kBlockBytes << j bytes.
};

KVTIER_HOST_DEVICE inline uint32_t Apply(const Matrix& m, uint32_t x) {
  uint32_t r = 0;
  for (int i = 0; i < 32; ++i) {
    if ((x >> i) & 1u) r ^= m.col[i];
  }
  return r;
}

// The raw CRC register after `n` bytes from `c`.
KVTIER_HOST_DEVICE inline uint32_t RawExtend(uint32_t c, const uint8_t* p, uint64_t n,
                                             const uint32_t* table) {
  for (uint64_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
  return c;
}

// Four bytes of a little-endian word.
KVTIER_HOST_DEVICE inline uint32_t RawWord(uint32_t c, uint32_t w, const uint32_t* table) {
  c ^= w;
  c = table[c & 0xffu] ^ (c >> 8);
  c = table[c & 0xffu] ^ (c >> 8);
  c = table[c & 0xffu] ^ (c >> 8);
  return table[c & 0xffu] ^ (c >> 8);
}

inline Matrix Compose(const Matrix& a, const Matrix& b) {  // a after b.
  Matrix out;
  for (int i = 0; i < 32; ++i) out.col[i] = Apply(a, b.col[i]);
  return out;
}

inline void MakeTables(Tables* t) {
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    t->table[i] = c;
  }
  Matrix m;  // One zero byte.
  for (int i = 0; i < 32; ++i) {
    const uint32_t x = 1u << i;
    m.col[i] = t->table[x & 0xffu] ^ (x >> 8);
  }
  for (int bits = 0; bits < 8; ++bits) m = Compose(m, m);  // 256 bytes.
  for (int l = 0; l < kSegmentLevels; ++l) {
    t->segment_shift[l] = m;
    m = Compose(m, m);
  }
  for (int j = 0; j < kBlockLevels; ++j) {  // m is now 64 KiB.
    t->block_shift[j] = m;
    m = Compose(m, m);
  }
}

// The kernels' layout for `bytes` (a multiple of kBlockBytes): `blocks` block CRCs,
// padded in front with zero blocks (which leave a raw CRC unchanged) to
// kCombineThreads * per_thread, each thread of the combine joining per_thread (a power
// of two, 2^per_thread_log2) in a row before the tree.
struct Crc32cGeometry {
  uint64_t blocks = 0;
  uint64_t per_thread = 1;
  int per_thread_log2 = 0;
  uint64_t padding = 0;  // Zero blocks in front.
};

inline Crc32cGeometry GeometryFor(uint64_t bytes) {
  Crc32cGeometry g;
  g.blocks = bytes / kBlockBytes;
  while (g.per_thread * kCombineThreads < g.blocks) {
    g.per_thread <<= 1;
    ++g.per_thread_log2;
  }
  g.padding = g.per_thread * kCombineThreads - g.blocks;
  return g;
}

// Standard CRC32C from the raw CRC of `bytes` bytes (a multiple of kBlockBytes).
inline uint32_t StandardFromRaw(const Tables& t, uint32_t raw, uint64_t bytes) {
  uint64_t blocks = bytes / kBlockBytes;
  uint32_t ones = 0xffffffffu;
  for (int j = 0; blocks != 0; ++j, blocks >>= 1) {
    if (blocks & 1) ones = Apply(t.block_shift[j], ones);
  }
  return ones ^ raw ^ 0xffffffffu;
}

// What the GPU computes for `bytes` bytes at `p` (a multiple of kBlockBytes), step by
// step as its two kernels do: the fake device backend runs this, and tests compare it
// with the one-pass CRC32C.
inline uint32_t RawCrcLikeTheGpu(const Tables& t, const uint8_t* p, uint64_t bytes) {
  const Crc32cGeometry g = GeometryFor(bytes);
  if (g.blocks == 0) return 0;
  // Kernel 1: one block of threads per 64 KiB, one thread per 256 bytes, then a tree.
  std::vector<uint32_t> block_crc(g.blocks);
  uint32_t part[kThreadsPerBlock];
  for (uint64_t b = 0; b < g.blocks; ++b) {
    for (uint32_t i = 0; i < kThreadsPerBlock; ++i) {
      const uint8_t* s = p + b * kBlockBytes + uint64_t{i} * kSegmentBytes;
      uint32_t c = 0;
      for (uint32_t w = 0; w < kSegmentBytes; w += 4) {
        const uint32_t word = uint32_t{s[w]} | uint32_t{s[w + 1]} << 8 |
                              uint32_t{s[w + 2]} << 16 | uint32_t{s[w + 3]} << 24;
        c = RawWord(c, word, t.table);
      }
      part[i] = c;
    }
    for (int l = 0; l < kSegmentLevels; ++l) {
      const uint32_t stride = 1u << l;
      for (uint32_t i = 0; i < kThreadsPerBlock; i += 2 * stride) {
        part[i] = Apply(t.segment_shift[l], part[i]) ^ part[i + stride];
      }
    }
    block_crc[b] = part[0];
  }
  // Kernel 2: each thread joins per_thread blocks in a row, then a tree.
  std::vector<uint32_t> group(kCombineThreads);
  for (uint32_t i = 0; i < kCombineThreads; ++i) {
    uint32_t c = 0;
    for (uint64_t k = 0; k < g.per_thread; ++k) {
      const uint64_t v = uint64_t{i} * g.per_thread + k;  // Padded index.
      const uint32_t block = v < g.padding ? 0 : block_crc[v - g.padding];
      c = Apply(t.block_shift[0], c) ^ block;
    }
    group[i] = c;
  }
  for (int l = 0; (1u << l) < kCombineThreads; ++l) {
    const uint32_t stride = 1u << l;
    for (uint32_t i = 0; i < kCombineThreads; i += 2 * stride) {
      group[i] = Apply(t.block_shift[g.per_thread_log2 + l], group[i]) ^ group[i + stride];
    }
  }
  return group[0];
}

}  // namespace kvtier::crc32c_gf2

#endif  // KVTIER_STORAGE_CRC32C_GF2_H_
