// The DeviceBackend on a real GPU, through the CUDA runtime (linked statically, so a
// kvtierd built with CUDA starts on hosts without it and reports "no GPU").
//
// Copies run on `copy_streams` non-blocking streams, chosen round robin per
// submission; each stream has a completion thread that waits for its submissions'
// events in order and runs their callbacks. A submission of several copies is one
// cudaMemcpyBatchAsync where the runtime has it, else one cudaMemcpyAsync per copy.
//
// Thread-safety: thread-safe; every call makes the backend's device current first.
#ifndef KVTIER_STORAGE_CUDA_CUDA_DEVICE_BACKEND_H_
#define KVTIER_STORAGE_CUDA_CUDA_DEVICE_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "storage/device_backend.h"

namespace kvtier {

struct CudaBackendOptions {
  int device = 0;         // CUDA device ordinal.
  int copy_streams = 2;   // Streams copies are spread over; at least 1.

  absl::Status Validate() const;
};

// Returns: Ok, NotFound (no CUDA driver or no such device: the message says which),
// InvalidArgument (options), Unavailable.
absl::StatusOr<std::unique_ptr<DeviceBackend>> OpenCudaBackend(const CudaBackendOptions& options);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_CUDA_CUDA_DEVICE_BACKEND_H_
