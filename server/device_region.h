// DeviceRegion: a worker's GPU memory, registered on the region socket with its CUDA IPC
// handle and opened in the daemon's context. The daemon writes into it (Get) only
// through copies on its device backend, only within [base, base + size), where size is
// the allocation's size as the device reports it, never what the client claimed. The
// mapping is closed when the last transfer holding the region is done (the client may
// have exited meanwhile: CUDA keeps the memory alive until every importer closes it).
// The worker's IPC events registered with it (for RegionTarget.record_events) are open
// as long as the region, and lent to one Get at a time (TakeEvents).
//
// Thread-safety: immutable after Open but for the events' loan (atomic); the backend
// is thread-safe.
#ifndef KVTIER_SERVER_DEVICE_REGION_H_
#define KVTIER_SERVER_DEVICE_REGION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/device_backend.h"

namespace kvtier {

class DeviceRegion {
 public:
  static constexpr size_t kMaxEvents = 512;

  // Opens `handle` and checks the client's `expected_bytes` against the allocation,
  // then opens `event_handles` (at most kMaxEvents), all or none.
  // Returns: Ok, InvalidArgument (not a handle, stale or foreign, or the allocation is
  // smaller than expected_bytes, or expected_bytes is 0 or above max_bytes; an event
  // handle likewise, or too many), ResourceExhausted, FailedPrecondition, Unavailable
  // (the device's own errors).
  static absl::StatusOr<std::shared_ptr<const DeviceRegion>> Open(
      DeviceBackend* backend, absl::string_view handle, uint64_t expected_bytes,
      uint64_t max_bytes, const std::vector<std::string>& event_handles = {});
  ~DeviceRegion();
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;

  DevicePtr base() const { return base_; }
  // The registered size: what the client asked for (at most the allocation).
  uint64_t size() const { return size_; }
  // The events' ids (DeviceBackend::OpenIpcEvent), in registration order.
  const std::vector<uint64_t>& events() const { return events_; }

  // Lends the events to one Get: false while another holds them. ReturnEvents ends the
  // loan, once every record the Get queued has run.
  bool TakeEvents() const { return !events_lent_.exchange(true, std::memory_order_acq_rel); }
  void ReturnEvents() const { events_lent_.store(false, std::memory_order_release); }

 private:
  DeviceRegion(DeviceBackend* backend, DevicePtr base, uint64_t size,
               std::vector<uint64_t> events)
      : backend_(backend), base_(base), size_(size), events_(std::move(events)) {}

  DeviceBackend* const backend_;
  const DevicePtr base_;
  const uint64_t size_;
  const std::vector<uint64_t> events_;
  mutable std::atomic<bool> events_lent_{false};
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_DEVICE_REGION_H_
