// PrefillSession: the worker's side of a Cake prefill (rpc KvCache.Prefill; the
// contract is the "Prefill" block of proto/kvtier/v1/kvtier.proto). The worker computes
// KV forward from chunk 0 while kvtierd streams the cached chunks backward from h-1;
// this class tells the worker where to stop and checks that what it ends up holding
// covers [0, h) exactly once.
//
// How a worker drives it:
//
//   auto session = PrefillSession::Start(client, ns, keys, {.on_chunk = Install});
//   uint32_t i = 0;
//   while (i < (*session)->plan().cached_prefix() && (*session)->ShouldCompute(i)) {
//     Compute(i);
//     (*session)->ReportComputed(i++).IgnoreError();  // Finish() reports stream errors.
//   }
//   auto result = (*session)->Finish();
//   // Ok: chunks [s, h) went to Install; compute [result->compute_begin,
//   // result->compute_end), then the uncached [h, n). Error: use no streamed chunk.
//   // Destroying the session (or Close()) ends the call once the daemon let go.
//
// Threading model: one session is driven by one worker thread (Start, ShouldCompute,
// ReportComputed, Finish, Close, the destructor), with one exception: ShouldCompute and
// ReportComputed may also be called from any other thread, including from inside
// on_chunk. Each session owns a reader thread, started by Start and joined by Close or
// the destructor (or by Finish when the call failed), that alone reads the gRPC
// stream, assembles and checks chunks and runs on_chunk. Finish returns as soon as
// Done is in; the call's teardown (the daemon's status) goes on on the reader thread,
// off the worker's critical path. gRPC allows one reader and one writer at a time on
// a stream: Progress, the half-close and the stream's final Finish go through a
// PrefillStreamWriter, which serializes them; the session state the two threads share
// is guarded by mu_, never held across a stream operation or on_chunk.
//
// Lifetimes: `client` must outlive the session (the call runs on its channel until
// the reader thread ends). on_chunk is called only between Start and the return of
// Finish (or of Close or the destructor, if Finish is never called), never after. Keys
// are copied into the Open message.
//
// Exactly-once: the session calls on_chunk only for chunks it received complete and
// CRC32C-verified, each at most once, in strictly decreasing index order. If Finish
// returns Ok, the chunks passed to on_chunk are exactly [s, h) and the worker must
// compute [0, s) (minus what it already did). If Finish (or Start) returns an error,
// the worker holds nothing from this session: it discards whatever on_chunk received
// and computes [0, h) itself (or starts a new session for what is missing).
#ifndef KVTIER_CLIENT_PREFILL_SESSION_H_
#define KVTIER_CLIENT_PREFILL_SESSION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/kvtier_client.h"
#include "client/shared_buffer.h"
#include "client/prefill_stream_writer.h"
#include "client/region_channel.h"
#include "kvtier/v1/kvtier.pb.h"
#include "storage/chunk_key.h"

namespace kvtier {

// The worker's compute cost forecast: chunk i takes a_seconds + b_seconds * i.
struct ComputeEstimate {
  double a_seconds = 0;  // >= 0, finite.
  double b_seconds = 0;  // >= 0, finite.
};

struct PrefillOptions {
  // Receives each streamed chunk once it arrived whole and matched its CRC32C: its index
  // in the request, its bytes (exactly plan().chunk_bytes(); ownership moves to the
  // callee) and the tier the daemon read it from. Runs on the session's reader thread,
  // in strictly decreasing index order; while it runs, no further frames are read, so
  // a slow callback slows the stream. It may call ShouldCompute and ReportComputed, but
  // not Finish or the destructor. Empty: chunks are checked and dropped (benchmarks).
  std::function<void(uint32_t index, std::string data, v1::Tier tier)> on_chunk;
  // Instead of on_chunk (not both): streamed chunks land in this buffer, chunk i at
  // into[i * chunk_bytes, (i + 1) * chunk_bytes), so it must hold the request's keys'
  // chunks back to back (num_keys * the layout's chunk_bytes; InvalidArgument
  // otherwise). When `into` lies in one buffer from the client's AllocateShared, the
  // daemon copies each chunk there itself (PrefillOpen.target: same host, no chunk
  // bytes on the stream), whole, once the session's rate limits allowed all of it and
  // only if the worker has not reported it computed, checking its CRC32C as it copies;
  // otherwise the session copies each chunk there once it arrived whole and matched its
  // CRC32C (PrefillResult::path says which). on_chunk_in_place (may be empty) announces
  // each chunk once it is in place. In shared memory, the chunk the two sides meet on
  // may be written by the daemon while the worker computes it into the same place:
  // both are the same chunk's KV, and the contract lets either copy stand. After a
  // session that failed or was cancelled, the daemon may still be finishing one chunk's
  // copy into the buffer for as long as that copy takes (milliseconds) after Close.
  absl::Span<char> into;
  // Instead of on_chunk or into: streamed chunks land in GPU memory this process
  // registered with KvTierClient::RegisterDeviceMemory, chunk i at `offset` + i *
  // chunk_bytes of `region` (the daemon refuses, InvalidArgument, keys that do not fit
  // it). The daemon copies each chunk there on its CUDA streams, device-to-device from
  // its staging buffers (checked when they were staged) or host-to-device from its
  // pool (checked as it copies), and announces it (on_chunk_in_place) only once the
  // bytes have landed: the worker may then use them on any of its streams. A chunk the
  // worker writes into its place during the copy (computing it too) goes back to the
  // worker: the session ends there (Done MET). Same caveats as `into` in shared memory.
  struct DeviceInto {
    RegionChannel::Registration region;
    uint64_t offset = 0;
  };
  std::optional<DeviceInto> into_device;
  std::function<void(uint32_t index, v1::Tier tier)> on_chunk_in_place;
  // Asked on the reader thread after each on_chunk or on_chunk_in_place returns (may be
  // empty): a non-Ok status is the callback's failure, which ends the session with it.
  // The call is cancelled, no callback runs again, and Finish returns that status (the
  // worker holds nothing from the session). For bindings whose callbacks raise rather
  // than return a status.
  std::function<absl::Status()> callback_status;
  // Sent in Open so the daemon's forecast (and its decision to stop before a chunk the
  // worker would compute sooner) uses this worker's real speed. Absent: the daemon uses
  // its running fit.
  std::optional<ComputeEstimate> compute_estimate;
  // Cap on this session's streaming rate, bytes per second. 0: none beyond the daemon's
  // own limit.
  uint64_t max_bytes_per_second = 0;
  // Cap on the data bytes per streamed frame. 0: the client's
  // ClientOptions::max_frame_bytes (which fits the client's message size limit).
  uint32_t max_frame_bytes = 0;
  // Deadline of the whole session, from Start. Zero: the client's
  // ClientOptions::rpc_deadline.
  absl::Duration rpc_deadline = absl::ZeroDuration();
  // Whether ShouldCompute refines its base rule with a forecast of both sides, once
  // it has one: the worker's cost from compute_estimate, else from the pace of its
  // own ReportComputed calls (after two); the stream's from the plan's rate, or the
  // last chunk's if slower. Each refinement needs one side to win by 20%:
  //  - stand aside for a chunk below the stream that the stream will bring sooner
  //    than the worker could compute it (computing it would only delay the meeting:
  //    the worker cannot drop a chunk half computed when the stream brings it);
  //  - compute the chunk in flight when the worker will finish it sooner than the
  //    rest of it arrives (the daemon abandons a chunk the worker reports computed;
  //    should it arrive anyway, the two copies are interchangeable). This covers a
  //    daemon that started a chunk it should not have, e.g. before it knew the cost.
  // The daemon runs the first test from its side before each chunk, so the two agree.
  // False: the base rule only.
  bool use_forecast = true;

  // Returns: Ok, InvalidArgument naming the bad field.
  absl::Status Validate() const;
};

// Where the worker's copy of a cached chunk comes from.
enum class ChunkSource : uint8_t {
  kComputed = 0,  // Below first_streamed: the worker's own computation.
  kStreamed = 1,  // In [first_streamed, h): received through on_chunk.
};

struct PrefillResult {
  uint32_t first_streamed = 0;  // s: chunks [s, h) were streamed.
  uint32_t cached_prefix = 0;   // h, as in the plan.
  v1::PrefillDone::Reason reason = v1::PrefillDone::REASON_UNSPECIFIED;
  std::string detail;           // The daemon's explanation (e.g. an unavailable chunk).
  // One entry per cached chunk [0, h): kComputed below s, kStreamed from s on.
  std::vector<ChunkSource> sources;
  uint32_t chunks_streamed = 0;  // h - s, each delivered once through on_chunk.
  uint64_t bytes_streamed = 0;   // Payload bytes of those chunks.
  // Payload bytes of a chunk below s whose streaming was cut short (discarded, per the
  // contract; never passed to on_chunk).
  uint64_t bytes_discarded = 0;
  // What ReportComputed announced: chunks [0, computed_reported) are computed.
  uint32_t computed_reported = 0;
  // The cached chunks the worker still has to compute: [compute_begin, compute_end) =
  // [min(computed_reported, s), s). Empty when the worker already has [0, s). The
  // uncached chunks [h, n) always remain to be computed.
  uint32_t compute_begin = 0;
  uint32_t compute_end = 0;
  // Chunks both computed and streamed (the two sides raced on the meeting chunk):
  // [s, computed_reported) when computed_reported > s. Either copy may be used.
  uint32_t raced = 0;
  // How streamed chunks travelled: through shared memory (PrefillOptions::into in the
  // client's shared memory) or on the gRPC stream.
  DataPath path = DataPath::kStream;
  absl::Duration elapsed;          // From Start to Done, as this client saw it.
  double daemon_elapsed_seconds = 0;  // From Open to Done, as the daemon saw it.
};

class PrefillSession {
 public:
  // Opens a Prefill call for `keys` (the request's chunk keys, in order), sends Open and
  // waits for the daemon's Plan. `client` must outlive the session.
  // Returns: Ok; InvalidArgument (bad options, nothing sent); the call's own status if
  // it ended before a Plan (NotFound: unknown namespace; InvalidArgument: malformed
  // Open; Unavailable; DeadlineExceeded; Unimplemented: a daemon without Prefill);
  // Internal (the daemon's first message was not a valid Plan).
  static absl::StatusOr<std::unique_ptr<PrefillSession>> Start(KvTierClient& client,
                                                               uint64_t namespace_id,
                                                               std::vector<ChunkKey> keys,
                                                               PrefillOptions options);

  PrefillSession(const PrefillSession&) = delete;
  PrefillSession& operator=(const PrefillSession&) = delete;
  // Ends the call and joins the reader thread. After Finish returned a result, the
  // daemon ends the call by itself once it sees the half-close; the destructor waits
  // for that up to a second, then cancels. Otherwise it cancels at once. After it
  // returns, on_chunk is never called again.
  ~PrefillSession();

  // The daemon's plan: h = cached_prefix(), its tiers and forecast. Fixed after Start.
  const v1::PrefillPlan& plan() const { return plan_; }
  uint32_t num_keys() const { return num_keys_; }
  // The lowest chunk index whose frames have started arriving (h before any): chunks
  // [stream_reached(), h) are streamed or in flight.
  uint32_t stream_reached() const;

  // Whether the worker should compute chunk i now. Always true for i >= h (uncached
  // chunks are the worker's). Once Done arrived: true exactly for i < s. After the
  // call failed: true (the worker holds nothing from the session). Before Done, the
  // base rule: false once the daemon has begun streaming a chunk <= i (it streams
  // downward, so [j, h) are then streamed or in flight), true below that; refined by
  // use_forecast (see PrefillOptions). A false answer means: stop computing cached
  // chunks and call Finish, which waits for the streamed ones and says what is left.
  bool ShouldCompute(uint32_t i) const;

  // Tells the daemon that chunks [0, i] are computed (Progress{computed = i + 1}). Call
  // it after each computed chunk, in order; reporting a later chunk covers the earlier
  // ones. Once Done arrived, or the call ended, only the local count is updated (the
  // daemon no longer needs it).
  // Returns: Ok (also when the call has already ended: Finish reports how it ended);
  // InvalidArgument (i already reported, or i >= the number of keys);
  // FailedPrecondition (after Finish).
  absl::Status ReportComputed(uint32_t i);

  // Ends the session: waits for Done and half-closes the call (before Done only when
  // the worker has reported all of [0, h): the daemon then has nothing to stream and
  // answers the half-close with Done). Returns once Done is in, checked against the
  // exactly-once contract; it does not wait for the call's status (see Close). Call
  // it once.
  // Returns: Ok with the result; the call's status if it ended before Done
  // (Unavailable, DeadlineExceeded, NotFound, InvalidArgument, ...); DataLoss (a
  // streamed chunk failed its CRC32C); Internal (the daemon broke the protocol: frames
  // out of order, a chunk in [s, h) missing or incomplete, a complete chunk below s,
  // the call ending without Done); FailedPrecondition (called twice).
  absl::StatusOr<PrefillResult> Finish();

  // Waits for the call to end (cancelling it first if Finish was not called) and joins
  // the reader thread. Idempotent. Optional: the destructor does the same.
  // Returns: Ok; the status the call ended with after a valid Done, which leaves
  // Finish's result standing (kvtierd ends Done{SHUTTING_DOWN} with Unavailable);
  // Internal (a message after Done); Cancelled (Finish was not called, so Close
  // cancelled the call); or the error Finish returned.
  absl::Status Close();

 private:
  PrefillSession(uint32_t num_keys, PrefillOptions options);

  void ReaderLoop();
  // Handles one chunk frame. Returns: Ok, Internal, DataLoss.
  absl::Status OnFrame(v1::PrefillChunkFrame& frame);
  // Checks Done against what arrived. Returns: Ok, Internal.
  absl::Status OnDone(const v1::PrefillDone& done);
  // use_forecast's estimates: seconds for the worker to compute chunk i, and until
  // the stream has delivered chunk i <= lowest_started_; negative when unknown.
  double ComputeForecast(uint32_t i) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double StreamForecast(uint32_t i) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Joins the reader thread if it still runs.
  void JoinReader();
  const uint32_t num_keys_;
  const PrefillOptions options_;
  v1::PrefillPlan plan_;  // Written once in Start, before the reader thread starts.
  uint32_t h_ = 0;        // plan_.cached_prefix().
  // With options_.into in shared memory: the buffer, held (and so registered with the
  // daemon) for the session; the daemon copies chunks into it.
  std::shared_ptr<SharedBuffer> into_shared_;
  // The daemon copies each chunk into place itself (shared memory or GPU memory): one
  // frame per chunk, no data bytes.
  bool placed_by_daemon_ = false;
  absl::Time start_time_;

  // The call. ctx_ precedes stream_ (the stream refers to it) and both outlive the
  // reader thread (joined in Finish or the destructor before they are destroyed).
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::PrefillClientMessage,
                                           v1::PrefillServerMessage>>
      stream_;

  // Every write after Open goes through it. Refers to *stream_, declared before it.
  std::unique_ptr<PrefillStreamWriter> writer_;

  // Reader-thread state (no lock: only ReaderLoop and what it calls touch it, and
  // Start before the thread exists).
  std::string assembling_;           // Bytes of the chunk in flight (without `into`).
  uint64_t assembled_ = 0;           // How many of its bytes arrived.
  int64_t assembling_index_ = -1;    // Its index; -1 when none is in flight.
  uint32_t assembling_expected_crc_ = 0;  // From its first frame.
  uint32_t assembling_crc_ = 0;      // CRC32C of assembling_ so far.
  v1::Tier assembling_tier_ = v1::TIER_UNSPECIFIED;
  uint32_t last_index_ = 0;          // Last chunk completed; h before any.
  bool done_seen_ = false;           // Done arrived (the reader's copy of done_).

  mutable absl::Mutex mu_;
  // Lowest index whose frames started arriving; h when none did.
  uint32_t lowest_started_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<bool> received_ ABSL_GUARDED_BY(mu_);  // Complete chunks, per index < h.
  uint32_t chunks_received_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;   // Of complete chunks.
  uint64_t bytes_discarded_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<v1::PrefillDone> done_ ABSL_GUARDED_BY(mu_);
  absl::Time done_time_ ABSL_GUARDED_BY(mu_);
  // Set when the reader thread has finished the call: the call's status, or the error
  // the client detected (which takes precedence).
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  absl::Status call_status_ ABSL_GUARDED_BY(mu_);  // A non-OK status after Done.
  uint32_t computed_ ABSL_GUARDED_BY(mu_) = 0;  // Last Progress.computed.
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  // For use_forecast: bytes of the chunk in flight, when the last chunk completed,
  // the time between the last two completions (0 until known), when the worker last
  // reported progress, and the time per chunk between its last two reports (0 until
  // known).
  uint64_t in_flight_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_complete_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  double chunk_interval_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_report_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  double compute_interval_seconds_ ABSL_GUARDED_BY(mu_) = 0;

  // Declared last: started after every other member exists, joined before any is
  // destroyed (by Close, the destructor, or Finish on failure: all on the worker
  // thread, so the joins need no lock).
  std::thread reader_;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_PREFILL_SESSION_H_
