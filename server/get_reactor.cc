#include "server/get_reactor.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/status_util.h"

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

}  // namespace

GetReactor::GetReactor(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                       TieredStore* store, RpcMetrics* metrics, uint64_t max_frame_bytes,
                       uint32_t max_keys)
    : ctx_(ctx), store_(store), scope_(metrics, RpcMethod::kGet) {
  if (absl::Status s = Start(request, max_frame_bytes, max_keys); !s.ok()) {
    End(s);
    return;
  }
  Next();
}

absl::Status GetReactor::Start(const grpc::ByteBuffer* request, uint64_t max_frame_bytes,
                               uint32_t max_keys) {
  if (store_ == nullptr) {
    return absl::UnavailableError(
        "kvtierd is starting up (recovering the SSD tier's index); retry shortly");
  }
  grpc::Slice flat;
  v1::GetRequest req;
  if (!request->DumpToSingleSlice(&flat).ok() ||
      !req.ParseFromArray(flat.begin(), static_cast<int>(flat.size()))) {
    return absl::InvalidArgumentError("request: not a GetRequest");
  }
  auto layout = store_->FindLayout(req.namespace_id());
  if (!layout.ok()) return layout.status();
  if (req.keys_size() > static_cast<int>(max_keys)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: ", req.keys_size(), " keys in one request, more than max_keys_per_request (",
        max_keys, "); split the request"));
  }
  for (int i = 0; i < req.keys_size(); ++i) {
    auto key = ChunkKey::FromBytes(req.keys(i));
    if (!key.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("keys[", i, "]: ", key.status().message()));
    }
    ids_.push_back(ChunkId{req.namespace_id(), *key});
  }
  num_layers_ = layout->num_layers;
  first_layer_ = 0;
  end_layer_ = num_layers_;
  if (req.has_layer_range()) {
    first_layer_ = req.layer_range().begin();
    end_layer_ = req.layer_range().end();
    if (first_layer_ >= end_layer_ || end_layer_ > num_layers_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer_range: [", first_layer_, ", ", end_layer_,
          ") is not a non-empty range within [0, ", num_layers_, ")"));
    }
  }
  frame_bytes_ = max_frame_bytes;
  if (req.max_frame_bytes() > 0) {
    frame_bytes_ = std::min<uint64_t>(frame_bytes_, req.max_frame_bytes());
  }
  return absl::OkStatus();
}

void GetReactor::Next() {
  if (key_ >= ids_.size()) {
    End(absl::OkStatus());
    return;
  }
  if (view_) {
    WriteFrame();
    return;
  }
  // A RAM hit answers inline; an SSD read runs on the store's read threads and comes
  // back here from one of them (reactions may start writes from any thread).
  store_->ReadAsync(ids_[key_],
                    [this](absl::StatusOr<ChunkView> view) { OnRead(std::move(view)); });
}

void GetReactor::OnRead(absl::StatusOr<ChunkView> view) {
  if (absl::IsNotFound(view.status())) {
    v1::GetFrame header;
    header.set_key_index(static_cast<uint32_t>(key_));
    header.set_found(false);
    header.set_last(true);
    ++key_;
    grpc::Slice slice(header.SerializeAsString());
    frame_ = grpc::ByteBuffer(&slice, 1);
    StartWrite(&frame_);
    return;
  }
  if (!view.ok()) {
    End(absl::Status(view.status().code(),
                     absl::StrCat("keys[", key_, "]: ", view.status().message())));
    return;
  }
  view_.emplace(*std::move(view));
  const uint64_t layer_bytes = view_->meta().size / num_layers_;
  begin_ = uint64_t{first_layer_} * layer_bytes;
  end_ = uint64_t{end_layer_} * layer_bytes;
  off_ = begin_;
  WriteFrame();
}

void GetReactor::WriteFrame() {
  v1::GetFrame header;
  const uint64_t n = std::min(frame_bytes_, end_ - off_);
  header.set_key_index(static_cast<uint32_t>(key_));
  header.set_found(true);
  header.set_offset(off_ - begin_);
  if (off_ == begin_) {
    header.set_total_bytes(end_ - begin_);
    header.set_crc32c(view_->meta().crc32c);
    header.set_token_count(view_->meta().token_count);
    header.set_tier(static_cast<v1::Tier>(static_cast<int>(view_->tier())));
  }
  const bool last = off_ + n == end_;
  header.set_last(last);
  std::string head = header.SerializeAsString();
  head.push_back(kDataTag);
  AppendVarint(head, n);

  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  const std::shared_ptr<const void> keep = view_->KeepAlive();
  view_->ForEachPiece(off_, n, [&](absl::string_view piece) {
    // Each slice owns one reference on the chunk; gRPC drops it when the bytes are sent.
    slices.emplace_back(const_cast<char*>(piece.data()), piece.size(), &ReleaseKeepAlive,
                        new std::shared_ptr<const void>(keep));
  });
  frame_ = grpc::ByteBuffer(slices.data(), slices.size());
  off_ += n;
  if (last) {
    view_.reset();
    ++key_;
  }
  StartWrite(&frame_);
}

void GetReactor::OnWriteDone(bool ok) {
  // The sent frame's slices hold references on its chunk; drop them before possibly
  // waiting for the next chunk, or a held SSD buffer would keep its slot in the
  // buffered-reads gate while we wait on that very gate.
  frame_.Clear();
  if (!ok) {
    End(absl::CancelledError("client went away"));
    return;
  }
  if (ctx_->IsCancelled()) {
    End(absl::CancelledError("get cancelled by the client"));
    return;
  }
  Next();
}

void GetReactor::End(const absl::Status& status) {
  view_.reset();
  Finish(scope_.Done(ToGrpcStatus(status)));
}

}  // namespace kvtier
