#include "storage/cuda/cuda_raii.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status CudaError(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(err), " (",
                                           cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorMapBufferObjectFailed:
    case cudaErrorHostMemoryAlreadyRegistered:
      return absl::InvalidArgumentError(message);
    // No device this process can use: none, or a driver that cannot drive it (a stub
    // library, one older than the runtime, a mismatch with the kernel module).
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::NotFoundError(message);
    // Sticky errors: the CUDA context is unusable until the process restarts, so no
    // retry against this daemon can succeed.
    case cudaErrorIllegalAddress:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorContained:  // E.g. a bad access to a peer GPU's memory over NVLink.
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorMpsClientTerminated:
      return absl::FailedPreconditionError(absl::StrCat(
          message, "; the GPU context is unusable until kvtierd restarts (gpu=off serves "
          "from RAM and SSD meanwhile)"));
    default:
      return absl::UnavailableError(message);
  }
}

absl::StatusOr<CudaStream> CudaStream::Create() {
  cudaStream_t s = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaError(e, "cudaStreamCreateWithFlags");
  }
  return CudaStream(s);
}

absl::StatusOr<CudaEvent> CudaEvent::Create() {
  cudaEvent_t ev = nullptr;
  if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess) {
    return CudaError(e, "cudaEventCreateWithFlags");
  }
  return CudaEvent(ev);
}

absl::StatusOr<CudaEvent> CudaEvent::OpenIpc(const cudaIpcEventHandle_t& handle) {
  cudaEvent_t ev = nullptr;
  if (cudaError_t e = cudaIpcOpenEventHandle(&ev, handle); e != cudaSuccess) {
    return CudaError(e, "cudaIpcOpenEventHandle (stale or foreign handle?)");
  }
  return CudaEvent(ev);
}

absl::StatusOr<CudaDeviceMemory> CudaDeviceMemory::Create(size_t bytes) {
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("cudaMalloc(", bytes, ")"));
  }
  return CudaDeviceMemory(p);
}

absl::StatusOr<CudaPinnedRange> CudaPinnedRange::Create(void* p, size_t bytes) {
  if (cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("cudaHostRegister(", bytes, " bytes)"));
  }
  return CudaPinnedRange(p);
}

absl::StatusOr<CudaIpcMapping> CudaIpcMapping::Open(const cudaIpcMemHandle_t& handle) {
  void* p = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return CudaError(e, "cudaIpcOpenMemHandle (stale or foreign handle?)");
  }
  return CudaIpcMapping(p);
}

}  // namespace kvtier
