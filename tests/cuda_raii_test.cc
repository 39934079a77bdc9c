// CudaError's mapping of CUDA errors to the status codes of the proto's contract: a pure
// function, so it runs without a GPU (the runtime names errors without a driver).
#include "storage/cuda/cuda_raii.h"

#include "gtest/gtest.h"

namespace kvtier {
namespace {

// Errors after which the CUDA context is unusable until the process restarts: a retry
// against this daemon can never succeed, so the answer must not say "retry"
// (UNAVAILABLE). Each of these was once answered UNAVAILABLE.
TEST(CudaErrorTest, StickyErrorsAreFailedPrecondition) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorECCUncorrectable,
                        cudaErrorContained, cudaErrorLaunchTimeout, cudaErrorAssert,
                        cudaErrorInvalidAddressSpace, cudaErrorTensorMemoryLeak,
                        cudaErrorNvlinkUncorrectable, cudaErrorMpsClientTerminated}) {
    const absl::Status s = CudaError(e, "cudaMemcpyAsync");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("restarts"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("cudaMemcpyAsync"), absl::string_view::npos) << s;
  }
}

TEST(CudaErrorTest, NoUsableDeviceIsNotFoundAndTheRestKeepTheirCodes) {
  for (cudaError_t e : {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorStubLibrary,
                        cudaErrorSystemDriverMismatch, cudaErrorCompatNotSupportedOnDevice}) {
    EXPECT_EQ(CudaError(e, "x").code(), absl::StatusCode::kNotFound) << e;
  }
  EXPECT_TRUE(CudaError(cudaSuccess, "x").ok());
  EXPECT_EQ(CudaError(cudaErrorMemoryAllocation, "x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaError(cudaErrorInvalidValue, "x").code(), absl::StatusCode::kInvalidArgument);
  // Devices busy (exclusive-process mode): may free up.
  EXPECT_EQ(CudaError(cudaErrorDevicesUnavailable, "x").code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvtier
