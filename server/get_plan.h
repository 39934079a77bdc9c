// GetPlan: a GetRequest checked against the daemon's limits and its namespace's layout,
// and cut into the items a Get stream delivers in order (a key's layers, or in
// layer-major order one layer of one key). Shared by the Get reactors (streamed and
// host-region: GetReactor; GPU-memory targets: DeviceGetReactor).
//
// Thread-safety: MakeGetPlan is a pure function; StartGet calls the thread-safe store
// and lease table.
#ifndef KVTIER_SERVER_GET_PLAN_H_
#define KVTIER_SERVER_GET_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/lease_table.h"
#include "server/region_table.h"
#include "storage/chunk_id.h"
#include "storage/layout_spec.h"
#include "storage/tiered_store.h"

namespace kvtier {

struct GetPlan {
  // One unit of the stream: layers [begin, end) of key `key`.
  struct Item {
    uint32_t key = 0;
    uint32_t begin = 0, end = 0;
  };
  // Most items one Get may stream (12 bytes each, planned up front): a layer-major Get
  // of many keys over a layout of very many layers is refused past it.
  static constexpr uint64_t kMaxItems = uint64_t{1} << 20;

  std::vector<ChunkId> ids;
  std::vector<Item> items;
  bool layer_major = false;
  uint32_t num_layers = 1;
  uint32_t first_layer = 0, end_layer = 1;
  uint64_t layer_bytes = 0;  // One layer of one chunk.
  uint64_t frame_bytes = 0;  // Data bytes per streamed frame.

  // Bytes each key delivers (its layers [first_layer, end_layer)).
  uint64_t KeyBytes() const { return layer_bytes * (end_layer - first_layer); }
};

// Data bytes per frame for a Get or Prefill asking for `requested` (0: unset) from a
// daemon whose frames carry at most `max_frame_bytes`. Unset, it is at most
// kStockFrameBytes: with the frame's other fields the message stays within gRPC's
// default 4 MiB receive limit, so a client generated with stock channel options reads
// every frame (one that raised its limit asks for larger frames). A multiple of the SSD
// tier's 256 KiB checksum pieces, so that a frame read from SSD reads each piece once.
inline constexpr uint64_t kStockFrameBytes = (4u << 20) - (256u << 10);
// The smallest frame a request may ask for (smaller requests get this): the least
// max_frame_size a daemon takes.
inline constexpr uint64_t kMinFrameBytes = 4u << 10;
uint64_t FrameBytesFor(uint32_t requested, uint64_t max_frame_bytes);

// What of `req` is wrong whatever the store holds, so checked before the store is asked
// (or known: starting up). Returns: Ok, InvalidArgument (naming the field: too many keys,
// a malformed key, an order this daemon does not know).
absl::Status CheckGetRequest(const v1::GetRequest& req, uint32_t max_keys);

// `req` for namespace layout `layout`. Returns: Ok, InvalidArgument (naming the field:
// too many keys, a malformed key, a bad layer range or order).
absl::StatusOr<GetPlan> MakeGetPlan(const v1::GetRequest& req, const LayoutSpec& layout,
                                    uint64_t max_frame_bytes, uint32_t max_keys);

// The start every Get reactor shares: the store is open, `req` parsed (null: its bytes
// were not a GetRequest), its namespace registered, and the plan made. `store` may be
// null. Returns: Ok, Unavailable (starting up), InvalidArgument, NotFound (namespace).
absl::StatusOr<GetPlan> StartGet(TieredStore* store, const v1::GetRequest* req,
                                 uint64_t max_frame_bytes, uint32_t max_keys);
// Takes the Lookup lease `req` names (if any, and live) into `hold`: from here the lease
// ends with the call, whatever happens. Last in a reactor's start, once nothing can
// refuse the Get any more: a refusal the client retries (a region's events in use)
// must not have used up its lease. `leases` may be null.
void TakeLease(LeaseTable* leases, const v1::GetRequest& req, std::vector<ChunkView>* hold);

// What of StartGet, and of ResolveRegionTarget for a target in host memory (`regions`
// null: no data plane) or DeviceGetReactor::Start for one in a worker's GPU memory, can
// fail for good, without their side effects: asked before a Get takes a stream place,
// so that a request that can never succeed is not told to retry (RESOURCE_EXHAUSTED)
// first. While `store` is null (starting up) the namespace, its layout and so the
// target's offsets (and a device target's event count) are not known yet, and not
// checked.
// Returns: Ok, InvalidArgument, NotFound (namespace), FailedPrecondition (no data plane,
// unknown region, a device target without a GPU), PermissionDenied (the region's token).
absl::Status CheckGet(TieredStore* store, RegionTable* regions, const v1::GetRequest* req,
                      uint64_t max_frame_bytes, uint32_t max_keys);

}  // namespace kvtier

#endif  // KVTIER_SERVER_GET_PLAN_H_
