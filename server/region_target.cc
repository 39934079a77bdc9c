#include "server/region_target.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<std::vector<uint64_t>> TargetOffsets(const v1::RegionTarget& target,
                                                    size_t keys, uint64_t key_bytes,
                                                    uint64_t region_bytes) {
  if (target.offsets_size() != 1 && static_cast<size_t>(target.offsets_size()) != keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target.offsets: ", target.offsets_size(), " offsets for ", keys,
        " keys; give one per key, or one for all of them back to back"));
  }
  std::vector<uint64_t> offsets;
  std::vector<std::pair<uint64_t, size_t>> starts;  // (offset, key), to find overlaps.
  starts.reserve(keys);
  offsets.reserve(keys);
  for (size_t k = 0; k < keys; ++k) {
    uint64_t off = 0;
    if (target.offsets_size() == 1) {
      const uint64_t base = target.offsets(0);
      if (k != 0 && key_bytes > (UINT64_MAX - base) / k) {
        return absl::InvalidArgumentError(absl::StrCat(
            "target.offsets[0]: key ", k, "'s destination overflows 64 bits"));
      }
      off = base + k * key_bytes;
    } else {
      off = target.offsets(static_cast<int>(k));
    }
    if (off > region_bytes || key_bytes > region_bytes - off) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target: key ", k, ": [", off, ", +", key_bytes, ") is outside the region of ",
          region_bytes, " bytes (each key needs ", key_bytes,
          " bytes: register a larger region, or ask for fewer keys)"));
    }
    offsets.push_back(off);
    starts.emplace_back(off, k);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i) {
    if (starts[i].first - starts[i - 1].first < key_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target.offsets: the destinations of keys ", starts[i - 1].second, " and ",
          starts[i].second, " overlap (each key needs ", key_bytes, " bytes)"));
    }
  }
  return offsets;
}

absl::StatusOr<std::shared_ptr<const MappedRegion>> FindTargetRegion(
    RegionTable* regions, const v1::RegionTarget& target) {
  if (regions == nullptr) {
    return absl::FailedPreconditionError(
        "target: this daemon serves no registered memory (shm_socket is off); use the stream");
  }
  if (target.record_events()) {  // Device regions go to ResolveDeviceTarget.
    return absl::InvalidArgumentError(absl::StrCat(
        "target.record_events: region ", target.region_id(),
        " is not GPU memory registered with this daemon; only a Get into a registered GPU "
        "region records events"));
  }
  return regions->Find(target.region_id(), target.token());
}

absl::StatusOr<ResolvedTarget> ResolveRegionTarget(RegionTable* regions,
                                                   const v1::RegionTarget& target,
                                                   size_t keys, uint64_t key_bytes) {
  auto region = FindTargetRegion(regions, target);
  if (!region.ok()) return region.status();
  ResolvedTarget out;
  out.region = *std::move(region);
  auto offsets = TargetOffsets(target, keys, key_bytes, out.region->size());
  if (!offsets.ok()) return offsets.status();
  out.dest.reserve(keys);
  for (size_t k = 0; k < keys; ++k) {
    auto dst = out.region->Range((*offsets)[k], key_bytes, absl::StrCat("target: key ", k));
    if (!dst.ok()) return dst.status();
    if (absl::Status s = out.region->Populate(*dst, key_bytes, MappedRegion::Access::kWrite);
        !s.ok()) {
      return s;
    }
    out.dest.push_back(*dst);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const DeviceRegion>> FindDeviceTargetRegion(
    RegionTable* regions, const v1::RegionTarget& target) {
  if (regions == nullptr) {
    return absl::FailedPreconditionError(
        "target: this daemon serves no registered memory (shm_socket is off); use the stream");
  }
  return regions->FindDevice(target.region_id(), target.token());
}

absl::Status CheckEventCount(const v1::RegionTarget& target, size_t items,
                             const DeviceRegion& region) {
  if (items > region.events().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target.record_events: the Get has ", items,
        " items (keys, times layers in layer-major order) but region ", target.region_id(),
        " registered ", region.events().size(), " events"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ResolvedDeviceTarget> ResolveDeviceTarget(RegionTable* regions,
                                                         const v1::RegionTarget& target,
                                                         size_t keys, uint64_t key_bytes) {
  auto region = FindDeviceTargetRegion(regions, target);
  if (!region.ok()) return region.status();
  ResolvedDeviceTarget out;
  out.region = *std::move(region);
  auto offsets = TargetOffsets(target, keys, key_bytes, out.region->size());
  if (!offsets.ok()) return offsets.status();
  for (uint64_t off : *offsets) out.dest.push_back(out.region->base() + off);
  return out;
}

}  // namespace kvtier
