// DeviceBackend: what kvtier needs from a GPU, behind an interface so that the GPU
// staging tier's logic runs against FakeDeviceBackend (tests/support) in ordinary tests
// and against CUDA (storage/cuda/cuda_device_backend.h) on a GPU host. No CUDA type
// appears here, so nothing outside storage/cuda/ includes a CUDA header.
//
// Device memory is named by DevicePtr, the device address as an integer. Copies are
// submitted as a list that runs in order on one of the backend's copy streams; the
// list's completion (or its first error) is reported once, on the backend's completion
// thread, after every byte of it has landed.
//
// Thread-safety: implementations are thread-safe. `done` callbacks run on a backend
// thread and must not block on other copies of the same backend.
#ifndef KVTIER_STORAGE_DEVICE_BACKEND_H_
#define KVTIER_STORAGE_DEVICE_BACKEND_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

using DevicePtr = uint64_t;

// kRecordEvent is no copy: it records an IPC event (DeviceBackend::OpenIpcEvent) on the
// list's stream at its place in the list, so that another process's stream waiting on
// that event runs once every copy before it has landed.
enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kRecordEvent };

// One copy of `bytes` bytes. Host addresses are pointers cast to integers; device
// addresses are DevicePtrs. Both ends must stay valid until the list's `done` has run.
struct DeviceCopy {
  CopyKind kind = CopyKind::kHostToDevice;
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;

  static DeviceCopy HostToDevice(DevicePtr dst, const void* src, uint64_t bytes) {
    return {CopyKind::kHostToDevice, dst, reinterpret_cast<uint64_t>(src), bytes};
  }
  static DeviceCopy DeviceToHost(void* dst, DevicePtr src, uint64_t bytes) {
    return {CopyKind::kDeviceToHost, reinterpret_cast<uint64_t>(dst), src, bytes};
  }
  static DeviceCopy DeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t bytes) {
    return {CopyKind::kDeviceToDevice, dst, src, bytes};
  }
  // `event`: an id from OpenIpcEvent, open until the list's `done` has run.
  static DeviceCopy RecordEvent(uint64_t event) { return {CopyKind::kRecordEvent, event, 0, 0}; }
};

// Merges neighbours of the same kind whose sources and destinations both continue each
// other, so that chunks whose pool slots happen to be adjacent move in one call. Drops
// empty copies; keeps every event record in its place.
std::vector<DeviceCopy> CoalesceCopies(std::vector<DeviceCopy> copies);

// A CUDA IPC memory or event handle: 64 opaque bytes made by the exporting process.
inline constexpr size_t kIpcHandleBytes = 64;

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // For logs: "NVIDIA H100 80GB HBM3 (device 0, 79.1 GiB)".
  virtual std::string Describe() const = 0;

  // Device memory. Returns: Ok, ResourceExhausted (out of device memory), Unavailable
  // (device error).
  virtual absl::StatusOr<DevicePtr> Allocate(uint64_t bytes) = 0;
  virtual void Free(DevicePtr ptr) = 0;

  // Page-locks host memory [p, p + bytes) so that copies from and to it run at the
  // link's full speed (and without a staging copy). Returns: Ok, ResourceExhausted or
  // Unavailable (the caller goes on unpinned, slower).
  virtual absl::Status PinHost(void* p, uint64_t bytes) = 0;
  virtual void UnpinHost(void* p) = 0;

  // Runs `copies` in order; calls `done` once: Ok when all landed, else the first
  // error (InvalidArgument for an address outside any allocation, Unavailable for a
  // device error). Never calls `done` on the submitting thread.
  virtual void Submit(std::vector<DeviceCopy> copies,
                      std::function<void(absl::Status)> done) = 0;

  // Whether SubmitAndCrc32c checks bytes on the device (where it does not, the caller
  // checks on the CPU and need not call it).
  virtual bool ChecksCrc32c() const { return false; }
  // Runs `copies` as Submit does and then, on the device after them, the CRC32C of
  // [at, at + bytes): `at` 16-byte aligned, `bytes` a non-zero multiple of
  // kDeviceCrcBlockBytes. `done` runs once with the copies' status and, when the check
  // ran, the standard CRC32C of those bytes (unset: it could not run now, e.g. no
  // room for its result; the caller checks elsewhere).
  static constexpr uint64_t kDeviceCrcBlockBytes = 64 << 10;
  struct CopiedAndChecked {
    absl::Status copy;
    std::optional<uint32_t> crc32c;
  };
  virtual void SubmitAndCrc32c(std::vector<DeviceCopy> copies, DevicePtr at, uint64_t bytes,
                               std::function<void(CopiedAndChecked)> done) {
    Submit(std::move(copies), [done = std::move(done)](absl::Status s) {
      done({std::move(s), std::nullopt});
    });
  }

  // Another process's device memory, from its IPC handle (kIpcHandleBytes bytes): its
  // base address here and the size of the allocation, as the device knows it (so a
  // client cannot make the daemon copy past the end of its memory by claiming more).
  // Returns: Ok, InvalidArgument (not a handle, or a stale or foreign one), Unavailable.
  struct IpcMemory {
    DevicePtr base = 0;
    uint64_t bytes = 0;
  };
  virtual absl::StatusOr<IpcMemory> OpenIpcMemory(absl::string_view handle) = 0;
  virtual void CloseIpcMemory(DevicePtr base) = 0;

  // Another process's event, from its IPC handle (cudaIpcGetEventHandle of an event
  // made with cudaEventInterprocess | cudaEventDisableTiming): an id for
  // DeviceCopy::RecordEvent, never 0. Returns: Ok, InvalidArgument (not a handle, or a
  // stale or foreign one), Unavailable.
  virtual absl::StatusOr<uint64_t> OpenIpcEvent(absl::string_view handle) = 0;
  // Closes it once no list that records it is in flight.
  virtual void CloseIpcEvent(uint64_t event) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_DEVICE_BACKEND_H_
