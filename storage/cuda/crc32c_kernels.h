// The CRC32C of device memory, computed on the device (crc32c_kernels.cu): two kernels
// on the caller's stream, after whatever it already holds (a delivery's copies), as
// laid out in storage/crc32c_gf2.h. Only built where nvcc is CMake's CUDA compiler
// (KVTIER_HAVE_CUDA_KERNELS).
#ifndef KVTIER_STORAGE_CUDA_CRC32C_KERNELS_H_
#define KVTIER_STORAGE_CUDA_CRC32C_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "storage/crc32c_gf2.h"

namespace kvtier::cuda {

// Enqueues the raw CRC (register from 0, no final xor: see crc32c_gf2.h) of `bytes`
// bytes at `data` (16-byte aligned; a multiple of crc32c_gf2::kBlockBytes) into
// `*raw_out` (device memory). `tables`: crc32c_gf2::Tables in device memory.
// `scratch` holds at least `bytes / kBlockBytes` words of device memory, not used by
// anything else on the stream meanwhile.
cudaError_t EnqueueRawCrc32c(cudaStream_t stream, const crc32c_gf2::Tables* tables,
                             const void* data, uint64_t bytes, uint32_t* scratch,
                             uint32_t* raw_out);

}  // namespace kvtier::cuda

#endif  // KVTIER_STORAGE_CUDA_CRC32C_KERNELS_H_
