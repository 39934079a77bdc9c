// DeviceGetReactor: a Get whose target is a worker's GPU memory (a region registered
// with RegionAddDevice). Each item (a key's layers, or in layer-major order one layer of
// one key) is copied by the store's GPU tier straight into the worker's memory:
// device-to-device from the staging buffers, or host-to-device from the pinned pool
// with the CRC32C checked during the DMA. Up to kWindow items are in flight at once, on
// the GPU's copy streams; each item's frame (no data, last = true, `tier` saying where
// the bytes came from) is sent in item order once that item's bytes have landed, so a
// worker can start computing on a layer as soon as its frame arrives. A later pass's
// item is copied only once its key's first item was found. The call ends (even on an
// error or a cancel) only when no copy is still writing into the worker's memory.
//
// Frames follow GetFrame's protocol: an absent chunk gets found = false once (in
// layer-major order, in the first pass only; later passes leave it out). A chunk found
// in the first pass is held in RAM for the rest of the call, so later passes find it;
// one that left anyway (not in RAM when first delivered, then evicted or deleted) ends
// the call UNAVAILABLE. Any other failure (a corrupt chunk, a device error, a
// destination the device refuses) ends the call with that status. crc32c is 0 in the
// frames: the daemon has checked it.
//
// With target.record_events (a region registered with events) item i's copies are
// followed on the device by a record of the region's event i, and its frame
// (in_flight = true) is sent once they are queued rather than landed: the worker's
// GPU waits on the event, not its host on the frame. The call's status, sent once
// every copy has landed and been checked, is the verdict on them all. The region's
// events are lent to this call until its status is sent (one such Get per region at a
// time: another is ABORTED).
//
// Thread-safety: gRPC calls the reactions one at a time; store callbacks (GPU
// completion threads) run concurrently with them; all state is under mu_. The reactor
// deletes itself once OnDone has run and no store callback is outstanding.
#ifndef KVTIER_SERVER_DEVICE_GET_REACTOR_H_
#define KVTIER_SERVER_DEVICE_GET_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/authenticator.h"
#include "server/get_plan.h"
#include "server/lease_table.h"
#include "server/region_table.h"
#include "server/region_target.h"
#include "server/rpc_metrics.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "storage/tiered_store.h"

namespace kvtier {

class DeviceGetReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  static constexpr size_t kWindow = 8;

  // `req` was parsed by the caller and names a device region. `store` may be null
  // (starting up: UNAVAILABLE). `place` is the call's place among max_streams, given
  // back as the call finishes. `stalls` (may be null) cancels the call when a frame
  // waits longer than its idle time for a client that stopped reading; waiting on the
  // device (copies in flight) is not idle. Both are the reactor's from the start, before
  // any delivery can complete (and finish the call) on the device's thread. Everything
  // given must outlive the call. `still_admitted` (may be empty) is asked before each
  // chunk's first copy is issued; an error ends the call with it.
  DeviceGetReactor(grpc::CallbackServerContext* ctx, const v1::GetRequest& req,
                   TieredStore* store, RpcMetrics* metrics, LeaseTable* leases,
                   RegionTable* regions, uint64_t max_frame_bytes, uint32_t max_keys,
                   StreamLimiter::Ticket place = {}, StallReaper* stalls = nullptr,
                   StillAdmitted still_admitted = nullptr);

  void OnCancel() override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  absl::Status Start(const v1::GetRequest& req, LeaseTable* leases, RegionTable* regions,
                     uint64_t max_frame_bytes, uint32_t max_keys);
  // Issues deliveries up to the window, writes the next finished item's frame, or
  // finishes the call. Call without mu_.
  void Pump();
  void OnDelivered(size_t item, absl::StatusOr<Tier> result);
  // record_events: item's copies (and its event's record) are on the device's stream.
  void OnEnqueued(size_t item, Tier from);
  // The tier key `key`'s first item came from, once it is known (landed, or queued
  // with record_events).
  std::optional<Tier> FirstPassTier(uint32_t key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the loan of the region's events (record_events), once.
  void ReturnEvents() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `item` is its key's first (chunk-major: its only) item.
  bool FirstItemOfKey(size_t item) const;

  grpc::CallbackServerContext* const ctx_;
  TieredStore* const store_;
  RpcMetrics::Scope scope_;
  // Set in Start, before any other thread sees the reactor; read-only after.
  GetPlan plan_;
  // Per key: fetched ahead from the remote tier (TieredStore::FetchRemoteAsync).
  std::vector<bool> remote_ahead_;
  ResolvedDeviceTarget target_;
  std::vector<ChunkView> lease_hold_;
  bool record_events_ = false;  // target.record_events, the region's events lent to us.

  absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<absl::StatusOr<Tier>>> results_ ABSL_GUARDED_BY(mu_);
  // record_events: per item, where its queued copies come from.
  std::vector<std::optional<Tier>> enqueued_ ABSL_GUARDED_BY(mu_);
  bool events_lent_ ABSL_GUARDED_BY(mu_) = false;
  // Per key: found by its first item (later passes then must find it too).
  std::vector<bool> found_ ABSL_GUARDED_BY(mu_);
  // Layer-major: chunks found in the first pass, held in RAM for the later passes.
  std::vector<ChunkView> held_ ABSL_GUARDED_BY(mu_);
  // Per key: the meta of the copy its first item delivered (ReadToDeviceAsync's pin),
  // which its later items must deliver too: not two copies' layers in one chunk. Sized
  // once, before any delivery; each element is written by its key's first delivery and
  // read by its later ones, issued only after that one has reported (under mu_).
  std::vector<std::optional<ChunkMeta>> pins_;
  size_t next_issue_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_write_ ABSL_GUARDED_BY(mu_) = 0;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // Deliveries whose callback has not returned.
  int copies_ ABSL_GUARDED_BY(mu_) = 0;     // Deliveries whose copy has not completed.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // OnDone has run.
  grpc::ByteBuffer frame_;                  // The frame being written.
  // Among max_streams; given back as the call finishes, before the client can see its
  // status, so that a client's next call finds it free.
  StreamLimiter::Ticket place_;
  StallReaper::Watched stall_;
  StillAdmitted still_admitted_ ABSL_GUARDED_BY(mu_);  // May be empty.
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_DEVICE_GET_REACTOR_H_
