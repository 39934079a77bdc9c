#include "server/put_reactor.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/status_util.h"

namespace kvtier {
namespace {

// The chunk's place in its key chain, from its first frame (chunk_index, prev_key).
absl::StatusOr<ChunkLineage> ParseLineage(const v1::PutFrame& frame) {
  ChunkLineage lineage;
  if (frame.has_chunk_index()) {
    if (frame.chunk_index() == ChunkLineage::kUnknownPosition) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk_index: ", frame.chunk_index(), " is out of range"));
    }
    lineage.position = frame.chunk_index();
  }
  if (!frame.prev_key().empty()) {
    auto parent = ChunkKey::FromBytes(frame.prev_key());
    if (!parent.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prev_key: ", parent.status().message()));
    }
    if (frame.has_chunk_index() && frame.chunk_index() == 0) {
      return absl::InvalidArgumentError("prev_key: chunk 0 of a chain has no previous key");
    }
    lineage.has_parent = true;
    lineage.parent = *parent;
  }
  return lineage;
}

}  // namespace

PutReactor::PutReactor(grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response,
                       TieredStore* store, RpcMetrics* metrics, RegionTable* regions,
                       ParallelCopy* copier, uint64_t max_frame_bytes, TenantScope tenant)
    : ctx_(ctx),
      response_(response),
      store_(store),
      regions_(regions),
      copier_(copier),
      max_frame_bytes_(max_frame_bytes),
      tenant_(std::move(tenant)),
      scope_(metrics, RpcMethod::kPut) {
  if (store_ == nullptr) {
    finished_early_ = true;
    Finish(scope_.Done(ToGrpcStatus(absl::UnavailableError(
        "kvtierd is starting up (recovering the SSD tier's index); retry shortly"))));
    return;
  }
}

void PutReactor::Begin(StreamLimiter* put_streams) {
  if (finished_early_) return;
  put_streams_ = put_streams;
  if (put_streams == nullptr) {
    StartReading();
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    line_ = put_streams;  // Before it can be granted, on another thread.
  }
  absl::StatusOr<std::optional<StreamLimiter::Ticket>> place =
      put_streams->TryAcquireOrWait(this);
  if (place.ok() && !place->has_value()) return;  // In line: PlaceGranted or WaitRefused.
  {
    absl::MutexLock lock(&mu_);
    line_ = nullptr;
  }
  if (!place.ok()) {
    RefusePlace(place.status());
    return;
  }
  put_place_ = **std::move(place);
  StartReading();
}

void PutReactor::PlaceGranted(StreamLimiter::Ticket put_place) {
  {
    absl::MutexLock lock(&mu_);
    line_ = nullptr;
  }
  put_place_ = std::move(put_place);
  // Cancelled meanwhile: the read fails at once and the call ends as any cancelled one.
  StartReading();
}

void PutReactor::WaitRefused(absl::Status refusal) {
  {
    absl::MutexLock lock(&mu_);
    line_ = nullptr;
  }
  RefusePlace(refusal);
}

void PutReactor::StartReading() {
  // Accepted: say so at once. A client may wait for these headers before sending its
  // first frame, so that a put refused at admission (RESOURCE_EXHAUSTED, sent with the
  // status instead) or waiting in line costs it no payload bytes.
  StartSendInitialMetadata();
  stall_.WaitingOnClient(true);  // The first read is pending.
  StartRead(&message_);
}

void PutReactor::RefusePlace(const absl::Status& refusal) {
  ctx_->AddTrailingMetadata("kvtier-retry-after-ms", "100");
  ReleasePlaces();
  Finish(scope_.Done(ToGrpcStatus(refusal)));
}

void PutReactor::TellPlaces() {
  // After this call's own place went back: a client alone on the daemon hears "free".
  const bool free = put_streams_ == nullptr || put_streams_->Plentiful();
  ctx_->AddTrailingMetadata("kvtier-put-places", free ? "free" : "scarce");
}

void PutReactor::WatchForStalls(StallReaper* reaper) {
  // Not idle until its first read is pending (StartReading): a call waiting in line
  // waits for the daemon.
  // Its place within max_put_buffer is contended: reclaimed sooner while others wait.
  stall_ = StallReaper::Watched(reaper, [ctx = ctx_] { ctx->TryCancel(); },
                                /*contendable=*/true);
}

void PutReactor::OnReadDone(bool ok) {
  stall_.WaitingOnClient(false, ok ? message_.Length() : 0);
  if (!ok) {
    EndOfStream();
    return;
  }
  OnFrame();
}

void PutReactor::OnFrame() {
  if (!parser_.Parse(message_)) {
    Fail(absl::InvalidArgumentError("frame: not a PutFrame message"));
    return;
  }
  const v1::PutFrame& frame = parser_.header();
  if (absl::Status s = FrameBytes(); !s.ok()) {
    Fail(s);
    return;
  }
  auto key = ChunkKey::FromBytes(frame.key());
  if (!key.ok()) {
    Fail(absl::InvalidArgumentError(absl::StrCat("key: ", key.status().message())));
    return;
  }
  if (frame.namespace_id() != public_ns_) {  // One hash per namespace, not per frame.
    public_ns_ = frame.namespace_id();
    internal_ns_ = tenant_.Internal(public_ns_);
  }
  const ChunkId id{internal_ns_, *key};
  if (!in_chunk_) {
    if (frame.offset() != 0) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("offset: frame out of order: first frame of chunk ", key->ToHex(),
                       " has offset ", frame.offset(), ", expected 0")));
      return;
    }
    if (still_admitted_) {
      // Credentials revoked by a tenants file reloaded while the stream was open.
      if (absl::Status s = still_admitted_(); !s.ok()) {
        Fail(s);
        return;
      }
    }
    auto layout = store_->FindLayout(id.ns);
    if (!layout.ok()) {
      Fail(layout.status());
      return;
    }
    // Before the tenant's quota makes room for it (evicting the tenant's chunks) and
    // then perhaps answers "retry": a chunk this daemon cannot store at all.
    if (absl::Status s = store_->CheckPuttable(*layout); !s.ok()) {
      Fail(s);
      return;
    }
    in_chunk_ = true;
    current_ = id;
    chunk_bytes_ = layout->ChunkBytes();
    received_ = 0;
    // A first frame that can never be stored is refused before it asks for room: it
    // must not wait for RAM and then be told RESOURCE_EXHAUSTED, which means "retry".
    if (absl::Status s = CheckSize(); !s.ok()) {
      Fail(s);
      return;
    }
    auto lineage = ParseLineage(frame);
    if (!lineage.ok()) {
      Fail(lineage.status());
      return;
    }
    lineage_ = *lineage;
    // Within the tenant's quotas, making room among its own chunks (a chunk stored
    // already needs none: its frames are drained).
    if (quotas_ != nullptr && store_->Locate(id) == Tier::kNone) {
      if (absl::Status s = quotas_->AdmitPut(store_, tenant_, id.ns, chunk_bytes_); !s.ok()) {
        Fail(s);
        return;
      }
    }
    BeginChunk(id, frame.token_count());
    return;
  }
  if (!(id == current_)) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "key: frame for chunk ", key->ToHex(), " arrived before chunk ", current_.key.ToHex(),
        " was complete (", received_, " of ", chunk_bytes_,
        " bytes); frames of different chunks may not interleave")));
    return;
  }
  if (frame.offset() != received_) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("offset: frame out of order for chunk ", key->ToHex(), ": offset ",
                     frame.offset(), ", expected ", received_)));
    return;
  }
  Consume();
}

absl::Status PutReactor::FrameBytes() {
  const v1::PutFrame& frame = parser_.header();
  region_.reset();
  device_region_.reset();
  region_bytes_ = {};
  data_ = {};
  if (!frame.has_region()) {
    data_size_ = parser_.data_size();
    if (data_size_ == 0 || data_size_ > max_frame_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: frame carries ", data_size_,
                       " bytes; must be 1 to max_frame_size (", max_frame_bytes_, ")"));
    }
    data_ = parser_.pieces();
    return absl::OkStatus();
  }
  if (parser_.data_size() != 0) {
    return absl::InvalidArgumentError(
        "region: a frame names a region or carries data, not both");
  }
  if (regions_ == nullptr) {
    return absl::FailedPreconditionError(
        "region: this daemon serves no registered memory (shm_socket is off); send data");
  }
  const v1::RegionRef& ref = frame.region();
  if (regions_->IsDevice(ref.region_id())) {
    // A worker's GPU memory: copied on the device in Consume.
    auto device = regions_->FindDevice(ref.region_id(), ref.token());
    if (!device.ok()) return device.status();
    if (ref.length() == 0 || ref.offset() > (*device)->size() ||
        ref.length() > (*device)->size() - ref.offset()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region: [", ref.offset(), ", +", ref.length(), ") is not a non-empty range of "
          "the ", (*device)->size(), "-byte GPU region"));
    }
    device_region_ = *std::move(device);
    device_src_ = device_region_->base() + ref.offset();
    data_size_ = ref.length();
    return absl::OkStatus();
  }
  auto region = regions_->Find(ref.region_id(), ref.token());
  if (!region.ok()) return region.status();
  auto src = (*region)->Range(ref.offset(), ref.length(), "region");
  if (!src.ok()) return src.status();
  // Faulted in by Consume, once the length is known to fit the chunk: a range of a
  // sparse region faulted in first would allocate its holes, however large.
  // The reference keeps the mapping for the copy even if the owner goes away meanwhile.
  region_ = *std::move(region);
  region_bytes_ = absl::string_view(*src, ref.length());
  data_ = absl::MakeConstSpan(&region_bytes_, 1);
  data_size_ = ref.length();
  return absl::OkStatus();
}

void PutReactor::BeginChunk(const ChunkId& id, uint32_t token_count) {
  {
    absl::MutexLock lock(&mu_);
    admitting_ = true;
  }
  const uint64_t ticket = store_->BeginPutAsync(
      id, token_count, [this](Admission writer) { OnAdmission(std::move(writer)); });
  std::optional<Admission> answer;
  bool cancel = false;
  {
    absl::MutexLock lock(&mu_);
    admitting_ = false;
    if (early_answer_.has_value()) {
      answer = std::move(early_answer_);
      early_answer_.reset();
    } else {
      ticket_ = ticket;
      cancel = cancelled_;
    }
  }
  if (answer.has_value()) {
    Admitted(*std::move(answer));
  } else if (cancel) {
    store_->CancelPut(ticket);  // Its answer (Cancelled) ends the call.
  }
}

void PutReactor::OnAdmission(Admission writer) {
  {
    absl::MutexLock lock(&mu_);
    ticket_ = 0;
    if (admitting_) {  // BeginChunk takes it from here.
      early_answer_ = std::move(writer);
      return;
    }
  }
  Admitted(std::move(writer));
}

void PutReactor::Admitted(Admission writer) {
  if (!writer.ok()) {
    Fail(writer.status());
    return;
  }
  writer_ = *std::move(writer);  // Null: already stored; the chunk's frames are drained.
  if (writer_) writer_->set_lineage(lineage_);
  Consume();
}

absl::Status PutReactor::CheckSize() const {
  const v1::PutFrame& frame = parser_.header();
  if (data_size_ > chunk_bytes_ - received_) {
    return absl::InvalidArgumentError(absl::StrCat(
        frame.has_region() ? "region" : "data", ": payload size wrong: chunk ",
        current_.key.ToHex(), " must be exactly ", chunk_bytes_,
        " bytes for this namespace's layout; this frame would bring it to ",
        received_ + data_size_));
  }
  if (received_ + data_size_ == chunk_bytes_ && !frame.has_crc32c()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crc32c: required on the frame that completes chunk ", current_.key.ToHex()));
  }
  return absl::OkStatus();
}

void PutReactor::Consume() {
  if (absl::Status s = CheckSize(); !s.ok()) {
    Fail(s);
    return;
  }
  if (writer_ && device_region_) {
    // No reaction can come meanwhile (no read is pending), so the call cannot end
    // before the copy's callback runs.
    store_->AppendFromDeviceAsync(writer_.get(), device_src_, data_size_,
                                  [this](absl::Status s) {
                                    if (!s.ok()) {
                                      Fail(s);
                                      return;
                                    }
                                    Consumed();
                                  });
    return;
  }
  if (writer_ && region_) {
    if (absl::Status s = region_->Populate(region_bytes_.data(), region_bytes_.size(),
                                           MappedRegion::Access::kRead);
        !s.ok()) {
      Fail(s);
      return;
    }
  }
  if (writer_) {
    for (absl::string_view piece : data_) {
      // Region bytes (one large piece) go on the copier's threads; a frame's bytes in
      // gRPC's slices are copied here, slice by slice.
      if (absl::Status s = writer_->Append(piece, region_ ? copier_ : nullptr); !s.ok()) {
        Fail(s);
        return;
      }
    }
  }
  Consumed();
}

void PutReactor::Consumed() {
  const v1::PutFrame& frame = parser_.header();
  received_ += data_size_;
  resp_.set_bytes_received(resp_.bytes_received() + data_size_);
  if (received_ < chunk_bytes_) {
    ReadNext();
    return;
  }
  // The chunk is complete (CheckSize saw its crc32c).
  if (!writer_) {
    resp_.set_chunks_already_present(resp_.chunks_already_present() + 1);
    in_chunk_ = false;
    ReadNext();
    return;
  }
  store_->CommitPutAsync(std::move(writer_), frame.crc32c(),
                         [this](absl::StatusOr<bool> s) { Committed(std::move(s)); });
}

void PutReactor::Committed(absl::StatusOr<bool> stored) {
  if (!stored.ok()) {
    Fail(stored.status());
    return;
  }
  // Two streams putting one chunk at once both get this far; the one whose commit
  // lost the race counts it as already present, so the counts add up.
  if (*stored) {
    resp_.set_chunks_stored(resp_.chunks_stored() + 1);
  } else {
    resp_.set_chunks_already_present(resp_.chunks_already_present() + 1);
  }
  in_chunk_ = false;
  ReadNext();
}

void PutReactor::ReadNext() {
  region_.reset();  // The frame is consumed: its region may go.
  device_region_.reset();
  stall_.WaitingOnClient(true);
  StartRead(&message_);
}

void PutReactor::EndOfStream() {
  if (ctx_->IsCancelled()) {
    Fail(absl::CancelledError(
        "put stream cancelled (by the client, or by the daemon after client_idle_timeout "
        "without a frame, or put_place_idle while other Puts waited for its place)"));
    return;
  }
  if (in_chunk_) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "data: payload size wrong: stream ended with chunk ", current_.key.ToHex(), " at ",
        received_, " of ", chunk_bytes_, " bytes")));
    return;
  }
  const std::string bytes = resp_.SerializeAsString();
  grpc::Slice slice(bytes);
  *response_ = grpc::ByteBuffer(&slice, 1);
  ReleasePlaces();
  TellPlaces();
  Finish(scope_.Done(grpc::Status::OK));
}

void PutReactor::Fail(const absl::Status& status) {
  writer_.reset();  // Its slots go back to the pool; nothing was indexed.
  region_.reset();
  device_region_.reset();
  ReleasePlaces();
  TellPlaces();
  Finish(scope_.Done(ToGrpcStatus(absl::Status(
      status.code(),
      absl::StrCat(status.message(), " [", resp_.chunks_stored(),
                   " chunks stored by this stream before the error; the chunk in progress "
                   "was not stored]")))));
}

void PutReactor::OnCancel() {
  uint64_t ticket;
  StreamLimiter* line;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    ticket = ticket_;
    line = line_;
  }
  // A put waiting in line leaves it and ends here; one granted or refused meanwhile
  // ends on that path (its first read fails, or it is finished already).
  if (line != nullptr && line->Leave(this)) {
    ReleasePlaces();
    Finish(scope_.Done(ToGrpcStatus(
        absl::CancelledError("put stream cancelled while waiting in line for a place"))));
    return;
  }
  // A put waiting for room gives up its place; the Cancelled answer ends the call.
  if (ticket != 0) store_->CancelPut(ticket);
}

void PutReactor::OnDone() {
  stall_.Reset();  // Before the context goes.
  delete this;
}

}  // namespace kvtier
