// PutReactor: serves one Put call on gRPC's callback API with raw byte buffers, so that a
// frame's data is copied once, from gRPC's receive slices straight into the chunk's pool
// slots, its CRC32C computed in the same pass (FrameParser splits the frame without
// copying the data; ChunkWriter::Append does the copy). A frame naming a registered
// region is copied from the client's shared memory the same way.
//
// No thread waits on behalf of the call: a chunk's first frame asks the store for room
// with BeginPutAsync (answered at once, or later by the store's admission thread, in
// arrival order across all puts), and a write-through commit runs on the store's commit
// threads. The next read is started only when the frame in hand has been consumed, so
// gRPC's flow control holds back a client whose put waits for room.
//
// The stream's rules are those of the synchronous handler it replaced: frames of one
// chunk in order and not interleaved with another chunk's, the exact chunk size of the
// namespace's layout, crc32c on the completing frame, a chunk stored only once it is
// complete and verified; on an error the call ends with it and says how many chunks
// this stream stored before.
//
// Thread-safety: the call advances one step at a time (read done, room found, commit
// done), each on whichever thread finished the previous step, so its state needs no
// lock; only what OnCancel shares with those steps (the admission ticket) is under mu_.
// Finish is always the last thing a step does; gRPC calls OnDone after it, and OnDone
// deletes the reactor.
#ifndef KVTIER_SERVER_PUT_REACTOR_H_
#define KVTIER_SERVER_PUT_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/frame_parser.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/authenticator.h"
#include "server/mapped_region.h"
#include "server/region_table.h"
#include "server/rpc_metrics.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "server/tenant_scope.h"
#include "server/tenant_quotas.h"
#include "storage/parallel_copy.h"
#include "storage/tiered_store.h"

namespace kvtier {

class PutReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                         private StreamLimiter::Waiter {
 public:
  // `store` may be null (still starting: the call fails UNAVAILABLE). `metrics` and
  // `regions` may be null (no regions: a frame naming one is FAILED_PRECONDITION);
  // `copier` (may be null) copies a region's bytes into the pool on several threads. All
  // must outlive the call. `tenant` maps the frames' namespaces to the store's.
  PutReactor(grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response, TieredStore* store,
             RpcMetrics* metrics, RegionTable* regions, ParallelCopy* copier,
             uint64_t max_frame_bytes, TenantScope tenant = TenantScope::Implicit());

  void OnReadDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  // Keeps the call's place among max_streams until the call finishes. Call right after
  // construction: no reaction runs before the handler returns the reactor. A call the
  // constructor already finished keeps none.
  void Hold(StreamLimiter::Ticket place) {
    if (finished_early_) return;
    place_ = std::move(place);
  }
  // Takes a place among the Put streams max_put_buffer admits (`put_streams`; null: no
  // bound) and starts the call: at once; or after waiting in the limiter's line, the
  // client sent no headers meanwhile (the C++ client sends nothing before them); or
  // never, answering RESOURCE_EXHAUSTED with a retry hint (line full, or waited too
  // long). Call last, after Hold, WatchForStalls and EnforceQuotas.
  void Begin(StreamLimiter* put_streams);
  // Lets `reaper` (may be null; must outlive the call) cancel the call when its client
  // stays quiet too long while the daemon waits for its next frame.
  void WatchForStalls(StallReaper* reaper);
  // Admits each new chunk within the tenant's RAM and SSD quotas (may be null: none).
  // Call right after construction, like WatchForStalls.
  void EnforceQuotas(TenantQuotas* quotas) { quotas_ = quotas; }
  // Asks `still_admitted` (may be empty) before each new chunk whether the caller's
  // credentials still admit the call; an error ends it with that status. Call right
  // after construction, like WatchForStalls.
  void WatchAdmission(StillAdmitted still_admitted) { still_admitted_ = std::move(still_admitted); }

 private:
  // Gives the places back (as the call finishes, before the client sees its status).
  void ReleasePlaces() {
    place_ = StreamLimiter::Ticket();
    put_place_ = StreamLimiter::Ticket();
    // Unwatched only after its place went to the line: until then a reclaimed holder
    // counts as a place on its way, and the reaper takes no second one for the same
    // waiter; after, it does not count against a Put that joins the line next.
    stall_.Reset();
  }
  using Admission = absl::StatusOr<std::unique_ptr<ChunkWriter>>;

  // StreamLimiter::Waiter: the line's answer.
  void PlaceGranted(StreamLimiter::Ticket put_place) override;
  void WaitRefused(absl::Status refusal) override;
  // Sends the headers and reads the first frame.
  void StartReading();
  // Adds the kvtier-put-places trailer to a call that read its frames: "free" when the
  // Put places are plentiful (StreamLimiter::Plentiful), so the client may send its next
  // Put without waiting for the headers; "scarce" otherwise.
  void TellPlaces();
  // Answers a put that never got a place: RESOURCE_EXHAUSTED with the retry hint.
  void RefusePlace(const absl::Status& refusal);

  // Takes the frame just read: checks it, then starts its chunk or consumes it.
  void OnFrame();
  // Points data_ at the frame's bytes: its data pieces, or the region range it names
  // (held in region_ until consumed).
  absl::Status FrameBytes();
  // Asks the store for the chunk's room; continues in Admitted.
  void BeginChunk(const ChunkId& id, uint32_t token_count);
  void OnAdmission(Admission writer);
  void Admitted(Admission writer);
  // InvalidArgument if the frame runs past the chunk's end, or completes it without
  // crc32c.
  absl::Status CheckSize() const;
  // Copies the frame's bytes into the chunk (from GPU memory: on the device, continuing
  // in Consumed), then Consumed.
  void Consume();
  // The frame's bytes are in: commits a complete chunk, else reads on.
  void Consumed();
  void Committed(absl::StatusOr<bool> stored);
  void ReadNext();
  // The client half-closed (or the call was cancelled): ends the call.
  void EndOfStream();
  // Ends the call with `status`, noting what this stream stored before.
  void Fail(const absl::Status& status);

  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const response_;
  TieredStore* const store_;
  RegionTable* const regions_;
  ParallelCopy* const copier_;  // May be null: region bytes are copied on this thread.
  const uint64_t max_frame_bytes_;
  const TenantScope tenant_;
  uint64_t public_ns_ = 0;    // The last frame's namespace, and
  uint64_t internal_ns_ = 0;  // its store id.
  RpcMetrics::Scope scope_;

  grpc::ByteBuffer message_;  // The frame being read or handled.
  PutFrameParser parser_;
  // The frame's bytes: pieces of gRPC's buffers, or one range of region_.
  absl::Span<const absl::string_view> data_;
  absl::string_view region_bytes_;
  uint64_t data_size_ = 0;
  std::shared_ptr<const MappedRegion> region_;
  // A frame naming a worker's GPU memory: the region (held until consumed) and the
  // device address of the frame's bytes.
  std::shared_ptr<const DeviceRegion> device_region_;
  DevicePtr device_src_ = 0;

  // The chunk being received. `writer_` is null while draining a chunk that is already
  // stored (idempotent put).
  bool in_chunk_ = false;
  ChunkId current_;
  ChunkLineage lineage_;  // From its first frame; given to its writer.
  uint64_t chunk_bytes_ = 0;
  uint64_t received_ = 0;
  std::unique_ptr<ChunkWriter> writer_;
  v1::PutResponse resp_;

  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // BeginChunk is inside BeginPutAsync: an answer arriving meanwhile is parked in
  // early_answer_ and taken up by BeginChunk, which still uses the reactor after the call.
  bool admitting_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<Admission> early_answer_ ABSL_GUARDED_BY(mu_);
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;  // Waiting for room; 0 when not.
  // The limiter whose line this call waits in; null when it does not.
  StreamLimiter* line_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Among max_streams, and within max_put_buffer. Given back as the call finishes,
  // before the client can see its status: a client's next call finds them free.
  StreamLimiter::Ticket place_;
  StreamLimiter::Ticket put_place_;
  StreamLimiter* put_streams_ = nullptr;  // Begin's; null: no bound.
  bool finished_early_ = false;  // The constructor finished the call (no store yet).
  StallReaper::Watched stall_;
  TenantQuotas* quotas_ = nullptr;
  StillAdmitted still_admitted_;  // Called on the reading path (OnFrame) only.
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_PUT_REACTOR_H_
