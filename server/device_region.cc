#include "server/device_region.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<std::shared_ptr<const DeviceRegion>> DeviceRegion::Open(
    DeviceBackend* backend, absl::string_view handle, uint64_t expected_bytes,
    uint64_t max_bytes, const std::vector<std::string>& event_handles) {
  if (event_handles.size() > kMaxEvents) {
    return absl::InvalidArgumentError(absl::StrCat("device region: at most ", kMaxEvents,
                                                   " event handles, got ",
                                                   event_handles.size()));
  }
  if (expected_bytes == 0 || expected_bytes > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device region: bytes must be 1 to ", max_bytes, " (shm_max_region_bytes), got ",
        expected_bytes));
  }
  absl::StatusOr<DeviceBackend::IpcMemory> mem = backend->OpenIpcMemory(handle);
  if (!mem.ok()) {
    // A bad, stale or foreign handle is the client's (never worth a retry); the device
    // being out of memory or failing keeps its own code.
    const absl::StatusCode code =
        absl::IsInvalidArgument(mem.status()) || absl::IsNotFound(mem.status())
            ? absl::StatusCode::kInvalidArgument
            : mem.status().code();
    return absl::Status(code, absl::StrCat("device region: cannot open the IPC handle: ",
                                           mem.status().message()));
  }
  if (mem->bytes < expected_bytes) {
    backend->CloseIpcMemory(mem->base);
    return absl::InvalidArgumentError(absl::StrCat(
        "device region: the allocation behind the handle is ", mem->bytes,
        " bytes, smaller than the ", expected_bytes, " registered"));
  }
  std::vector<uint64_t> events;
  for (size_t i = 0; i < event_handles.size(); ++i) {
    absl::StatusOr<uint64_t> ev = backend->OpenIpcEvent(event_handles[i]);
    if (!ev.ok()) {
      for (uint64_t e : events) backend->CloseIpcEvent(e);
      backend->CloseIpcMemory(mem->base);
      // A bad handle is the client's; a device that cannot open IPC events here will
      // not on a retry either (only running out of resources may pass).
      const absl::StatusCode code =
          absl::IsInvalidArgument(ev.status()) || absl::IsNotFound(ev.status())
              ? absl::StatusCode::kInvalidArgument
          : absl::IsResourceExhausted(ev.status()) ? absl::StatusCode::kResourceExhausted
                                                   : absl::StatusCode::kFailedPrecondition;
      return absl::Status(code, absl::StrCat("device region: cannot open event_handles[", i,
                                             "]: ", ev.status().message()));
    }
    events.push_back(*ev);
  }
  return std::shared_ptr<const DeviceRegion>(
      new DeviceRegion(backend, mem->base, expected_bytes, std::move(events)));
}

DeviceRegion::~DeviceRegion() {
  for (uint64_t e : events_) backend_->CloseIpcEvent(e);
  backend_->CloseIpcMemory(base_);
}

}  // namespace kvtier
