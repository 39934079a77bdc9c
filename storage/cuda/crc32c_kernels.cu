#include "storage/cuda/crc32c_kernels.h"

namespace kvtier::cuda {
namespace {

using crc32c_gf2::Apply;
using crc32c_gf2::kBlockBytes;
using crc32c_gf2::kBlockLevels;
using crc32c_gf2::kCombineThreads;
using crc32c_gf2::kSegmentBytes;
using crc32c_gf2::kSegmentLevels;
using crc32c_gf2::kThreadsPerBlock;
using crc32c_gf2::Matrix;
using crc32c_gf2::RawWord;
using crc32c_gf2::Tables;

// One block of threads per 64 KiB: each thread the raw CRC of its 256 bytes, then a
// tree joining neighbours with the segment shifts.
__global__ void __launch_bounds__(kThreadsPerBlock)
    BlockCrcs(const uint8_t* data, const Tables* tables, uint32_t* block_crc) {
  __shared__ uint32_t table[256];
  __shared__ Matrix shift[kSegmentLevels];
  __shared__ uint32_t part[kThreadsPerBlock];
  const uint32_t tid = threadIdx.x;
  table[tid] = tables->table[tid];
  for (uint32_t i = tid; i < kSegmentLevels * 32; i += kThreadsPerBlock) {
    shift[i / 32].col[i % 32] = tables->segment_shift[i / 32].col[i % 32];
  }
  __syncthreads();
  const uint4* v = reinterpret_cast<const uint4*>(data + blockIdx.x * kBlockBytes +
                                                  uint64_t{tid} * kSegmentBytes);
  uint32_t c = 0;
#pragma unroll 4
  for (uint32_t i = 0; i < kSegmentBytes / 16; ++i) {
    const uint4 w = v[i];
    c = RawWord(c, w.x, table);
    c = RawWord(c, w.y, table);
    c = RawWord(c, w.z, table);
    c = RawWord(c, w.w, table);
  }
  part[tid] = c;
  __syncthreads();
  for (int l = 0; l < kSegmentLevels; ++l) {
    const uint32_t stride = 1u << l;
    if ((tid & (2 * stride - 1)) == 0) part[tid] = Apply(shift[l], part[tid]) ^ part[tid + stride];
    __syncthreads();
  }
  if (tid == 0) block_crc[blockIdx.x] = part[0];
}

// One block: each thread joins per_thread block CRCs in a row (the first `padding` of
// the padded sequence are zero blocks), then a tree over the threads.
__global__ void __launch_bounds__(kCombineThreads)
    CombineBlocks(const uint32_t* block_crc, uint64_t per_thread, int per_thread_log2,
                  uint64_t padding, const Tables* tables, uint32_t* raw_out) {
  __shared__ Matrix shift[kBlockLevels];
  __shared__ uint32_t group[kCombineThreads];
  const uint32_t tid = threadIdx.x;
  for (uint32_t i = tid; i < kBlockLevels * 32; i += kCombineThreads) {
    shift[i / 32].col[i % 32] = tables->block_shift[i / 32].col[i % 32];
  }
  __syncthreads();
  uint32_t c = 0;
  for (uint64_t k = 0; k < per_thread; ++k) {
    const uint64_t v = uint64_t{tid} * per_thread + k;
    const uint32_t block = v < padding ? 0 : block_crc[v - padding];
    c = Apply(shift[0], c) ^ block;
  }
  group[tid] = c;
  __syncthreads();
  for (int l = 0; (1u << l) < kCombineThreads; ++l) {
    const uint32_t stride = 1u << l;
    if ((tid & (2 * stride - 1)) == 0) {
      group[tid] = Apply(shift[per_thread_log2 + l], group[tid]) ^ group[tid + stride];
    }
    __syncthreads();
  }
  if (tid == 0) *raw_out = group[0];
}

}  // namespace

cudaError_t EnqueueRawCrc32c(cudaStream_t stream, const Tables* tables, const void* data,
                             uint64_t bytes, uint32_t* scratch, uint32_t* raw_out) {
  const crc32c_gf2::Crc32cGeometry g = crc32c_gf2::GeometryFor(bytes);
  if (g.blocks == 0 || g.blocks > 0x7fffffffu || g.per_thread_log2 + 10 > kBlockLevels) {
    return cudaErrorInvalidValue;
  }
  // The runtime's last error is per thread and outlives the call that set it (an IPC
  // handle this thread failed to open, say): clear it, or it would read as this
  // launch's.
  (void)cudaGetLastError();
  BlockCrcs<<<static_cast<unsigned>(g.blocks), kThreadsPerBlock, 0, stream>>>(
      static_cast<const uint8_t*>(data), tables, scratch);
  CombineBlocks<<<1, kCombineThreads, 0, stream>>>(scratch, g.per_thread, g.per_thread_log2,
                                                   g.padding, tables, raw_out);
  return cudaGetLastError();
}

}  // namespace kvtier::cuda
