// RegionTable: the shared-memory regions clients registered, by id. Each region belongs
// to one region-socket connection (its owner) and is usable only with the random token
// that connection was told, so a client cannot name another client's memory. A transfer
// holds the region's shared_ptr for as long as it uses it (a call, a frame, a Prefill
// session). Removing a region is refused while one does, so that a remove answered OK
// means the daemon will not touch the memory again; its owner's connection closing
// forgets it at once, and a transfer still holding it finishes into the still-mapped
// memory (which the gone client no longer uses).
//
// Bounded: at most max_regions regions of at most max_region_bytes each mapped at once,
// whatever the number of clients; the table itself holds a few dozen bytes per region.
// A region forgotten while a transfer holds it stays counted (regions(), bytes(), the
// room for new ones) until that transfer lets go and it is unmapped: closing a
// connection and registering again cannot map more than the bound.
//
// Thread-safety: thread-safe (one mutex, never held during a copy).
#ifndef KVTIER_SERVER_REGION_TABLE_H_
#define KVTIER_SERVER_REGION_TABLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device_region.h"
#include "server/mapped_region.h"

namespace kvtier {

struct RegionTableOptions {
  uint32_t max_regions = 1024;
  uint64_t max_region_bytes = 64ull << 30;
};

class RegionTable {
 public:
  struct Added {
    uint64_t id = 0;
    uint64_t token = 0;
    uint64_t bytes = 0;
  };

  explicit RegionTable(RegionTableOptions options) : options_(options) {}

  const RegionTableOptions& options() const { return options_; }

  // Maps `fd` (see MappedRegion::Map) for connection `owner`. Returns: Ok,
  // InvalidArgument (the memfd), ResourceExhausted (max_regions are registered).
  absl::StatusOr<Added> Add(uint64_t owner, int fd, uint64_t expected_bytes);
  // Opens a worker's GPU memory from its CUDA IPC handle (see DeviceRegion::Open) for
  // connection `owner`. Returns: Ok, InvalidArgument, ResourceExhausted (max_regions).
  absl::StatusOr<Added> AddDevice(uint64_t owner, DeviceBackend* backend,
                                  absl::string_view ipc_handle, uint64_t expected_bytes,
                                  const std::vector<std::string>& event_handles = {});
  // Returns: Ok, NotFound (no such region of this owner), FailedPrecondition (a
  // transfer in flight holds it; nothing changed).
  absl::Status Remove(uint64_t owner, uint64_t id);
  // Forgets every region of `owner`; returns how many.
  int RemoveOwner(uint64_t owner);
  // The region, for one transfer. Returns: Ok, FailedPrecondition (unknown id: never
  // registered, or its owner went away), PermissionDenied (wrong token).
  // FailedPrecondition also for a device region.
  absl::StatusOr<std::shared_ptr<const MappedRegion>> Find(uint64_t id, uint64_t token) const;
  // The same for a device region (FailedPrecondition for host memory).
  absl::StatusOr<std::shared_ptr<const DeviceRegion>> FindDevice(uint64_t id,
                                                                 uint64_t token) const;
  // Whether region `id` is device memory (false for unknown ids), to route a transfer.
  bool IsDevice(uint64_t id) const;

  // Regions mapped, and their bytes: the registered ones and the forgotten ones that
  // transfers still hold.
  uint64_t regions() const;
  uint64_t bytes() const;

 private:
  struct Entry {
    uint64_t owner;
    uint64_t token;
    std::shared_ptr<const MappedRegion> region;  // Host memory, or
    std::shared_ptr<const DeviceRegion> device;  // a worker's GPU memory.
    uint64_t size() const { return region ? region->size() : device->size(); }
  };
  // A region its owner's connection forgot while transfers held it: mapped until the
  // last of them lets go (the table keeps no reference that would keep it mapped).
  struct Retired {
    std::weak_ptr<const MappedRegion> region;
    std::weak_ptr<const DeviceRegion> device;
    uint64_t bytes = 0;
    bool mapped() const { return !region.expired() || !device.expired(); }
  };
  // Drops the retired regions no transfer holds any more.
  void PruneRetired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckRoom() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Indexes a mapped region under a fresh id and token.
  absl::StatusOr<Added> Insert(Entry entry) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<const Entry*> FindEntry(uint64_t id, uint64_t token) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const RegionTableOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // Of regions_.
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_REGION_TABLE_H_
