// ResolveRegionTarget: checks a RegionTarget (GetRequest.target, PrefillOpen.target)
// against the registered regions and returns where each key's bytes go.
//
// Thread-safety: a pure function over the thread-safe RegionTable.
#ifndef KVTIER_SERVER_REGION_TARGET_H_
#define KVTIER_SERVER_REGION_TARGET_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/region_table.h"

namespace kvtier {

struct ResolvedTarget {
  std::shared_ptr<const MappedRegion> region;  // Held for the call.
  std::vector<char*> dest;                     // Key i's bytes go to dest[i].
};

// `keys` keys of `key_bytes` bytes each. `regions` null means the daemon has no data
// plane. Returns: Ok, FailedPrecondition (no data plane, unknown region),
// PermissionDenied (wrong token), InvalidArgument (offsets: wrong count, out of the
// region, overflowing, or overlapping), each naming the field.
absl::StatusOr<ResolvedTarget> ResolveRegionTarget(RegionTable* regions,
                                                   const v1::RegionTarget& target,
                                                   size_t keys, uint64_t key_bytes);

// What of ResolveRegionTarget needs no key size and has no side effect (nothing is
// populated): a data plane, no record_events, and the region `target` names, returned.
// Returns: Ok, FailedPrecondition, InvalidArgument, PermissionDenied, as
// ResolveRegionTarget.
absl::StatusOr<std::shared_ptr<const MappedRegion>> FindTargetRegion(
    RegionTable* regions, const v1::RegionTarget& target);

// The same for a worker's GPU memory (a region registered with RegionAddDevice).
struct ResolvedDeviceTarget {
  std::shared_ptr<const DeviceRegion> region;  // Held for the call.
  std::vector<DevicePtr> dest;                 // Key i's bytes go to dest[i].
};
absl::StatusOr<ResolvedDeviceTarget> ResolveDeviceTarget(RegionTable* regions,
                                                         const v1::RegionTarget& target,
                                                         size_t keys, uint64_t key_bytes);

// What of ResolveDeviceTarget needs no key size: a data plane and the device region
// `target` names, returned. Returns: Ok, FailedPrecondition (no data plane, unknown
// region), PermissionDenied (wrong token), as ResolveDeviceTarget.
absl::StatusOr<std::shared_ptr<const DeviceRegion>> FindDeviceTargetRegion(
    RegionTable* regions, const v1::RegionTarget& target);

// A Get of `items` items recording events into `region`: no more items than the region
// registered events. Returns: Ok, InvalidArgument (naming target.record_events).
absl::Status CheckEventCount(const v1::RegionTarget& target, size_t items,
                             const DeviceRegion& region);

// Key i's offset in a region of `region_bytes` bytes. Returns: Ok, InvalidArgument
// (wrong count, out of the region, overflowing, or overlapping).
absl::StatusOr<std::vector<uint64_t>> TargetOffsets(const v1::RegionTarget& target,
                                                    size_t keys, uint64_t key_bytes,
                                                    uint64_t region_bytes);

}  // namespace kvtier

#endif  // KVTIER_SERVER_REGION_TARGET_H_
