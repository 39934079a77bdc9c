// The CUDA device backend on a real GPU (CTest label `gpu`): copies in every direction,
// page-locking, the staging tier on real device memory, and the errors a worker can
// cause (a bad IPC handle, a copy to a wild address, more memory than the GPU has).
// Without a GPU (or a driver) every test skips; `ctest -L gpu` on a GPU host runs them.
#include "storage/cuda/cuda_device_backend.h"

#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "storage/gpu_staging_tier.h"
#include "storage/lru_policy.h"

namespace kvtier {
namespace {

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = OpenCudaBackend({});
    if (absl::IsNotFound(backend.status())) {
      GTEST_SKIP() << "no GPU: " << backend.status();
    }
    // Every device taken (exclusive-process mode on a shared machine): none to test on.
    if (absl::StrContains(backend.status().message(), "cudaErrorDevicesUnavailable")) {
      GTEST_SKIP() << "no GPU free: " << backend.status();
    }
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }

  absl::Status Run(std::vector<DeviceCopy> copies) {
    absl::Notification done;
    absl::Status result;
    backend_->Submit(std::move(copies), [&](absl::Status s) {
      result = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    return result;
  }

  std::unique_ptr<DeviceBackend> backend_;
};

TEST_F(CudaBackendTest, BytesRoundTripThroughDeviceMemory) {
  constexpr uint64_t kBytes = 8 << 20;
  std::string src(kBytes, '\0');
  for (uint64_t i = 0; i < kBytes; ++i) src[i] = static_cast<char>(i * 131 >> 5);
  std::string back(kBytes, '\0');
  ASSERT_TRUE(backend_->PinHost(src.data(), kBytes).ok());
  auto a = backend_->Allocate(kBytes);
  auto b = backend_->Allocate(kBytes);
  ASSERT_TRUE(a.ok() && b.ok());
  // Host to device in two pieces, device to device, device to host (pageable).
  ASSERT_TRUE(Run({DeviceCopy::HostToDevice(*a, src.data(), kBytes / 2),
                   DeviceCopy::HostToDevice(*a + kBytes / 2, src.data() + kBytes / 2,
                                            kBytes / 2),
                   DeviceCopy::DeviceToDevice(*b, *a, kBytes),
                   DeviceCopy::DeviceToHost(back.data(), *b, kBytes)})
                  .ok());
  EXPECT_TRUE(back == src);
  backend_->UnpinHost(src.data());
  backend_->Free(*a);
  backend_->Free(*b);
}

TEST_F(CudaBackendTest, WorkerErrorsAreClearStatusesAndTheDeviceKeepsWorking) {
  // More memory than any GPU has.
  EXPECT_EQ(backend_->Allocate(1ull << 50).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Not an IPC handle; a handle of zeros (stale or foreign).
  EXPECT_EQ(backend_->OpenIpcMemory("short").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(backend_->OpenIpcMemory(std::string(kIpcHandleBytes, '\0')).ok());
  // And a normal copy still works.
  auto a = backend_->Allocate(4096);
  ASSERT_TRUE(a.ok());
  std::string src(4096, 'k'), back(4096, '\0');
  EXPECT_TRUE(Run({DeviceCopy::HostToDevice(*a, src.data(), 4096),
                   DeviceCopy::DeviceToHost(back.data(), *a, 4096)})
                  .ok());
  EXPECT_EQ(back, src);
  backend_->Free(*a);
}

TEST_F(CudaBackendTest, StagingTierOnRealDeviceMemory) {
  GpuStagingOptions options;
  options.capacity_bytes = 16 << 20;
  auto tier = GpuStagingTier::Create(options, backend_.get(), std::make_unique<LruPolicy>());
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto bytes = std::make_shared<std::string>(5 << 20, '\0');
  for (size_t i = 0; i < bytes->size(); ++i) (*bytes)[i] = static_cast<char>(i * 7 + 3);
  ChunkMeta meta;
  meta.size = bytes->size();
  const ChunkId id{1, ChunkKey{2, 3}};
  absl::Notification staged;
  absl::Status stage_status;
  (*tier)->Stage(id, meta, {absl::string_view(*bytes)}, bytes, [&](absl::Status s) {
    stage_status = s;
    staged.Notify();
  });
  staged.WaitForNotification();
  ASSERT_TRUE(stage_status.ok()) << stage_status;
  std::string back(bytes->size(), '\0');
  absl::Notification copied;
  absl::Status copy_status;
  (*tier)->CopyToHost(id, meta, back.data(), [&](absl::Status s) {
    copy_status = s;
    copied.Notify();
  });
  copied.WaitForNotification();
  ASSERT_TRUE(copy_status.ok()) << copy_status;
  EXPECT_TRUE(back == *bytes);
}

// The CRC32C check on the device (a build with GPU kernels: the backend's self-test must
// have passed, or checks would silently stay on the CPU): what landed, checked after
// the copies, equals the CPU's CRC32C for sizes of one block, odd block counts, and more
// blocks than the combining kernel has threads; a flipped byte changes it.
TEST_F(CudaBackendTest, Crc32cOnTheDeviceIsTheCpusCrc32c) {
#ifndef KVTIER_HAVE_CUDA_KERNELS
  GTEST_SKIP() << "this build has no GPU kernels";
#endif
  ASSERT_TRUE(backend_->ChecksCrc32c()) << "the device's CRC32C self-test failed";
  // A failed call earlier on this thread (a worker's bad IPC handle) leaves the CUDA
  // runtime's last error set; the checks must not read it as their own.
  EXPECT_FALSE(backend_->OpenIpcMemory(std::string(kIpcHandleBytes, '\0')).ok());
  constexpr uint64_t kBlock = DeviceBackend::kDeviceCrcBlockBytes;
  for (uint64_t blocks : {1u, 3u, 1025u, 2048u, 5000u}) {
    const uint64_t bytes = blocks * kBlock;
    std::string src(bytes, '\0');
    for (uint64_t i = 0; i < bytes; ++i) src[i] = static_cast<char>((i * 2654435761u) >> 13);
    auto dst = backend_->Allocate(bytes);
    ASSERT_TRUE(dst.ok());
    for (bool flip : {false, true}) {
      if (flip) src[bytes / 3] ^= 4;
      absl::Notification done;
      DeviceBackend::CopiedAndChecked got;
      backend_->SubmitAndCrc32c({DeviceCopy::HostToDevice(*dst, src.data(), bytes)}, *dst, bytes,
                                [&](DeviceBackend::CopiedAndChecked r) {
                                  got = std::move(r);
                                  done.Notify();
                                });
      done.WaitForNotification();
      ASSERT_TRUE(got.copy.ok()) << got.copy;
      ASSERT_TRUE(got.crc32c.has_value()) << blocks;
      EXPECT_EQ(*got.crc32c, crc32c::Value(src)) << blocks << " blocks, flip " << flip;
    }
    backend_->Free(*dst);
  }
}

}  // namespace
}  // namespace kvtier
