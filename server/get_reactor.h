// GetReactor: serves one Get call on gRPC's callback API with raw byte buffers, so that
// chunk bytes go from the RAM pool to the socket without a copy: each frame is a small
// serialized header (every GetFrame field but `data`, then data's tag and length) plus
// gRPC slices that point into the pool, each holding a reference on the chunk until
// gRPC is done with it. Protobuf accepts fields in any order, so clients parse the
// frames as ordinary GetFrame messages.
//
// An SSD chunk that finds no room in RAM is streamed: its frames are read from SSD a
// frame at a time, up to kReadahead frames ahead of the one being sent, into buffers
// from the store's stream budget (stream_buffer_bytes), so the first bytes leave after
// one frame's read and memory outside the pool stays bounded however large the chunk.
// The chunk's CRC32C is checked over the bytes as they are sent; a mismatch found at the
// last frame ends the call DATA_LOSS (the client, which checks the CRC too, never
// accepts the bytes) and the chunk is deleted. A chunk deleted from SSD mid-stream ends
// the call ABORTED.
//
// Layer-major order (GetRequest.order) sends the same bytes as pieces, one layer of one
// chunk each: layer `first` of every key, then the next layer of every key, and so on.
// The reactor walks a list of items (key, layer range): one per key in chunk-major order,
// one per (layer, key) in layer-major order. A key's chunk is found at its first item
// and, in layer-major order, held (its pool slots referenced, or its SSD location) until
// its last item is sent, so all of a key's pieces come from one stored chunk and a chunk
// is promoted from SSD at most once per call. An absent key is answered once, at its
// first item, and its later items are skipped.
//
// Region target (GetRequest.target, same-host clients): instead of sending an item's
// bytes, the reactor copies them into the client's registered region, checking the
// CRC32C of the pool's bytes in the same pass, and sends one header-only frame per item
// once they are all in place (and, at a whole chunk's last item, verified). Copies run
// under mu_ on the thread that drives the reactor; no other event of this call waits on
// them (reads are issued only for the item being copied, after the copy of a frame).
//
// Turns (SendTurns, option get_send_turns): each frame of a RAM item (not a streamed
// chunk, a region copy or a header-only frame) is written holding a turn. The reactor
// takes one at the item's first frame, or waits in line for one (no thread waits), keeps
// it while the item's frames go out (a slow or stalled client gives it up and sends the
// rest of the item without one), and gives it back when the item's last frame is
// written.
//
// Thread-safety: events arrive on gRPC's callback threads (write done, cancel), the
// store's read threads (reads done) and whichever thread gave this call a turn; each
// takes mu_, updates the state and, with mu_ released, starts at most one write or read.
// gRPC threads never wait for the SSD. The reactor is deleted when gRPC is done with it
// (OnDone) and no store callback (nor awaited turn) is outstanding.
#ifndef KVTIER_SERVER_GET_REACTOR_H_
#define KVTIER_SERVER_GET_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <deque>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/authenticator.h"
#include "server/lease_table.h"
#include "server/get_plan.h"
#include "server/region_table.h"
#include "server/send_turns.h"
#include "server/rpc_metrics.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "storage/parallel_copy.h"
#include "storage/tiered_store.h"

namespace kvtier {

class GetReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                         private SendTurns::Waiter {
 public:
  // Frames of a streamed chunk read ahead of the one being sent.
  static constexpr int kReadahead = 4;

  // `store` may be null (still starting: the call fails UNAVAILABLE). `metrics`,
  // `leases` and `regions` may be null (no regions: a target is FAILED_PRECONDITION);
  // so may `copier`, which copies a RAM chunk into a region on several threads.
  // All must outlive the call. A lease the request names is taken
  // from `leases` at the start and its chunks held until the call ends.
  // `request` is the parsed GetRequest, or null when the bytes were not one.
  // `place` is the call's place among max_streams, given back as the call finishes.
  // `stalls` (may be null; must outlive the call) cancels the call when its client stops
  // reading: a frame's write held back by flow control for longer than its idle time.
  // Both are the reactor's before it starts any work that can finish the call on
  // another thread. `turns` (may be null: no turns; must outlive the call) paces the
  // sending of RAM chunks. `still_admitted` (may be empty) is asked before each chunk
  // is started; an error ends the call with it.
  GetReactor(grpc::CallbackServerContext* ctx, const v1::GetRequest* request,
             TieredStore* store, RpcMetrics* metrics, LeaseTable* leases,
             RegionTable* regions, ParallelCopy* copier, uint64_t max_frame_bytes,
             uint32_t max_keys, StreamLimiter::Ticket place = {},
             StallReaper* stalls = nullptr, SendTurns* turns = nullptr,
             StillAdmitted still_admitted = nullptr);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // One frame of a streamed chunk: its byte range, then its bytes once read.
  struct Pending {
    uint64_t off = 0, len = 0;
    bool ready = false;
    absl::Status status;
    TieredStore::RangeBuffer buf;
  };

  using Item = GetPlan::Item;

  absl::Status Start(const v1::GetRequest* request, LeaseTable* leases,
                     RegionTable* regions, uint64_t max_frame_bytes, uint32_t max_keys);
  // Region target: copies bytes [off, off + n) of the current item's chunk from `src`
  // pieces into the region, extending the key's CRC.
  void CopyToRegion(uint64_t off, absl::Span<const absl::string_view> pieces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Region target: the current item is in the region. Checks a whole chunk's CRC at its
  // last item, then builds the item's header-only frame into frame_. False on a CRC
  // mismatch (error_ is set).
  bool FinishRegionItem() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves item_ to the next item whose key is not known to be absent.
  void NextItem() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the current item's chunk (found, or held from an earlier item) as view_, and
  // sets its byte range. Call with view set.
  void BeginItem(ChunkView view) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when the current item is the last of its key.
  bool LastItemOfKey() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tier a frame of `key` reports: view_'s, or the remote tier's for a chunk the
  // store fetched from it ahead of this Get.
  v1::Tier FrameTier(uint32_t key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decides the next step and takes it: a write, reads, or the end. Call without mu_.
  void Pump();
  void OnChunk(absl::StatusOr<ChunkView> view);
  void OnRange(uint64_t off, absl::StatusOr<TieredStore::RangeBuffer> buf);
  // Builds the frame of bytes [off_, off_ + n) of the current key into frame_.
  void BuildFrame(uint64_t n, const std::shared_ptr<const void>& keep,
                  absl::Span<const absl::string_view> pieces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a store callback (after its last use of the reactor); the last one after
  // OnDone deletes the reactor.
  void StoreCallbackDone();
  // SendTurns::Waiter: this call's turn came; it counts as a store callback while awaited.
  void TurnGranted() override;

  grpc::CallbackServerContext* const ctx_;
  TieredStore* const store_;
  RpcMetrics::Scope scope_;
  std::vector<ChunkId> ids_;
  std::vector<Item> items_;
  // Per key: missing locally at the start and fetched ahead from the remote tier
  // (TieredStore::FetchRemoteAsync; empty when none were). Set in Start.
  std::vector<bool> remote_ahead_;
  // The chunks of the Lookup lease the request named: held (not evicted) until the
  // reactor is destroyed. Set in Start, before any other thread sees the reactor.
  std::vector<ChunkView> lease_hold_;
  bool layer_major_ = false;
  uint32_t num_layers_ = 1;
  uint32_t first_layer_ = 0, end_layer_ = 1;
  uint64_t key_bytes_ = 0;  // What each key sends (its layer range).
  uint64_t frame_bytes_ = 0;
  // Region target: the region (held for the call) and where each key's bytes go.
  std::shared_ptr<const MappedRegion> region_;
  std::vector<char*> dest_;
  ParallelCopy* const copier_;  // May be null: region copies run on this thread.
  SendTurns* const turns_;      // May be null: RAM chunks are sent without turns.

  absl::Mutex mu_;
  StillAdmitted still_admitted_ ABSL_GUARDED_BY(mu_);  // May be empty.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;   // A write (frame_) is in flight.
  bool reading_ ABSL_GUARDED_BY(mu_) = false;   // The current key's chunk is being found.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish() was called.
  bool done_ ABSL_GUARDED_BY(mu_) = false;      // OnDone() was called.
  // OnCancel() was called: the call ends at its next step (it may come while a chunk is
  // being found, before this call joins turns_'s line).
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // Reads whose callback has not run, and a turn awaited (turn_wait_).
  int store_callbacks_ ABSL_GUARDED_BY(mu_) = 0;
  bool turn_wait_ ABSL_GUARDED_BY(mu_) = false;  // In turns_'s line.
  // The frame in flight is the last of a RAM item: its write done gives the turn back.
  bool turn_ends_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);     // Ends the call once no write is in flight.
  size_t item_ ABSL_GUARDED_BY(mu_) = 0;         // Item being sent.
  std::optional<ChunkView> view_ ABSL_GUARDED_BY(mu_);  // Its chunk, once found.
  // Layer-major order, per key: the chunk, held from its first item to its last; whether
  // it was answered absent; the CRC32C of its streamed bytes so far.
  std::vector<std::optional<ChunkView>> held_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> absent_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> key_crc_ ABSL_GUARDED_BY(mu_);
  // Byte range of the key, next offset to send.
  uint64_t begin_ ABSL_GUARDED_BY(mu_) = 0, end_ ABSL_GUARDED_BY(mu_) = 0,
           off_ ABSL_GUARDED_BY(mu_) = 0;
  // Streamed chunk: frames read or being read, in order; next offset to read. Its
  // CRC32C (key_crc_) is checked when every layer was asked for and the last is sent.
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t read_off_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::ByteBuffer frame_;  // The frame in flight; touched only by the one writer.
  // Among max_streams; given back as the call finishes, before the client can see its
  // status, so that a client's next call finds it free.
  StreamLimiter::Ticket place_;
  // Waiting on the client while a write is in flight; reset at OnDone (the reactor may
  // outlive the call's context while store callbacks finish).
  StallReaper::Watched stall_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_GET_REACTOR_H_
