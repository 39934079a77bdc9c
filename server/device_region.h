// DeviceRegion: a worker's GPU memory, registered on the region socket with its CUDA IPC
// handle and opened in the daemon's context. The daemon writes into it (Get) only
// through copies on its device backend, only within [base, base + size), where size is
// the allocation's size as the device reports it, never what the client claimed. The
// mapping is closed when the last transfer holding the region is done (the client may
// have exited meanwhile: CUDA keeps the memory alive until every importer closes it).
//
// Thread-safety: immutable after Open; the backend is thread-safe.
#ifndef KVTIER_SERVER_DEVICE_REGION_H_
#define KVTIER_SERVER_DEVICE_REGION_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/device_backend.h"

namespace kvtier {

class DeviceRegion {
 public:
  // Opens `handle` and checks the client's `expected_bytes` against the allocation.
  // Returns: Ok, InvalidArgument (not a handle, stale or foreign, or the allocation is
  // smaller than expected_bytes, or expected_bytes is 0 or above max_bytes),
  // ResourceExhausted, FailedPrecondition, Unavailable (the device's own errors).
  static absl::StatusOr<std::shared_ptr<const DeviceRegion>> Open(DeviceBackend* backend,
                                                                  absl::string_view handle,
                                                                  uint64_t expected_bytes,
                                                                  uint64_t max_bytes);
  ~DeviceRegion();
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;

  DevicePtr base() const { return base_; }
  // The registered size: what the client asked for (at most the allocation).
  uint64_t size() const { return size_; }

 private:
  DeviceRegion(DeviceBackend* backend, DevicePtr base, uint64_t size)
      : backend_(backend), base_(base), size_(size) {}

  DeviceBackend* const backend_;
  const DevicePtr base_;
  const uint64_t size_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_DEVICE_REGION_H_
