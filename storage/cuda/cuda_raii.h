// Move-only owners of CUDA resources: a stream, an event, device memory, a page-locked
// host range and an opened IPC mapping. Each is released in its destructor (errors
// there are ignored: nothing useful can be done with them during teardown, and a
// destructor must not fail). Creation goes through the static Create functions, which
// return the CUDA error as an absl::Status (CudaError).
//
// Included only by storage/cuda/*.cc: nothing outside storage/cuda/ sees a CUDA type.
//
// Thread-safety: each object is used by one thread at a time; CUDA calls on it are made
// with the owning device current.
#ifndef KVTIER_STORAGE_CUDA_CUDA_RAII_H_
#define KVTIER_STORAGE_CUDA_CUDA_RAII_H_

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

// Maps a CUDA error to the status code that tells the caller what to do:
// out of memory -> ResourceExhausted; a bad pointer, handle or value -> InvalidArgument;
// no usable device or driver -> NotFound; a sticky error (the context is unusable until
// the process restarts: an illegal address, an uncorrectable ECC error, a contained
// NVLink fault) ->
// FailedPrecondition; anything else -> Unavailable. The message names the call, the error and CUDA's description.
absl::Status CudaError(cudaError_t err, absl::string_view what);

// Unique ownership of a handle `T` released by `Release(T)`.
template <typename T, void (*Release)(T)>
class CudaHandle {
 public:
  CudaHandle() = default;
  explicit CudaHandle(T h) : h_(h) {}
  ~CudaHandle() { Reset(); }
  CudaHandle(CudaHandle&& o) noexcept : h_(std::exchange(o.h_, T{})) {}
  CudaHandle& operator=(CudaHandle&& o) noexcept {
    if (this != &o) {
      Reset();
      h_ = std::exchange(o.h_, T{});
    }
    return *this;
  }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;

  T get() const { return h_; }
  explicit operator bool() const { return h_ != T{}; }
  void Reset() {
    if (h_ != T{}) Release(std::exchange(h_, T{}));
  }

 private:
  T h_{};
};

namespace cuda_release {
inline void Stream(cudaStream_t s) { cudaStreamDestroy(s); }
inline void Event(cudaEvent_t e) { cudaEventDestroy(e); }
inline void Device(void* p) { cudaFree(p); }
inline void Pinned(void* p) { cudaHostUnregister(p); }
inline void Ipc(void* p) { cudaIpcCloseMemHandle(p); }
}  // namespace cuda_release

// A non-blocking stream (does not synchronise with the legacy default stream).
class CudaStream : public CudaHandle<cudaStream_t, cuda_release::Stream> {
 public:
  using CudaHandle::CudaHandle;
  static absl::StatusOr<CudaStream> Create();
};

// An event without timing (cheapest to record and wait for).
class CudaEvent : public CudaHandle<cudaEvent_t, cuda_release::Event> {
 public:
  using CudaHandle::CudaHandle;
  static absl::StatusOr<CudaEvent> Create();
  // Another process's event (cudaEventInterprocess), from its IPC handle.
  static absl::StatusOr<CudaEvent> OpenIpc(const cudaIpcEventHandle_t& handle);
};

// cudaMalloc'd device memory.
class CudaDeviceMemory : public CudaHandle<void*, cuda_release::Device> {
 public:
  using CudaHandle::CudaHandle;
  static absl::StatusOr<CudaDeviceMemory> Create(size_t bytes);
};

// Host memory page-locked in place with cudaHostRegister.
class CudaPinnedRange : public CudaHandle<void*, cuda_release::Pinned> {
 public:
  using CudaHandle::CudaHandle;
  static absl::StatusOr<CudaPinnedRange> Create(void* p, size_t bytes);
};

// Another process's device memory, opened from its IPC handle.
class CudaIpcMapping : public CudaHandle<void*, cuda_release::Ipc> {
 public:
  using CudaHandle::CudaHandle;
  static absl::StatusOr<CudaIpcMapping> Open(const cudaIpcMemHandle_t& handle);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_CUDA_CUDA_RAII_H_
