// LayoutRegistry: the registered layouts, namespace id -> LayoutSpec. A layout is
// validated and bounded (its chunk must fit max_chunk_bytes) when registered, and
// persisted in the SSD tier when there is one, so that clients' namespaces survive a
// restart. Registering the same layout again is not an error (already_registered).
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_LAYOUT_REGISTRY_H_
#define KVTIER_STORAGE_LAYOUT_REGISTRY_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "storage/layout_spec.h"
#include "storage/ssd_tier.h"

namespace kvtier {

class LayoutRegistry {
 public:
  // `ssd` may be null (nothing persisted); it must outlive the registry.
  // `max_chunk_bytes`: the largest chunk a layout may have. `max_layouts`: the most
  // layouts registered at once (0: no bound); layouts are kept until the data directory
  // is cleared, so this bounds what clients can make the daemon keep and persist.
  LayoutRegistry(SsdTier* ssd, uint64_t max_chunk_bytes, uint64_t max_layouts = 0)
      : ssd_(ssd), max_chunk_bytes_(max_chunk_bytes), max_layouts_(max_layouts) {}

  // Reads the persisted layouts (no-op without an SSD tier); unreadable rows are skipped
  // with a warning. A layout whose chunk is now over max_chunk_bytes (a smaller
  // capacity than when it was registered) is kept, with a warning: its chunks can still
  // be read, but not put (CheckPuttable). Returns: Ok, Unavailable.
  absl::Status Load();
  // Ok if chunks of `layout` may be put now, else FailedPrecondition (larger than
  // max_chunk_bytes: a layout registered with larger capacities; as Register answers
  // such a layout, and no retry can help).
  absl::Status CheckPuttable(const LayoutSpec& layout) const;

  struct Registered {
    uint64_t namespace_id = 0;
    uint64_t chunk_bytes = 0;
    bool already_registered = false;
  };
  // Returns: Ok, InvalidArgument, FailedPrecondition (chunk larger than allowed, or
  // max_layouts others registered already), Unavailable (could not persist).
  // `ns` is the namespace id to register it under; 0: the layout's own hash (a
  // tenant's namespaces use other ids, see server/tenant_scope.h).
  absl::StatusOr<Registered> Register(const LayoutSpec& layout, uint64_t ns = 0);
  // Returns: Ok, NotFound.
  absl::StatusOr<LayoutSpec> Find(uint64_t ns) const;
  size_t size() const;
  // Every registered layout and the namespace it is registered under. O(layouts).
  std::vector<std::pair<uint64_t, LayoutSpec>> All() const;

 private:
  SsdTier* const ssd_;
  const uint64_t max_chunk_bytes_;
  const uint64_t max_layouts_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, LayoutSpec> layouts_ ABSL_GUARDED_BY(mu_);
  // New layouts being persisted now: counted against max_layouts with the others.
  uint64_t registering_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_LAYOUT_REGISTRY_H_
