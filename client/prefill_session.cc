#include "client/prefill_session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

// Room left in a message for a PrefillChunkFrame's fields other than `data`, as in
// kvtier_client.cc (the same limit on the client's received message size applies).
constexpr int64_t kFrameOverheadBytes = 4096;

// The most of a chunk's bytes reserved before they arrive, as Get's in kvtier_client.cc:
// without the layout, Plan.chunk_bytes is the daemon's word alone.
constexpr uint64_t kMaxUpFrontReserveBytes = uint64_t{1} << 30;

absl::Status Violation(absl::string_view what) {
  return absl::InternalError(absl::StrCat("Prefill: server protocol violation: ", what));
}

// PrefillOptions::into must hold `keys` chunks of `chunk_bytes` back to back.
absl::Status CheckInto(absl::Span<char> into, uint64_t keys, uint64_t chunk_bytes) {
  if (keys == 0 || into.size() / keys >= chunk_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("Prefill: into holds ", into.size(),
                                                 " bytes; ", keys, " chunks of ", chunk_bytes,
                                                 " bytes need ", keys * chunk_bytes));
}

}  // namespace

absl::Status PrefillOptions::Validate() const {
  if (compute_estimate.has_value()) {
    const double a = compute_estimate->a_seconds, b = compute_estimate->b_seconds;
    if (!std::isfinite(a) || a < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("compute_estimate.a_seconds must be finite and >= 0, got ", a));
    }
    if (!std::isfinite(b) || b < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("compute_estimate.b_seconds must be finite and >= 0, got ", b));
    }
  }
  if (!into.empty() && on_chunk) {
    return absl::InvalidArgumentError("Prefill: pass into or on_chunk, not both");
  }
  if (into_device.has_value() && (!into.empty() || on_chunk)) {
    return absl::InvalidArgumentError("Prefill: pass one of into_device, into and on_chunk");
  }
  if (into.empty() && !into_device.has_value() && on_chunk_in_place) {
    return absl::InvalidArgumentError("Prefill: on_chunk_in_place needs into or into_device");
  }
  if (rpc_deadline < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_deadline must not be negative");
  }
  return absl::OkStatus();
}

PrefillSession::PrefillSession(uint32_t num_keys, PrefillOptions options)
    : num_keys_(num_keys), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<PrefillSession>> PrefillSession::Start(
    KvTierClient& client, uint64_t namespace_id, std::vector<ChunkKey> keys,
    PrefillOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (keys.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("Prefill: ", keys.size(), " keys"));
  }
  const uint32_t max_frame = options.max_frame_bytes != 0
                                 ? options.max_frame_bytes
                                 : client.options().max_frame_bytes;
  if (int64_t{max_frame} + kFrameOverheadBytes > client.options().max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_frame_bytes (", max_frame, ") must leave ", kFrameOverheadBytes,
        " bytes of room within the client's max_message_bytes (",
        client.options().max_message_bytes, ")"));
  }
  const absl::Duration deadline = options.rpc_deadline > absl::ZeroDuration()
                                      ? options.rpc_deadline
                                      : client.options().rpc_deadline;

  v1::PrefillClientMessage open_msg;
  v1::PrefillOpen& open = *open_msg.mutable_open();
  open.set_namespace_id(namespace_id);
  open.mutable_keys()->Reserve(static_cast<int>(keys.size()));
  for (const ChunkKey& k : keys) open.add_keys(k.ToByteString());
  if (options.compute_estimate.has_value()) {
    open.mutable_compute_estimate()->set_a_seconds(options.compute_estimate->a_seconds);
    open.mutable_compute_estimate()->set_b_seconds(options.compute_estimate->b_seconds);
  }
  open.set_max_bytes_per_second(options.max_bytes_per_second);
  open.set_max_frame_bytes(max_frame);
  // Into the client's shared memory: the daemon copies the chunks there (same host).
  // Only for a buffer known to hold every key's chunk: the daemon bounds its copies by
  // the whole region, not by `into`, so a short `into` inside a larger shared buffer
  // would be written past its end. The size is checked here, before anything is sent;
  // when it cannot be known, the chunks come on the stream (checked at the plan).
  std::shared_ptr<SharedBuffer> into_shared;
  if (!options.into.empty() && !keys.empty()) {
    into_shared = client.SharedBufferOf(options.into.data(), options.into.size());
    const std::optional<uint64_t> chunk_bytes =
        into_shared != nullptr ? client.ChunkBytes(namespace_id) : std::nullopt;
    if (chunk_bytes.has_value()) {
      if (absl::Status s = CheckInto(options.into, keys.size(), *chunk_bytes); !s.ok()) {
        return s;
      }
    }
    if (!chunk_bytes.has_value()) into_shared.reset();
  }
  if (into_shared != nullptr) {
    v1::RegionTarget& target = *open.mutable_target();
    target.set_region_id(into_shared->region_id());
    target.set_token(into_shared->token());
    target.add_offsets(static_cast<uint64_t>(options.into.data() - into_shared->data()));
  } else if (options.into_device.has_value()) {
    // The daemon checks that every key's chunk fits the region; so does the client,
    // where it knows the region's size and the chunk size, before any call.
    const PrefillOptions::DeviceInto& into = *options.into_device;
    const std::optional<uint64_t> chunk_bytes =
        into.region.bytes != 0 ? client.ChunkBytes(namespace_id) : std::nullopt;
    if (chunk_bytes.has_value() &&
        (into.offset > into.region.bytes ||
         (into.region.bytes - into.offset) / *chunk_bytes < keys.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Prefill: ", keys.size(), " chunks of ", *chunk_bytes, " bytes at offset ",
          into.offset, " do not fit the ", into.region.bytes, "-byte GPU region"));
    }
    v1::RegionTarget& target = *open.mutable_target();
    target.set_region_id(options.into_device->region.region_id);
    target.set_token(options.into_device->region.token);
    target.add_offsets(options.into_device->offset);
  }

  // The layout's chunk size (the client's cache, or one DataPlane call): the Plan's is
  // held to it, since every copy into `into` and every chunk handed over is sized by it.
  const std::optional<uint64_t> layout_chunk_bytes =
      keys.empty() ? std::nullopt : client.ChunkBytes(namespace_id);
  std::unique_ptr<PrefillSession> session(
      new PrefillSession(static_cast<uint32_t>(keys.size()), std::move(options)));
  PrefillSession& s = *session;
  s.placed_by_daemon_ = into_shared != nullptr || s.options_.into_device.has_value();
  s.into_shared_ = std::move(into_shared);
  s.start_time_ = absl::Now();
  s.ctx_.set_deadline(absl::ToChronoTime(s.start_time_ + deadline));
  if (!client.options().bearer_token.empty()) {
    s.ctx_.AddMetadata("authorization", absl::StrCat("Bearer ", client.options().bearer_token));
  }
  s.stream_ = client.stub()->Prefill(&s.ctx_);
  s.writer_ = std::make_unique<PrefillStreamWriter>(s.stream_.get());

  // No reader thread yet, so this thread may both write and read. A failed Write means
  // the call already ended; the Read below then fails too and FinishCall says why.
  s.stream_->Write(open_msg);
  v1::PrefillServerMessage first;
  if (!s.stream_->Read(&first)) {
    grpc::Status status = s.writer_->FinishCall();
    if (!status.ok()) return FromGrpcStatus(status);
    return Violation("the call ended without a Plan");
  }
  absl::Status plan_error;
  if (first.msg_case() != v1::PrefillServerMessage::kPlan) {
    plan_error = Violation(absl::StrCat("the first message is not a Plan (case ",
                                        static_cast<int>(first.msg_case()), ")"));
  } else {
    s.plan_ = std::move(*first.mutable_plan());
    const uint32_t h = s.plan_.cached_prefix();
    if (h > s.num_keys_) {
      plan_error = Violation(absl::StrCat("Plan.cached_prefix ", h, " > ", s.num_keys_,
                                          " keys"));
    } else if (static_cast<uint32_t>(s.plan_.tiers_size()) != h) {
      plan_error = Violation(absl::StrCat("Plan has ", s.plan_.tiers_size(),
                                          " tiers for cached_prefix ", h));
    } else if (h > 0 && s.plan_.chunk_bytes() == 0) {
      plan_error = Violation("Plan.chunk_bytes is 0");
    } else if (h > 0 && s.plan_.chunk_bytes() > kMaxAcceptedChunkBytes) {
      plan_error = Violation(absl::StrCat("Plan.chunk_bytes ", s.plan_.chunk_bytes(),
                                          " is past the largest chunk accepted (",
                                          kMaxAcceptedChunkBytes, ")"));
    } else if (h > 0 && layout_chunk_bytes.has_value() &&
               s.plan_.chunk_bytes() != *layout_chunk_bytes) {
      plan_error = Violation(absl::StrCat("Plan.chunk_bytes ", s.plan_.chunk_bytes(),
                                          ", the layout's chunks are ", *layout_chunk_bytes));
    } else if (s.plan_.predicted_meeting() > h) {
      plan_error = Violation(absl::StrCat("Plan.predicted_meeting ",
                                          s.plan_.predicted_meeting(),
                                          " > cached_prefix ", h));
    } else if (h > 0 && !s.options_.into.empty()) {
      plan_error = CheckInto(s.options_.into, s.num_keys_, s.plan_.chunk_bytes());
    }
  }
  if (!plan_error.ok()) {
    s.ctx_.TryCancel();
    while (s.stream_->Read(&first)) {
    }
    // Ends CANCELLED (or with an error racing the cancel); plan_error is the cause.
    FromGrpcStatus(s.writer_->FinishCall()).IgnoreError();
    return plan_error;
  }
  s.h_ = s.plan_.cached_prefix();
  {
    absl::MutexLock l(&s.mu_);
    s.lowest_started_ = s.h_;
    s.received_.assign(s.h_, false);
  }
  s.last_index_ = s.h_;
  s.reader_ = std::thread([&s] { s.ReaderLoop(); });
  return session;
}

PrefillSession::~PrefillSession() {
  if (!reader_.joinable()) return;
  bool settled;
  {
    absl::MutexLock l(&mu_);
    settled = done_.has_value() && finish_called_;
    if (settled) {
      // Finish half-closed after Done: the daemon ends the call on its own, promptly.
      auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ended_; };
      mu_.AwaitWithTimeout(absl::Condition(&ended), absl::Seconds(1));
    }
  }
  // Cancelling an ended call is a no-op. Otherwise the reader's blocked Read returns
  // false and it finishes the call.
  ctx_.TryCancel();
  reader_.join();
}

void PrefillSession::JoinReader() {
  if (reader_.joinable()) reader_.join();
}

absl::Status PrefillSession::Close() {
  if (reader_.joinable()) {
    bool finished;
    {
      absl::MutexLock l(&mu_);
      finished = finish_called_;
    }
    if (!finished) ctx_.TryCancel();
    // After Finish the call was half-closed; the daemon ends it (its deadline bounds
    // this wait in any case).
    reader_.join();
  }
  absl::MutexLock l(&mu_);
  if (!error_.ok()) return error_;
  return call_status_;
}

uint32_t PrefillSession::stream_reached() const {
  absl::MutexLock l(&mu_);
  return lowest_started_;
}

bool PrefillSession::ShouldCompute(uint32_t i) const {
  if (i >= h_) return true;
  absl::MutexLock l(&mu_);
  if (ended_ && !error_.ok()) return true;
  if (done_.has_value()) return i < done_->first_streamed();
  const bool base = i < lowest_started_;
  // Chunks above the one in flight, and a complete lowest one, are the worker's
  // already: nothing to refine.
  if (!options_.use_forecast || i > lowest_started_ ||
      (i == lowest_started_ && in_flight_bytes_ == 0)) {
    return base;
  }
  // The margin by which one side must win before the forecast overrides the base
  // rule. Near a tie the two choices cost about the same, and the daemon's own
  // forecast (from its side, with its estimates) might judge the other way: a worker
  // that stood aside for a chunk the daemon then declines to stream would sit idle
  // until Done.
  constexpr double kMargin = 1.2;
  const double compute = ComputeForecast(i);
  const double stream = StreamForecast(i);
  if (compute < 0 || stream < 0) return base;
  if (i == lowest_started_) return compute * kMargin < stream;  // Overtake it.
  return !(stream * kMargin < compute);                        // Or stand aside.
}

double PrefillSession::ComputeForecast(uint32_t i) const {
  if (options_.compute_estimate.has_value()) {
    return options_.compute_estimate->a_seconds +
           options_.compute_estimate->b_seconds * static_cast<double>(i);
  }
  // The worker's own pace. Cost grows with i, so this errs low by about b per chunk;
  // the margin absorbs it.
  return compute_interval_seconds_ > 0 ? compute_interval_seconds_ : -1;
}

double PrefillSession::StreamForecast(uint32_t i) const {
  const double chunk_bytes = static_cast<double>(plan_.chunk_bytes());
  double per_chunk = plan_.stream_bytes_per_second() > 0
                         ? chunk_bytes / plan_.stream_bytes_per_second()
                         : 0;
  per_chunk = std::max(per_chunk, chunk_interval_seconds_);
  if (!(per_chunk > 0)) return -1;
  // What is left of the chunk in flight (lowest_started_, partly received), then the
  // chunks below it down to i; or, between chunks, [i, lowest_started_).
  if (in_flight_bytes_ > 0) {
    return per_chunk * (1.0 - static_cast<double>(in_flight_bytes_) / chunk_bytes) +
           static_cast<double>(lowest_started_ - i) * per_chunk;
  }
  return static_cast<double>(lowest_started_ - i) * per_chunk;
}

absl::Status PrefillSession::ReportComputed(uint32_t i) {
  if (i >= num_keys_) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReportComputed(", i, "): the request has ", num_keys_, " chunks"));
  }
  bool send = false;
  {
    absl::MutexLock l(&mu_);
    if (finish_called_) {
      return absl::FailedPreconditionError("ReportComputed after Finish");
    }
    if (i < computed_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ReportComputed(", i, "): chunks [0, ", computed_, ") were already reported"));
    }
    const absl::Time now = absl::Now();
    if (last_report_ != absl::InfinitePast()) {
      compute_interval_seconds_ =
          absl::ToDoubleSeconds(now - last_report_) / static_cast<double>(i + 1 - computed_);
    }
    last_report_ = now;
    computed_ = i + 1;
    // After Done the daemon no longer reads Progress; after the call ended, nobody does.
    send = !done_.has_value() && !ended_;
  }
  // Concurrent callers may get here out of order; the writer drops a value below one it
  // already sent. A failed Write means the daemon ended the call (after Done, racing
  // this Write, or with an error); the reader thread gets its status and Finish
  // returns it.
  if (send) writer_->SendProgress(i + 1);
  return absl::OkStatus();
}

void PrefillSession::ReaderLoop() {
  v1::PrefillServerMessage msg;
  absl::Status client_error;
  while (stream_->Read(&msg)) {
    if (done_seen_) {
      client_error = Violation(absl::StrCat("a message (case ",
                                            static_cast<int>(msg.msg_case()),
                                            ") after Done"));
      break;
    }
    switch (msg.msg_case()) {
      case v1::PrefillServerMessage::kChunk:
        client_error = OnFrame(*msg.mutable_chunk());
        break;
      case v1::PrefillServerMessage::kDone:
        client_error = OnDone(msg.done());
        break;
      case v1::PrefillServerMessage::kPlan:
        client_error = Violation("a second Plan");
        break;
      default:
        client_error = Violation("a message with no content");
        break;
    }
    if (!client_error.ok()) break;
  }
  if (!client_error.ok()) {
    ctx_.TryCancel();
    while (stream_->Read(&msg)) {
    }
  }
  // The writer keeps any Write from racing or following the stream's Finish.
  const grpc::Status status = writer_->FinishCall();
  absl::MutexLock l(&mu_);
  ended_ = true;
  if (!client_error.ok()) {
    // After a client-detected error the status is CANCELLED (our TryCancel); the
    // client's error is the cause the caller needs.
    error_ = std::move(client_error);
  } else if (!status.ok()) {
    if (done_.has_value()) {
      // A valid Done already settled the session: [s, h) arrived whole and verified,
      // and nothing later can take that back. kvtierd ends Done{SHUTTING_DOWN} with
      // UNAVAILABLE, and cancels a worker that half-closes too late; the result keeps
      // the status for the caller to see.
      call_status_ = FromGrpcStatus(status);
    } else {
      error_ = FromGrpcStatus(status);
    }
  } else if (!done_.has_value()) {
    error_ = Violation(absl::StrCat(
        "the call ended with OK but without Done (", chunks_received_,
        " chunks received of cached_prefix ", h_, ")"));
  }
}

absl::Status PrefillSession::OnFrame(v1::PrefillChunkFrame& frame) {
  const uint32_t index = frame.index();
  const uint64_t chunk_bytes = plan_.chunk_bytes();
  if (index >= h_) {
    return Violation(absl::StrCat("a frame for chunk ", index, " >= cached_prefix ", h_));
  }
  if (assembling_index_ < 0) {
    if (index >= last_index_) {
      return Violation(absl::StrCat("chunk ", index, " streamed after chunk ", last_index_,
                                    " (indices must strictly decrease)"));
    }
    if (frame.offset() != 0) {
      return Violation(absl::StrCat("chunk ", index, " starts at offset ", frame.offset()));
    }
    assembling_index_ = index;
    assembling_expected_crc_ = frame.crc32c();
    assembling_crc_ = 0;
    assembling_tier_ = frame.tier();
    assembling_.clear();
    assembled_ = 0;
    // On the reader thread, where an allocation's exception would end the process.
    if (!frame.last()) assembling_.reserve(std::min(chunk_bytes, kMaxUpFrontReserveBytes));
    absl::MutexLock l(&mu_);
    lowest_started_ = index;
  } else if (index != assembling_index_) {
    return Violation(absl::StrCat("a frame for chunk ", index, " while chunk ",
                                  assembling_index_, " had ", assembled_, " of ",
                                  chunk_bytes, " bytes"));
  }
  const std::string& data = frame.data();
  if (placed_by_daemon_) {
    // The daemon copied the whole chunk into our shared or GPU memory and checked its
    // CRC32C as it did: one frame, no data.
    if (!frame.last() || !data.empty()) {
      return Violation(absl::StrCat("chunk ", index, " of a Prefill into registered memory "
                                    "came with ", data.size(), " data bytes and last = ",
                                    frame.last()));
    }
    assembled_ = chunk_bytes;
  } else {
    if (frame.offset() != assembled_) {
      return Violation(absl::StrCat("offset ", frame.offset(), " for chunk ", index,
                                    ", expected ", assembled_));
    }
    if (data.size() > chunk_bytes - assembled_) {
      return Violation(absl::StrCat("chunk ", index, " exceeds chunk_bytes (", chunk_bytes,
                                    ")"));
    }
    const uint64_t n = data.size();  // Before `data` is moved from below.
    assembling_crc_ = crc32c::Extend(assembling_crc_, data.data(), n);
    if (assembling_.empty() && frame.last()) {
      assembling_ = std::move(*frame.mutable_data());  // Single-frame chunk: no copy.
    } else {
      assembling_.append(data);
    }
    assembled_ += n;
  }
  if (!frame.last()) {
    absl::MutexLock l(&mu_);
    in_flight_bytes_ = assembled_;
    return absl::OkStatus();
  }

  if (assembled_ != chunk_bytes) {
    return Violation(absl::StrCat("last frame of chunk ", index, " after ", assembled_,
                                  " of ", chunk_bytes, " bytes"));
  }
  if (!placed_by_daemon_ && assembling_crc_ != assembling_expected_crc_) {
    return absl::DataLossError(absl::StrFormat(
        "Prefill: chunk %u failed its CRC32C: the daemon says %08x, the %u bytes "
        "received give %08x",
        index, assembling_expected_crc_, assembled_, assembling_crc_));
  }
  {
    absl::MutexLock l(&mu_);
    received_[index] = true;
    ++chunks_received_;
    bytes_received_ += assembled_;
    in_flight_bytes_ = 0;
    const absl::Time now = absl::Now();
    if (last_complete_ != absl::InfinitePast()) {
      chunk_interval_seconds_ = absl::ToDoubleSeconds(now - last_complete_);
    }
    last_complete_ = now;
  }
  last_index_ = index;
  assembling_index_ = -1;
  assembled_ = 0;
  if (!options_.into.empty() || placed_by_daemon_) {
    // Into place only whole and verified: the worker may hold its own copy of a chunk
    // whose streaming was cut short, in the same memory.
    if (!placed_by_daemon_) {
      std::memcpy(options_.into.data() + uint64_t{index} * chunk_bytes, assembling_.data(),
                  chunk_bytes);
      assembling_ = std::string();
    }
    if (options_.on_chunk_in_place) options_.on_chunk_in_place(index, assembling_tier_);
    return options_.callback_status ? options_.callback_status() : absl::OkStatus();
  }
  std::string data_out = std::move(assembling_);
  assembling_ = std::string();
  if (options_.on_chunk) options_.on_chunk(index, std::move(data_out), assembling_tier_);
  return options_.callback_status ? options_.callback_status() : absl::OkStatus();
}

absl::Status PrefillSession::OnDone(const v1::PrefillDone& done) {
  const uint32_t s = done.first_streamed();
  if (s > h_) {
    return Violation(absl::StrCat("Done.first_streamed ", s, " > cached_prefix ", h_));
  }
  if (done.reason() == v1::PrefillDone::ALL_STREAMED && s != 0) {
    return Violation(absl::StrCat("Done reason ALL_STREAMED with first_streamed ", s));
  }
  if (done.reason() == v1::PrefillDone::NOTHING_CACHED && h_ != 0) {
    return Violation(absl::StrCat("Done reason NOTHING_CACHED with cached_prefix ", h_));
  }
  uint64_t discarded = 0;
  if (assembling_index_ >= 0) {
    if (assembling_index_ >= s) {
      return Violation(absl::StrCat("Done with first_streamed ", s, " while chunk ",
                                    assembling_index_, " had only ", assembled_,
                                    " of ", plan_.chunk_bytes(), " bytes"));
    }
    // A chunk below s cut short: discarded, as the contract says.
    discarded = assembled_;
    assembling_index_ = -1;
    assembling_ = std::string();
    assembled_ = 0;
  }
  absl::MutexLock l(&mu_);
  for (uint32_t i = 0; i < h_; ++i) {
    if (i >= s && !received_[i]) {
      return Violation(absl::StrCat("Done with first_streamed ", s, " but chunk ", i,
                                    " of [", s, ", ", h_, ") never arrived complete"));
    }
    if (i < s && received_[i]) {
      // on_chunk already delivered it; the worker would hold it and compute it too.
      return Violation(absl::StrCat("chunk ", i, " was streamed complete but Done says "
                                    "first_streamed ", s));
    }
  }
  bytes_discarded_ += discarded;
  done_ = done;
  done_time_ = absl::Now();
  done_seen_ = true;
  return absl::OkStatus();
}

absl::StatusOr<PrefillResult> PrefillSession::Finish() {
  {
    absl::MutexLock l(&mu_);
    if (finish_called_) return absl::FailedPreconditionError("Finish called twice");
    finish_called_ = true;
    // Half-closing before Done would make the daemon stop with CLIENT_DONE and leave
    // the worker chunks to compute that the daemon was about to stream, so wait for
    // Done, unless the worker already has all of [0, h) (nothing left to stream) or the
    // call ended (the deadline bounds this wait).
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return done_.has_value() || ended_ || computed_ >= h_;
    };
    mu_.Await(absl::Condition(&ready));
  }
  writer_->WritesDone();
  bool failed;
  {
    absl::MutexLock l(&mu_);
    auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return done_.has_value() || ended_;
    };
    mu_.Await(absl::Condition(&settled));
    failed = ended_ && !error_.ok();
  }
  // The reader has ended; joining is immediate.
  if (failed) JoinReader();

  absl::MutexLock l(&mu_);
  if (!error_.ok()) return error_;
  // The reader sets error_ whenever the call ended without a valid Done.
  const v1::PrefillDone& done = *done_;
  const uint32_t s = done.first_streamed();
  PrefillResult r;
  r.first_streamed = s;
  r.cached_prefix = h_;
  r.reason = done.reason();
  r.detail = done.detail();
  r.sources.assign(h_, ChunkSource::kComputed);
  for (uint32_t i = s; i < h_; ++i) r.sources[i] = ChunkSource::kStreamed;
  // kSharedMemory: the daemon placed the chunks in registered memory (shared or GPU).
  r.path = placed_by_daemon_ ? DataPath::kSharedMemory : DataPath::kStream;
  r.chunks_streamed = chunks_received_;
  r.bytes_streamed = bytes_received_;
  r.bytes_discarded = bytes_discarded_;
  r.computed_reported = computed_;
  r.compute_begin = std::min(computed_, s);
  r.compute_end = s;
  r.raced = computed_ > s ? std::min(computed_, h_) - s : 0;
  r.elapsed = done_time_ - start_time_;
  r.daemon_elapsed_seconds = done.elapsed_seconds();
  return r;
}

}  // namespace kvtier
