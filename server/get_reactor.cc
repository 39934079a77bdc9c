#include "server/get_reactor.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/get_plan.h"
#include "server/region_target.h"
#include "server/status_util.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

void AppendVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// GetFrame.data is field 4, wire type 2 (length-delimited).
constexpr char kDataTag = (4 << 3) | 2;

void ReleaseKeepAlive(void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }


// The status a Get ends with when a streamed read of key `key` failed. NotFound means the
// chunk was deleted mid-transfer: Aborted, and `what` says where the partial bytes are
// ("sent; the bytes received for it are"). Anything else keeps its code.
absl::Status StreamedReadError(uint32_t key, const absl::Status& read, absl::string_view what) {
  if (absl::IsNotFound(read)) {
    return absl::AbortedError(absl::StrCat("keys[", key, "]: the chunk was deleted while being ",
                                           what, " incomplete"));
  }
  return absl::Status(read.code(), absl::StrCat("keys[", key, "]: ", read.message()));
}

}  // namespace

GetReactor::GetReactor(grpc::CallbackServerContext* ctx, const v1::GetRequest* request,
                       TieredStore* store, RpcMetrics* metrics, LeaseTable* leases,
                       RegionTable* regions, ParallelCopy* copier, uint64_t max_frame_bytes,
                       uint32_t max_keys, StreamLimiter::Ticket place, StallReaper* stalls,
                       SendTurns* turns, StillAdmitted still_admitted)
    : ctx_(ctx),
      store_(store),
      scope_(metrics, RpcMethod::kGet),
      copier_(copier),
      turns_(turns),
      still_admitted_(std::move(still_admitted)),
      place_(std::move(place)),
      stall_(stalls, [ctx] { ctx->TryCancel(); }) {
  if (absl::Status s = Start(request, leases, regions, max_frame_bytes, max_keys); !s.ok()) {
    absl::MutexLock lock(&mu_);
    error_ = s;
  }
  Pump();
}

absl::Status GetReactor::Start(const v1::GetRequest* request, LeaseTable* leases,
                               RegionTable* regions, uint64_t max_frame_bytes,
                               uint32_t max_keys) {
  auto plan = StartGet(store_, request, max_frame_bytes, max_keys);
  if (!plan.ok()) return plan.status();
  const v1::GetRequest& req = *request;
  ids_ = std::move(plan->ids);
  items_ = std::move(plan->items);
  layer_major_ = plan->layer_major;
  num_layers_ = plan->num_layers;
  first_layer_ = plan->first_layer;
  end_layer_ = plan->end_layer;
  frame_bytes_ = plan->frame_bytes;
  key_bytes_ = plan->KeyBytes();
  if (req.has_target()) {
    auto target = ResolveRegionTarget(regions, req.target(), ids_.size(), plan->KeyBytes());
    if (!target.ok()) return target.status();
    region_ = std::move(target->region);
    dest_ = std::move(target->dest);
  }
  TakeLease(leases, req, &lease_hold_);
  // Chunks only the shared tier holds are fetched in batches ahead of the stream.
  remote_ahead_ = store_->FetchRemoteAsync(ids_);
  const uint32_t n = static_cast<uint32_t>(ids_.size());
  absl::MutexLock lock(&mu_);
  held_.resize(n);
  absent_.assign(n, false);
  key_crc_.assign(n, 0);
  return absl::OkStatus();
}

void GetReactor::CopyToRegion(uint64_t off, absl::Span<const absl::string_view> pieces) {
  const uint32_t key = items_[item_].key;
  const uint64_t layer_bytes = view_->meta().size / num_layers_;
  char* dst = dest_[key] + (off - uint64_t{first_layer_} * layer_bytes);
  uint32_t& crc = key_crc_[key];
  if (copier_ == nullptr) {
    for (absl::string_view piece : pieces) {
      crc = crc32c::CopyAndExtend(crc, dst, piece.data(), piece.size(), crc32c::CrcOver::kSource);
      dst += piece.size();
    }
    return;
  }
  std::vector<ParallelCopy::Span> spans;
  spans.reserve(pieces.size());
  for (absl::string_view piece : pieces) {
    spans.push_back({dst, piece.data(), piece.size()});
    dst += piece.size();
  }
  crc = copier_->CopyAndExtend(crc, spans, crc32c::CrcOver::kSource);
}

bool GetReactor::FinishRegionItem() {
  const Item& item = items_[item_];
  const bool whole = first_layer_ == 0 && end_layer_ == num_layers_;
  if (whole && LastItemOfKey() && key_crc_[item.key] != view_->meta().crc32c) {
    error_ = store_->DropCorrupt(ids_[item.key], *view_);
    return false;
  }
  v1::GetFrame header;
  header.set_key_index(item.key);
  header.set_found(true);
  if (layer_major_) header.set_layer(item.begin);
  header.set_total_bytes(end_ - begin_);
  header.set_crc32c(view_->meta().crc32c);
  header.set_token_count(view_->meta().token_count);
  header.set_tier(FrameTier(item.key));
  header.set_last(true);
  grpc::Slice slice(header.SerializeAsString());
  frame_ = grpc::ByteBuffer(&slice, 1);
  off_ = end_;
  if (LastItemOfKey()) held_[item.key].reset();
  view_.reset();
  pending_.clear();
  NextItem();
  return true;
}

v1::Tier GetReactor::FrameTier(uint32_t key) const {
  // Fetched ahead from the shared tier into RAM for this Get: it came from there.
  if (view_->tier() == Tier::kRam && key < remote_ahead_.size() && remote_ahead_[key]) {
    return v1::TIER_REMOTE;
  }
  return static_cast<v1::Tier>(static_cast<int>(view_->tier()));
}

void GetReactor::NextItem() {
  ++item_;
  while (item_ < items_.size() && absent_[items_[item_].key]) ++item_;
}

bool GetReactor::LastItemOfKey() const {
  return !layer_major_ || items_[item_].end == end_layer_;
}

void GetReactor::BeginItem(ChunkView view) {
  const Item& item = items_[item_];
  if (layer_major_ && !held_[item.key]) held_[item.key] = view;
  const uint64_t layer_bytes = view.meta().size / num_layers_;
  view_.emplace(std::move(view));
  begin_ = uint64_t{item.begin} * layer_bytes;
  end_ = uint64_t{item.end} * layer_bytes;
  off_ = read_off_ = begin_;
  pending_.clear();
}

void GetReactor::Pump() {
  enum class Action { kNone, kWrite, kFind, kFinish };
  Action action = Action::kNone;
  absl::Status finish_status;
  ChunkId id;
  ChunkMeta meta;
  std::vector<std::pair<uint64_t, uint64_t>> reads;  // (offset, length)
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || writing_ || turn_wait_) return;
    if (cancelled_ && error_.ok()) error_ = absl::CancelledError("get cancelled by the client");
    while (region_ && error_.ok() && item_ < items_.size() && view_ && view_->streamed() &&
           !pending_.empty() && pending_.front().ready) {
      // Region target: copy each read frame into place; send once the item is whole.
      const uint32_t key = items_[item_].key;
      Pending p = std::move(pending_.front());
      pending_.pop_front();
      if (!p.status.ok()) {
        error_ = StreamedReadError(key, p.status, "copied; its bytes in the region are");
        break;
      }
      const absl::string_view piece(p.buf.get(), p.len);
      CopyToRegion(p.off, {&piece, 1});
      if (p.off + p.len == end_) {
        if (FinishRegionItem()) action = Action::kWrite;
        break;
      }
    }
    if (!region_ && error_.ok() && item_ < items_.size() && view_ && view_->streamed() &&
        !pending_.empty() && pending_.front().ready) {
      // The next frame of a streamed chunk has been read.
      const uint32_t key = items_[item_].key;
      Pending p = std::move(pending_.front());
      pending_.pop_front();
      if (!p.status.ok()) {
        error_ = StreamedReadError(key, p.status, "sent; the bytes received for it are");
      } else {
        // Every layer asked for: the key's bytes, over all its items, are the chunk.
        const bool whole = first_layer_ == 0 && end_layer_ == num_layers_;
        uint32_t& crc = key_crc_[key];
        if (whole) crc = crc32c::Extend(crc, p.buf.get(), p.len);
        if (whole && p.off + p.len == end_ && LastItemOfKey() &&
            crc != view_->meta().crc32c) {
          error_ = store_->DropCorrupt(ids_[key], *view_);
        } else {
          const absl::string_view piece(p.buf.get(), p.len);
          BuildFrame(p.len, std::shared_ptr<const void>(p.buf), {&piece, 1});
          action = Action::kWrite;
        }
      }
    }
    if (action == Action::kWrite) {
      // Fall through to top up the read-ahead of the chunk still being streamed.
    } else if (!error_.ok()) {
      finished_ = true;
      finish_status = error_;
      action = Action::kFinish;
    } else if (item_ >= items_.size()) {
      finished_ = true;
      action = Action::kFinish;
    } else if (!view_ && held_[items_[item_].key]) {
      // Layer-major: a later piece of a chunk found at its first.
      BeginItem(*held_[items_[item_].key]);
    } else if (!view_) {
      if (reading_) return;
      if (still_admitted_) error_ = still_admitted_();
      if (!error_.ok()) {
        // Credentials revoked by a tenants file reloaded while the call ran.
        finished_ = true;
        finish_status = error_;
        action = Action::kFinish;
      } else {
        reading_ = true;
        ++store_callbacks_;
        id = ids_[items_[item_].key];
        action = Action::kFind;
      }
    }
    if (action == Action::kNone && region_ && view_ && !view_->streamed()) {
      // Region target, RAM chunk: the whole item in one copy.
      std::vector<absl::string_view> pieces;
      view_->ForEachPiece(off_, end_ - off_,
                          [&](absl::string_view piece) { pieces.push_back(piece); });
      CopyToRegion(off_, pieces);
      if (FinishRegionItem()) {
        action = Action::kWrite;
      } else {
        finished_ = true;
        finish_status = error_;
        action = Action::kFinish;
      }
    } else if (action == Action::kNone && view_ && !view_->streamed()) {
      if (turns_ != nullptr && !turns_->Take(this)) {
        // Every turn is taken: this call is in line, and TurnGranted pumps again.
        turn_wait_ = true;
        ++store_callbacks_;
      } else {
        const uint64_t n = std::min(frame_bytes_, end_ - off_);
        turn_ends_ = turns_ != nullptr && off_ + n == end_;
        std::vector<absl::string_view> pieces;
        view_->ForEachPiece(off_, n, [&](absl::string_view piece) { pieces.push_back(piece); });
        BuildFrame(n, view_->KeepAlive(), pieces);
        action = Action::kWrite;
      }
    }
    if (view_ && view_->streamed() && action != Action::kFinish) {
      id = ids_[items_[item_].key];
      meta = view_->meta();
      while (pending_.size() < kReadahead && read_off_ < end_) {
        Pending p;
        p.off = read_off_;
        p.len = std::min(frame_bytes_, end_ - read_off_);
        read_off_ += p.len;
        reads.emplace_back(p.off, p.len);
        pending_.push_back(std::move(p));
        ++store_callbacks_;
      }
    }
    if (action == Action::kWrite) writing_ = true;
  }
  // mu_ is released: any of these may call back into this reactor on this thread.
  for (const auto& [off, len] : reads) {
    store_->ReadRangeAsync(id, meta, off, len,
                           [this, off = off](absl::StatusOr<TieredStore::RangeBuffer> buf) {
                             OnRange(off, std::move(buf));
                           });
  }
  switch (action) {
    case Action::kWrite:
      stall_.WaitingOnClient(true);
      StartWrite(&frame_);
      break;
    case Action::kFind:
      store_->ReadForStreamAsync(
          id, [this](absl::StatusOr<ChunkView> v) { OnChunk(std::move(v)); }, key_bytes_);
      break;
    case Action::kFinish:
      if (turns_ != nullptr) turns_->Give(this);  // A no-op unless a turn is held.
      place_ = StreamLimiter::Ticket();  // Free before the client sees the status.
      Finish(scope_.Done(ToGrpcStatus(finish_status)));
      break;
    case Action::kNone:
      break;
  }
}

void GetReactor::BuildFrame(uint64_t n, const std::shared_ptr<const void>& keep,
                            absl::Span<const absl::string_view> pieces) {
  const Item& item = items_[item_];
  v1::GetFrame header;
  header.set_key_index(item.key);
  header.set_found(true);
  header.set_offset(off_ - begin_);
  if (layer_major_) header.set_layer(item.begin);
  if (off_ == begin_) {
    header.set_total_bytes(end_ - begin_);
    header.set_crc32c(view_->meta().crc32c);
    header.set_token_count(view_->meta().token_count);
    header.set_tier(FrameTier(item.key));
  }
  const bool last = off_ + n == end_;
  header.set_last(last);
  std::string head = header.SerializeAsString();
  head.push_back(kDataTag);
  AppendVarint(head, n);

  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  for (absl::string_view piece : pieces) {
    // Each slice owns one reference on the bytes; gRPC drops it when they are sent.
    slices.emplace_back(const_cast<char*>(piece.data()), piece.size(), &ReleaseKeepAlive,
                        new std::shared_ptr<const void>(keep));
  }
  frame_ = grpc::ByteBuffer(slices.data(), slices.size());
  off_ += n;
  if (last) {
    if (LastItemOfKey()) held_[item.key].reset();
    view_.reset();
    pending_.clear();
    NextItem();
  }
}

void GetReactor::OnChunk(absl::StatusOr<ChunkView> view) {
  bool write = false;
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (finished_) {
      // Ending anyway; the view goes below.
    } else if (absl::IsNotFound(view.status())) {
      const uint32_t key = items_[item_].key;
      v1::GetFrame header;
      header.set_key_index(key);
      header.set_found(false);
      header.set_last(true);
      if (layer_major_) header.set_layer(items_[item_].begin);
      absent_[key] = true;
      NextItem();
      grpc::Slice slice(header.SerializeAsString());
      frame_ = grpc::ByteBuffer(&slice, 1);
      writing_ = write = true;
    } else if (!view.ok()) {
      error_ = absl::Status(view.status().code(), absl::StrCat("keys[", items_[item_].key,
                                                               "]: ", view.status().message()));
    } else {
      key_crc_[items_[item_].key] = 0;
      BeginItem(*std::move(view));
    }
  }
  view = absl::CancelledError();  // Drop any bytes we did not keep before going on.
  if (write) {
    stall_.WaitingOnClient(true);
    StartWrite(&frame_);
  } else {
    Pump();
  }
  StoreCallbackDone();
}

void GetReactor::OnRange(uint64_t off, absl::StatusOr<TieredStore::RangeBuffer> buf) {
  {
    absl::MutexLock lock(&mu_);
    for (Pending& p : pending_) {
      if (finished_ || p.off != off || p.ready) continue;
      p.ready = true;
      if (buf.ok()) {
        p.buf = *std::move(buf);
      } else {
        p.status = buf.status();
      }
      break;
    }
  }
  buf = absl::CancelledError();  // Unused bytes go back to the store's budget now.
  Pump();
  StoreCallbackDone();
}

void GetReactor::StoreCallbackDone() {
  bool last;
  {
    absl::MutexLock lock(&mu_);
    last = --store_callbacks_ == 0 && done_;
  }
  // Last use of `this`: OnDone has run, so no reaction and no store callback remains.
  if (last) delete this;
}

void GetReactor::OnWriteDone(bool ok) {
  // The sent frame's slices hold references on its bytes; drop ours now, so a streamed
  // frame's buffer goes back to the store's budget (or a chunk's pool slots become
  // evictable) before this call waits for anything else.
  frame_.Clear();
  stall_.WaitingOnClient(false);
  bool item_sent;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    item_sent = std::exchange(turn_ends_, false);
    if (!ok) {
      if (error_.ok()) error_ = absl::CancelledError("client went away");
    } else if (ctx_->IsCancelled() && error_.ok()) {
      error_ = absl::CancelledError("get cancelled by the client");
    }
  }
  if (turns_ != nullptr) {
    // A RAM item's last frame is out: the turn goes to the line (this call takes one
    // again for its next item, behind whoever waits).
    if (item_sent) {
      turns_->Give(this);
    } else {
      turns_->WriteDone(this);
    }
  }
  Pump();
}

void GetReactor::TurnGranted() {
  bool give_back;
  {
    absl::MutexLock lock(&mu_);
    turn_wait_ = false;
    give_back = finished_ || done_;
  }
  if (give_back) {
    turns_->Give(this);
  } else {
    Pump();
  }
  StoreCallbackDone();
}

void GetReactor::OnCancel() {
  bool left = false;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;  // Whatever this call does next, it ends instead.
    // Waiting for a turn, the call has no write to fail: it ends here.
    if (turn_wait_ && turns_->Leave(this)) {
      turn_wait_ = false;
      --store_callbacks_;
      left = true;
    }
  }
  if (left) Pump();
}

void GetReactor::OnDone() {
  stall_.Reset();  // Before the context goes; store callbacks may still be running.
  // Turns are given back as the call finishes; this one only in case. Here, before
  // done_, so that no other thread can have deleted the reactor meanwhile.
  if (turns_ != nullptr) turns_->Give(this);
  bool last;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    if (turn_wait_ && turns_->Leave(this)) {
      turn_wait_ = false;
      --store_callbacks_;
    }
    view_.reset();
    held_.clear();
    pending_.clear();
    last = store_callbacks_ == 0;
  }
  if (last) delete this;
}

}  // namespace kvtier
