#include "server/prefill_runner.h"

#include "server/region_target.h"
#include "storage/crc32c.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/notification.h"
#include "scheduler/cake_planner.h"
#include "scheduler/compute_model.h"
#include "server/get_plan.h"
#include "server/status_util.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One Prefill call. Lives on the handler's stack.
class Session {
 public:
  Session(PrefillRunner* runner, TieredStore* store, grpc::ServerContext* ctx,
          PrefillStream* stream, const v1::PrefillOpen& open, RegionTable* regions,
          TenantScope scope, StallReaper* stalls,
          const std::function<void(uint64_t)>& on_namespace, StillAdmitted still_admitted)
      : runner_(runner),
        store_(store),
        ctx_(ctx),
        stream_(stream),
        open_(open),
        regions_(regions),
        scope_(std::move(scope)),
        on_namespace_(on_namespace),
        still_admitted_(std::move(still_admitted)),
        stall_(stalls, [ctx] { ctx->TryCancel(); }) {}

  grpc::Status Run();

 private:
  struct Progress {
    uint32_t computed = 0;
    double busy_seconds = 0;  // Time spent on chunk `computed` so far.
    bool client_closed = false;
    absl::Status error;
    ComputeCost cost;
    bool cost_known = false;
  };

  absl::Status Open();
  void ReaderLoop();
  void PrefetchLoop();
  Progress Snapshot();
  // A chunk to stream: in RAM (promoted from SSD when there is room), or a streamed()
  // view of an SSD chunk, read a frame at a time by ReadRange.
  absl::StatusOr<ChunkView> ReadForStream(const ChunkId& id);
  // Calls `fn` on chunk j's bytes [offset, offset + len): from the view's memory, or
  // read from SSD for a streamed view. Returns: Ok, NotFound (deleted meanwhile),
  // DataLoss (corrupt: deleted), Unavailable.
  absl::Status ReadRange(uint32_t j, const ChunkView& view, uint64_t offset, uint64_t len,
                         absl::FunctionRef<void(absl::string_view)> fn);
  // Waits for the prefetched view of chunk j.
  absl::StatusOr<ChunkView> TakeChunk(uint32_t j);
  // Sends chunk j; returns false when it was abandoned because the worker computed it
  // meanwhile (sets *aborted) or the client went away (returns the status).
  absl::Status SendChunk(uint32_t j, const ChunkView& view, bool* aborted);
  double StreamSeconds(uint32_t j) const;
  // A region target: chunk j is whole in the client's memory (copied from `from` since
  // copy_start); sends its data-less last frame and records the transfer.
  absl::Status AnnounceLanded(uint32_t j, const ChunkMeta& meta, Tier from,
                              Clock::time_point copy_start);
  bool Cancelled() const { return ctx_->IsCancelled(); }
  // Writes one message on the handler thread, watched for a worker that stops reading.
  bool Write(const v1::PrefillServerMessage& msg);
  grpc::Status Finish(uint32_t first_streamed, v1::PrefillDone::Reason reason,
                      std::string detail, grpc::Status status = grpc::Status::OK);
  void StopThreads();

  PrefillRunner* const runner_;
  TieredStore* const store_;
  grpc::ServerContext* const ctx_;
  PrefillStream* const stream_;
  const v1::PrefillOpen& open_;  // The caller's, as ReadOpen returned it; outlives Run.
  RegionTable* const regions_;
  const TenantScope scope_;
  const std::function<void(uint64_t)>& on_namespace_;  // The caller's; outlives Run.
  StillAdmitted still_admitted_;  // May be empty; called on Run's thread only.
  // Watches each write (the reader thread's wait for Progress is the worker computing,
  // not a stall; ReadOpen watched the Open's read). Declared before the threads, so
  // reset after them.
  StallReaper::Watched stall_;
  // PrefillOpen.target: chunks are copied into this region instead of sent.
  std::optional<ResolvedTarget> target_;
  // PrefillOpen.target in a worker's GPU memory: each streamed chunk is copied there by
  // the GPU tier (from staging, where the session staged it at open, or from the pool).
  std::optional<ResolvedDeviceTarget> device_target_;
  const Clock::time_point opened_ = Clock::now();

  // Set by Open, then read-only.
  uint64_t ns_ = 0;
  std::vector<ChunkId> ids_;
  std::vector<Tier> tiers_;
  uint32_t h_ = 0;
  uint64_t chunk_bytes_ = 0;
  uint64_t frame_bytes_ = 0;
  std::optional<TokenBucket> session_limit_;
  std::shared_ptr<BandwidthEstimator> connection_;
  ComputeCost open_cost_;
  bool open_cost_given_ = false;
  v1::PrefillPlan plan_;

  absl::Mutex mu_;
  uint32_t computed_ ABSL_GUARDED_BY(mu_) = 0;
  Clock::time_point last_progress_ ABSL_GUARDED_BY(mu_) = opened_;
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status reader_error_ ABSL_GUARDED_BY(mu_);
  std::optional<ComputeModel> model_ ABSL_GUARDED_BY(mu_);
  // Prefetched chunks, in streaming order.
  std::deque<std::pair<uint32_t, absl::StatusOr<ChunkView>>> ready_ ABSL_GUARDED_BY(mu_);
  bool stop_prefetch_ ABSL_GUARDED_BY(mu_) = false;

  std::thread reader_;
  std::thread prefetcher_;
};

absl::Status Session::Open() {
  // Read and checked by ReadOpen: what is left needs the store.
  ns_ = scope_.Internal(open_.namespace_id());
  auto layout = store_->FindLayout(ns_);
  if (!layout.ok()) return layout.status();
  if (on_namespace_) on_namespace_(ns_);
  const v1::PrefillOpen& open = open_;
  const auto& options = runner_->options();
  ids_.reserve(open.keys_size());
  for (const std::string& key : open.keys()) {
    ids_.push_back(ChunkId{ns_, *ChunkKey::FromBytes(key)});  // Checked by ReadOpen.
  }
  if (open.has_compute_estimate()) {
    open_cost_ = {open.compute_estimate().a_seconds(), open.compute_estimate().b_seconds()};
    open_cost_given_ = true;
  }
  chunk_bytes_ = layout->ChunkBytes();
  if (open.has_target() && regions_ != nullptr && regions_->IsDevice(open.target().region_id())) {
    if (!store_->has_gpu()) return absl::FailedPreconditionError("open.target: this daemon has no GPU");
    auto target = ResolveDeviceTarget(regions_, open.target(), ids_.size(), chunk_bytes_);
    if (!target.ok()) {
      return absl::Status(target.status().code(),
                          absl::StrCat("open.", target.status().message()));
    }
    device_target_ = *std::move(target);
  } else if (open.has_target()) {
    auto target = ResolveRegionTarget(regions_, open.target(), ids_.size(), chunk_bytes_);
    if (!target.ok()) {
      return absl::Status(target.status().code(),
                          absl::StrCat("open.", target.status().message()));
    }
    target_ = *std::move(target);
  }
  frame_bytes_ = FrameBytesFor(open.max_frame_bytes(), options.max_frame_bytes);
  if (open.max_bytes_per_second() > 0) {
    session_limit_.emplace(static_cast<double>(open.max_bytes_per_second()));
  }
  // Into GPU memory the pace is the GPU's copies, not the connection's.
  connection_ = device_target_ ? runner_->estimators().Device()
                               : runner_->estimators().Connection(ctx_->peer());

  // The cached prefix: keys are prefix-chained, so the first miss ends it.
  for (const ChunkId& id : ids_) {
    const Tier t = store_->Locate(id);
    if (t == Tier::kNone) break;
    tiers_.push_back(t);
  }
  h_ = static_cast<uint32_t>(tiers_.size());
  {
    absl::MutexLock lock(&mu_);
    model_.emplace(open_cost_given_ ? open_cost_ : runner_->estimators().ComputePrior());
  }

  const ComputeCost cost = open_cost_given_ ? open_cost_ : runner_->estimators().ComputePrior();
  std::vector<double> stream_seconds(h_);
  for (uint32_t j = 0; j < h_; ++j) stream_seconds[j] = StreamSeconds(j);
  const MeetingPlan mp = PlanMeeting(stream_seconds, cost);
  if (device_target_) {
    // The chunks this session expects to stream, into the GPU staging buffers ahead of
    // their turn: in the order it streams them, h-1 first, down to one below the
    // predicted meeting. Staging copies are in flight while later ones are asked for,
    // and a slot whose copy is in flight cannot be taken: in ascending order, staging
    // filled with the chunks streamed last (or computed by the worker) and refused the
    // first ones, evicting other sessions' staged chunks for nothing.
    const uint32_t lowest = mp.meeting > 0 ? mp.meeting - 1 : 0;
    for (uint32_t j = h_; j-- > lowest;) store_->StageAsync(ids_[j]);
  }
  plan_.set_cached_prefix(h_);
  for (Tier t : tiers_) plan_.add_tiers(static_cast<v1::Tier>(static_cast<int>(t)));
  plan_.set_predicted_meeting(mp.meeting);
  plan_.set_predicted_seconds(mp.seconds);
  plan_.set_chunk_bytes(chunk_bytes_);
  plan_.set_stream_bytes_per_second(h_ > 0 ? chunk_bytes_ / StreamSeconds(h_ - 1) : 0);
  plan_.set_compute_a_seconds(cost.a);
  plan_.set_compute_b_seconds(cost.b);
  v1::PrefillServerMessage msg;
  *msg.mutable_plan() = plan_;
  if (!Write(msg)) return absl::CancelledError("client went away");
  return absl::OkStatus();
}

bool Session::Write(const v1::PrefillServerMessage& msg) {
  stall_.WaitingOnClient(true);
  const bool sent = stream_->Write(msg);
  stall_.WaitingOnClient(false);
  return sent;
}

double Session::StreamSeconds(uint32_t j) const {
  double bw = connection_->BytesPerSecond();
  if (session_limit_) bw = std::min(bw, session_limit_->bytes_per_second());
  if (runner_->bandwidth_limit().bytes_per_second() > 0) {
    bw = std::min(bw, runner_->bandwidth_limit().bytes_per_second());
  }
  // Reading from SSD overlaps with sending the chunk before, so the slower of the two
  // sets the pace.
  if (tiers_[j] == Tier::kSsd) bw = std::min(bw, runner_->estimators().ssd_read().BytesPerSecond());
  return bw > 0 ? static_cast<double>(chunk_bytes_) / bw : 0;
}

void Session::ReaderLoop() {
  v1::PrefillClientMessage msg;
  while (stream_->Read(&msg)) {
    absl::MutexLock lock(&mu_);
    if (!msg.has_progress()) {
      reader_error_ = absl::InvalidArgumentError(
          "progress: only progress messages may follow open");
      break;
    }
    const uint32_t c = msg.progress().computed();
    if (c < computed_ || c > ids_.size()) {
      reader_error_ = absl::InvalidArgumentError(absl::StrCat(
          "progress.computed: ", c, " is out of range: it must not go down (was ", computed_,
          ") nor exceed the request's ", ids_.size(), " keys"));
      break;
    }
    if (c > computed_) {
      // The chunks reported since the last Progress took this long together; with one
      // report per chunk (the usual case) the split is exact.
      const auto now = Clock::now();
      const double each =
          std::chrono::duration<double>(now - last_progress_).count() / (c - computed_);
      for (uint32_t i = computed_; i < c; ++i) model_->AddSample(i, each);
      computed_ = c;
      last_progress_ = now;
    }
  }
  absl::MutexLock lock(&mu_);
  reader_done_ = true;
}

void Session::PrefetchLoop() {
  const uint32_t window = std::max<uint32_t>(1, runner_->options().prefetch_window);
  for (uint32_t j = h_; j-- > 0;) {
    {
      absl::MutexLock lock(&mu_);
      auto room = [this, window]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_prefetch_ || ready_.size() < window;
      };
      mu_.Await(absl::Condition(&room));
      if (stop_prefetch_) return;
    }
    absl::StatusOr<ChunkView> view;
    if (store_->Locate(ids_[j]) == Tier::kSsd) {
      // In line behind other sessions' reads: a session that ends meanwhile leaves it.
      if (!runner_->ssd_gate().EnterUnless([this] {
            absl::MutexLock lock(&mu_);
            return stop_prefetch_;
          })) {
        return;
      }
      const auto start = Clock::now();
      view = ReadForStream(ids_[j]);
      const double took = SecondsSince(start);
      runner_->ssd_gate().Leave();
      if (view.ok() && view->tier() == Tier::kSsd && !view->streamed()) {
        runner_->estimators().ssd_read().Record(view->meta().size, took);
      }
    } else {
      view = ReadForStream(ids_[j]);
    }
    absl::MutexLock lock(&mu_);
    ready_.emplace_back(j, std::move(view));
  }
}

Session::Progress Session::Snapshot() {
  absl::MutexLock lock(&mu_);
  Progress p;
  p.computed = computed_;
  p.busy_seconds = SecondsSince(last_progress_);
  p.client_closed = reader_done_;
  p.error = reader_error_;
  // The fit once it is trusted; a burst of Progress does not make chunks look free.
  const ChosenCost chosen =
      ChooseComputeCost(*model_, open_cost_given_ ? &open_cost_ : nullptr, open_cost_, h_);
  p.cost = chosen.cost;
  p.cost_known = chosen.known;
  return p;
}

absl::StatusOr<ChunkView> Session::ReadForStream(const ChunkId& id) {
  // With no room in RAM an SSD chunk comes back streamed, holding nothing: SendChunk
  // reads it a frame at a time (ReadRange). Whole-chunk buffers would be held for as
  // long as the worker takes to read them, and a few slow sessions would hold every one
  // of the store's max_buffered_reads, stalling every other session's SSD chunks. Read
  // on this session's own thread, never the store's read pool, which the frame reads
  // (every session's and every Get's) need.
  return store_->ReadForStream(id);
}

absl::Status Session::ReadRange(uint32_t j, const ChunkView& view, uint64_t offset,
                                uint64_t len, absl::FunctionRef<void(absl::string_view)> fn) {
  if (!view.streamed()) {
    view.ForEachPiece(offset, len, fn);
    return absl::OkStatus();
  }
  // Not within ssd_gate: this waits on the stream budget and the read pool, which Gets
  // share, and must not hold up the other sessions' reads meanwhile.
  absl::Notification read;
  absl::StatusOr<TieredStore::RangeBuffer> bytes;
  const auto start = Clock::now();
  store_->ReadRangeAsync(ids_[j], view.meta(), offset, len,
                         [&](absl::StatusOr<TieredStore::RangeBuffer> b) {
                           bytes = std::move(b);
                           read.Notify();
                         });
  read.WaitForNotification();
  if (!bytes.ok()) {
    // Whatever the cause (deleted, corrupt, an I/O error), chunk j is the worker's to
    // compute: the caller ends the session CHUNK_UNAVAILABLE, keeping what it streamed.
    return absl::NotFoundError(
        absl::StrCat("reading it from SSD: ", bytes.status().message()));
  }
  runner_->estimators().ssd_read().Record(len, SecondsSince(start));
  fn(absl::string_view(bytes->get(), len));
  return absl::OkStatus();
}

absl::StatusOr<ChunkView> Session::TakeChunk(uint32_t j) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ready_.empty(); };
  while (!mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(50))) {
    if (Cancelled()) return absl::CancelledError("client went away");
  }
  auto [index, view] = std::move(ready_.front());
  ready_.pop_front();
  // The prefetcher and this loop both walk down from h-1, one step each.
  if (index != j) return absl::InternalError("prefetch out of order");
  return std::move(view);
}

absl::Status Session::SendChunk(uint32_t j, const ChunkView& view, bool* aborted) {
  *aborted = false;
  const uint64_t size = view.meta().size;
  v1::PrefillServerMessage msg;
  // The worker computing chunk j meanwhile makes the rest of it useless.
  auto overtaken = [this, j] {
    absl::MutexLock lock(&mu_);
    return computed_ > j || reader_done_;
  };
  uint32_t streamed_crc = 0;  // Of a streamed view's bytes, frame by frame.
  for (uint64_t off = 0; off < size;) {
    const uint64_t n = std::min(frame_bytes_, size - off);
    auto stop = [&] { return Cancelled() || overtaken() || runner_->shutting_down(); };
    // The session's own limit is its client's choice: a wait on it is a wait on the
    // client, so the stall reaper ends a session paced slower than a frame per
    // client_idle_timeout (at 1 byte/s one frame once took weeks, and the session held
    // its place, three threads and its prefetched chunks for all of them).
    bool paced = true;
    if (session_limit_) {
      stall_.WaitingOnClient(true);
      paced = session_limit_->Acquire(n, stop);
      stall_.WaitingOnClient(false);
    }
    if (!paced || !runner_->bandwidth_limit().Acquire(n, stop) || overtaken()) {
      if (Cancelled()) return absl::CancelledError("client went away");
      *aborted = true;
      return absl::OkStatus();
    }
    if (device_target_) {
      // GPU target: the rate limits pace it a frame at a time; the chunk is copied on
      // the device once they allowed all of it, below.
      off += n;
      continue;
    }
    if (target_) {
      // Region target: the rate limits pace it a frame at a time; the chunk is copied
      // into place whole once they allowed all of it, below, so the worker's memory
      // never holds part of a chunk whose streaming was cut short.
      off += n;
      continue;
    }
    msg.Clear();
    auto* frame = msg.mutable_chunk();
    frame->set_index(j);
    frame->set_offset(off);
    if (off == 0) {
      frame->set_crc32c(view.meta().crc32c);
      frame->set_tier(static_cast<v1::Tier>(static_cast<int>(view.tier())));
    }
    std::string* data = frame->mutable_data();
    data->resize(n);
    char* out = data->data();
    if (absl::Status r = ReadRange(j, view, off, n, [&](absl::string_view piece) {
          // Read from SSD a frame at a time: the whole chunk's CRC32C, as Get checks it,
          // before its last frame goes (the SSD checked each piece).
          if (view.streamed()) {
            streamed_crc = crc32c::CopyAndExtend(streamed_crc, out, piece.data(), piece.size(),
                                                 crc32c::CrcOver::kSource);
          } else {
            std::memcpy(out, piece.data(), piece.size());
          }
          out += piece.size();
        });
        !r.ok()) {
      return r;
    }
    off += n;
    frame->set_last(off == size);
    if (off == size && view.streamed() && streamed_crc != view.meta().crc32c) {
      return store_->DropCorrupt(ids_[j], view);  // DataLoss: CHUNK_UNAVAILABLE.
    }
    const auto start = Clock::now();
    if (!Write(msg)) return absl::CancelledError("client went away");
    const double took = SecondsSince(start);
    connection_->Record(n, took);
    runner_->estimators().send().Record(n, took);
    if (runner_->metrics()) runner_->metrics()->Streamed(n);
  }
  if (device_target_) {
    // Device-to-device from staging, or host-to-device with the CRC32C checked (on the
    // GPU after the copy, or on the CPU during it); this session thread waits for the
    // bytes to land.
    absl::Notification landed;
    absl::StatusOr<Tier> from;
    const auto device_start = Clock::now();
    // The copy prefetched, whose CRC32C the frame names: one stored afresh with other
    // bytes since is not delivered (Aborted).
    std::optional<ChunkMeta> pin = view.meta();
    store_->ReadToDeviceAsync(
        ids_[j], {{0, size, device_target_->dest[j]}},
        [&](absl::StatusOr<Tier> r) {
          from = std::move(r);
          landed.Notify();
        },
        /*check_crc=*/true, /*enqueued=*/nullptr, &pin);
    landed.WaitForNotification();
    if (absl::IsAborted(from.status())) {
      // The worker wrote into chunk j's place during the copy: it is computing chunk j
      // itself (the contract lets either copy stand). Or the chunk was stored afresh
      // since it was prefetched. Either way the chunk goes back to the worker.
      *aborted = true;
      return absl::OkStatus();
    }
    if (!from.ok()) return from.status();
    // The GPU's pace: the copy alone, not this session's rate limits nor its client's
    // reading, which are not the device's and would slow every session's forecast; nor
    // an SSD read before the copy, which would slow the forecast of RAM and staged ones.
    if (*from != Tier::kSsd) connection_->Record(size, SecondsSince(device_start));
    if (runner_->metrics()) runner_->metrics()->Streamed(size);
    return AnnounceLanded(j, view.meta(), *from, device_start);
  }
  if (target_) {
    if (overtaken()) {  // Computed by the worker while the limits paced it.
      *aborted = true;
      return absl::OkStatus();
    }
    // The copy's pace: not the rate limits' waits above, which would be recorded as the
    // connection's speed (and the daemon's, which new connections start from).
    const auto region_copy_start = Clock::now();
    uint32_t crc = 0;  // Of the pool's (or the SSD's) bytes, as they are copied.
    char* out = target_->dest[j];
    for (uint64_t off = 0; off < size;) {
      const uint64_t n = view.streamed() ? std::min(frame_bytes_, size - off) : size;
      // Read from SSD a frame at a time, the copy takes as long as those reads: it stops
      // between frames once the client is gone (so nothing is written into its memory
      // long after it closed) or computes the chunk itself.
      if (off > 0 && (Cancelled() || overtaken())) {
        if (Cancelled()) return absl::CancelledError("client went away");
        *aborted = true;
        return absl::OkStatus();
      }
      if (absl::Status r = ReadRange(j, view, off, n, [&](absl::string_view piece) {
            crc = crc32c::CopyAndExtend(crc, out, piece.data(), piece.size(),
                                        crc32c::CrcOver::kSource);
            out += piece.size();
          });
          !r.ok()) {
        return r;
      }
      off += n;
    }
    if (crc != view.meta().crc32c) return store_->DropCorrupt(ids_[j], view);
    if (runner_->metrics()) runner_->metrics()->Streamed(size);
    return AnnounceLanded(j, view.meta(), view.tier(), region_copy_start);
  }
  return absl::OkStatus();
}

absl::Status Session::AnnounceLanded(uint32_t j, const ChunkMeta& meta, Tier from,
                                     Clock::time_point copy_start) {
  v1::PrefillServerMessage msg;
  auto* frame = msg.mutable_chunk();
  frame->set_index(j);
  frame->set_last(true);
  frame->set_crc32c(meta.crc32c);
  frame->set_tier(static_cast<v1::Tier>(static_cast<int>(from)));
  const auto start = Clock::now();
  if (!Write(msg)) return absl::CancelledError("client went away");
  // The copy and the announcement together are what the connection delivered (a device
  // target's copy was recorded on its own, above).
  if (device_target_) return absl::OkStatus();
  const double took = std::max(SecondsSince(copy_start), SecondsSince(start));
  connection_->Record(meta.size, took);
  runner_->estimators().send().Record(meta.size, took);
  return absl::OkStatus();
}

grpc::Status Session::Finish(uint32_t first_streamed, v1::PrefillDone::Reason reason,
                             std::string detail, grpc::Status status) {
  const double elapsed = SecondsSince(opened_);
  v1::PrefillServerMessage msg;
  auto* done = msg.mutable_done();
  done->set_first_streamed(first_streamed);
  done->set_reason(reason);
  done->set_detail(std::move(detail));
  done->set_elapsed_seconds(elapsed);
  // Every copy into the target has landed (this thread made them, and waited for the
  // device's): the region is let go before the worker hears Done, which it may answer
  // by removing the region at once. StopThreads, after Done, may first wait for the
  // prefetcher to leave the SSD gate.
  target_.reset();
  device_target_.reset();
  const bool sent = Write(msg);
  if (runner_->metrics()) {
    runner_->metrics()->SessionEnded(reason, plan_.predicted_seconds(), elapsed,
                                     plan_.predicted_meeting(), first_streamed, h_);
  }
  {
    absl::MutexLock lock(&mu_);
    // Only a fit this session trusted: a burst's must not make the next sessions'
    // chunks look free too.
    const ChosenCost chosen =
        ChooseComputeCost(*model_, open_cost_given_ ? &open_cost_ : nullptr, open_cost_, h_);
    if (chosen.from_fit) runner_->estimators().RecordComputeFit(chosen.cost);
  }
  if (!sent) return ToGrpcStatus(absl::CancelledError("client went away before Done"));
  return status;
}

void Session::StopThreads() {
  {
    absl::MutexLock lock(&mu_);
    stop_prefetch_ = true;
  }
  if (prefetcher_.joinable()) prefetcher_.join();
  // Nothing more is sent: the chunks prefetched and not streamed, and the target region,
  // go now, not after the linger below (they held pool slots other sessions wait for,
  // and a worker removing its region right after Done was refused).
  std::deque<std::pair<uint32_t, absl::StatusOr<ChunkView>>> unsent;
  {
    absl::MutexLock lock(&mu_);
    unsent.swap(ready_);
  }
  unsent.clear();
  target_.reset();
  device_target_.reset();
  if (reader_.joinable()) {
    // The worker half-closes after Done; one that does not is cut off after `linger`,
    // which is the only way to get a blocked Read back.
    {
      absl::MutexLock lock(&mu_);
      auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reader_done_; };
      mu_.AwaitWithTimeout(absl::Condition(&done), runner_->options().linger);
    }
    bool done;
    {
      absl::MutexLock lock(&mu_);
      done = reader_done_;
    }
    if (!done) ctx_->TryCancel();
    reader_.join();
  }
}

grpc::Status Session::Run() {
  if (absl::Status s = Open(); !s.ok()) return ToGrpcStatus(s);
  if (h_ == 0) {
    // Nothing cached: the worker computes everything. It may still be sending
    // Progress; read until it half-closes.
    reader_ = std::thread([this] { ReaderLoop(); });
    grpc::Status st = Finish(0, v1::PrefillDone::NOTHING_CACHED, "no cached prefix");
    StopThreads();
    return st;
  }
  reader_ = std::thread([this] { ReaderLoop(); });
  prefetcher_ = std::thread([this] { PrefetchLoop(); });

  grpc::Status result;
  bool finished = false;
  for (uint32_t j = h_; j-- > 0 && !finished;) {
    const Progress p = Snapshot();
    if (!p.error.ok()) {
      result = ToGrpcStatus(p.error);
      finished = true;
      break;
    }
    if (runner_->shutting_down()) {
      result = Finish(j + 1, v1::PrefillDone::SHUTTING_DOWN,
                      "kvtierd is shutting down; compute the chunks below first_streamed",
                      ToGrpcStatus(absl::UnavailableError(
                          "kvtierd is shutting down (Done sent with what was streamed)")));
      finished = true;
      break;
    }
    if (j < p.computed) {
      result = Finish(j + 1, v1::PrefillDone::MET, "");
      finished = true;
      break;
    }
    if (p.client_closed) {
      result = Finish(j + 1, v1::PrefillDone::CLIENT_DONE, "client half-closed");
      finished = true;
      break;
    }
    if (p.cost_known && !WorthStreaming(j, p.computed, p.busy_seconds, p.cost, StreamSeconds(j))) {
      result = Finish(j + 1, v1::PrefillDone::MET, "worker computes the rest sooner");
      finished = true;
      break;
    }
    if (still_admitted_) {
      // Credentials revoked by a tenants file reloaded while the session ran: Done says
      // which chunks to compute, and the call ends with the refusal.
      if (absl::Status s = still_admitted_(); !s.ok()) {
        result = Finish(j + 1, v1::PrefillDone::REVOKED, std::string(s.message()),
                        ToGrpcStatus(s));
        finished = true;
        break;
      }
    }
    auto view = TakeChunk(j);
    if (!view.ok()) {
      if (absl::IsCancelled(view.status())) {
        result = ToGrpcStatus(view.status());
      } else {
        result = Finish(j + 1, v1::PrefillDone::CHUNK_UNAVAILABLE,
                        absl::StrCat("chunk ", j, " is no longer cached (",
                                     view.status().message(), "); compute it"));
      }
      finished = true;
      break;
    }
    bool aborted = false;
    if (absl::Status s = SendChunk(j, *view, &aborted); absl::IsCancelled(s)) {
      result = ToGrpcStatus(s);  // The client is gone: no Done to send.
      finished = true;
      break;
    } else if (!s.ok()) {
      // The chunk failed its checksum as it was read or copied (and is deleted), was
      // deleted while it was read a frame at a time, or its copy into the worker's GPU
      // memory failed on the device: the worker computes it and what is below, and keeps
      // what was streamed. (Ended without Done, the session once waited out its linger
      // for a half-close the client never sends, and then answered CANCELLED.)
      result = Finish(j + 1, v1::PrefillDone::CHUNK_UNAVAILABLE,
                      absl::StrCat("chunk ", j, ": ", s.message(), "; compute it"));
      finished = true;
      break;
    }
    if (aborted) {
      // The worker got there first (or left): chunk j is its to keep. The loop's
      // checks at j-1 see why; restart them at j with the chunk abandoned.
      const Progress q = Snapshot();
      if (!q.error.ok()) {
        result = ToGrpcStatus(q.error);
      } else if (runner_->shutting_down()) {
        result = Finish(j + 1, v1::PrefillDone::SHUTTING_DOWN, "kvtierd is shutting down",
                        ToGrpcStatus(absl::UnavailableError("kvtierd is shutting down")));
      } else if (q.client_closed && q.computed <= j) {
        result = Finish(j + 1, v1::PrefillDone::CLIENT_DONE, "client half-closed");
      } else {
        result = Finish(j + 1, v1::PrefillDone::MET, "worker computed the chunk in flight");
      }
      finished = true;
      break;
    }
  }
  if (!finished) result = Finish(0, v1::PrefillDone::ALL_STREAMED, "");
  StopThreads();
  return result;
}

}  // namespace

PrefillRunner::PrefillRunner(PrefillRunnerOptions options, PrefillMetrics* metrics)
    : options_(options),
      metrics_(metrics),
      estimators_(options.estimators),
      limit_(options.bandwidth_limit),
      ssd_gate_(std::max(1, options.ssd_read_concurrency)) {}

absl::StatusOr<v1::PrefillOpen> PrefillRunner::ReadOpen(grpc::ServerContext* ctx,
                                                        PrefillStream* stream,
                                                        RegionTable* regions,
                                                        StallReaper* stalls) const {
  v1::PrefillClientMessage first;
  bool read = false;
  {
    StallReaper::Watched stall(stalls, [ctx] { ctx->TryCancel(); });
    stall.WaitingOnClient(true);
    read = stream->Read(&first);
    stall.WaitingOnClient(false);
  }
  if (!read) {
    if (ctx->IsCancelled()) return absl::CancelledError("client went away before Open");
    // Half-closed without an Open, or sent bytes that do not parse (gRPC ends the read
    // the same way for both): a request that can never succeed.
    return absl::InvalidArgumentError(
        "open: the stream ended before a PrefillOpen, or its first message is not a "
        "kvtier.v1.PrefillClientMessage");
  }
  if (!first.has_open()) {
    return absl::InvalidArgumentError("open: the first message of a Prefill must be open");
  }
  const v1::PrefillOpen& open = first.open();
  if (open.keys_size() > static_cast<int>(options_.max_keys)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "open.keys: ", open.keys_size(), " keys, more than max_keys_per_request (",
        options_.max_keys, ")"));
  }
  for (int i = 0; i < open.keys_size(); ++i) {
    if (auto key = ChunkKey::FromBytes(open.keys(i)); !key.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("open.keys[", i, "]: ", key.status().message()));
    }
  }
  if (open.has_compute_estimate()) {
    const auto& e = open.compute_estimate();
    // NaN fails both comparisons; an infinite estimate would make every plan a tie
    // between 'compute it' and 'never finishes'.
    if (!(e.a_seconds() >= 0) || !(e.b_seconds() >= 0) || !std::isfinite(e.a_seconds()) ||
        !std::isfinite(e.b_seconds())) {
      return absl::InvalidArgumentError(
          "open.compute_estimate: a and b must be finite and >= 0");
    }
  }
  if (open.has_target()) {
    // The region (its offsets need the layout's chunk size: Session::Open checks them).
    absl::Status found;
    if (regions != nullptr && regions->IsDevice(open.target().region_id())) {
      if (open.target().record_events()) {
        return absl::InvalidArgumentError(
            "open.target.record_events: a Prefill session signals chunks by its frames, not "
            "events");
      }
      found = FindDeviceTargetRegion(regions, open.target()).status();
    } else {
      found = FindTargetRegion(regions, open.target()).status();
    }
    if (!found.ok()) return absl::Status(found.code(), absl::StrCat("open.", found.message()));
  }
  return *std::move(first.mutable_open());
}

absl::Status PrefillRunner::CheckOpen(TieredStore* store, const v1::PrefillOpen& open,
                                      RegionTable* regions, const TenantScope& scope) const {
  auto layout = store->FindLayout(scope.Internal(open.namespace_id()));
  if (!layout.ok()) return layout.status();
  if (!open.has_target()) return absl::OkStatus();
  const auto in_open = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("open.", s.message()));
  };
  uint64_t region_bytes = 0;
  if (regions != nullptr && regions->IsDevice(open.target().region_id())) {
    if (!store->has_gpu()) {
      return absl::FailedPreconditionError("open.target: this daemon has no GPU");
    }
    auto region = FindDeviceTargetRegion(regions, open.target());
    if (!region.ok()) return in_open(region.status());
    region_bytes = (*region)->size();
  } else {
    auto region = FindTargetRegion(regions, open.target());
    if (!region.ok()) return in_open(region.status());
    region_bytes = (*region)->size();
  }
  if (auto offsets = TargetOffsets(open.target(), open.keys_size(), layout->ChunkBytes(),
                                   region_bytes);
      !offsets.ok()) {
    return in_open(offsets.status());
  }
  return absl::OkStatus();
}

grpc::Status PrefillRunner::Run(TieredStore* store, grpc::ServerContext* ctx,
                                PrefillStream* stream, const v1::PrefillOpen& open,
                                RegionTable* regions, const TenantScope& scope,
                                StallReaper* stalls,
                                const std::function<void(uint64_t)>& on_namespace,
                                StillAdmitted still_admitted) {
  Session session(this, store, ctx, stream, open, regions, scope, stalls, on_namespace,
                  std::move(still_admitted));
  return session.Run();
}

}  // namespace kvtier
