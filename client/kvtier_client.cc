#include "client/kvtier_client.h"

#include <algorithm>
#include <utility>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/get_frame_parser.h"
#include "client/layout_convert.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

// Room left in a message for a PutFrame's fields other than `data` (namespace id, key,
// offset, crc32c, token_count and the tags/lengths: under 64 bytes); generous so that a
// future field never pushes a full frame over the limit.
constexpr int kFrameOverheadBytes = 4096;

// Full name of the Get method, as gRPC puts it on the wire.
constexpr char kGetMethod[] = "/kvtier.v1.KvCache/Get";
constexpr char kPutMethod[] = "/kvtier.v1.KvCache/Put";
// PutFrame.data is field 4, wire type 2 (length-delimited).
constexpr char kPutDataTag = (4 << 3) | 2;

void AppendVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void AddKeys(absl::Span<const ChunkKey> keys,
             google::protobuf::RepeatedPtrField<std::string>* out) {
  out->Reserve(static_cast<int>(keys.size()));
  for (const ChunkKey& k : keys) out->Add(k.ToByteString());
}

// One unary RPC with the client's deadline.
template <typename Req, typename Resp>
absl::StatusOr<Resp> CallUnary(
    const KvTierClient& client,
    grpc::Status (v1::KvCache::Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
    const Req& request) {
  grpc::ClientContext ctx;
  client.PrepareContext(&ctx);
  Resp response;
  grpc::Status status = (client.stub()->*method)(&ctx, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// Checks a Get stream against the protocol as frames arrive: keys answered once each,
// in request order; each found key's frames contiguous from offset 0 up to total_bytes,
// the last one flagged; and, for whole-chunk reads, the CRC32C of the bytes received.
// Not thread-safe; one per stream.
class GetFrameChecker {
 public:
  GetFrameChecker(absl::Span<const ChunkKey> keys, bool whole_chunks)
      : keys_(keys), whole_chunks_(whole_chunks) {}

  // `frame` is the header (its data() is ignored), `data` the payload's pieces, `n`
  // their total size.
  // Returns: Ok, Internal (protocol violation), DataLoss (CRC mismatch on the last frame
  // of a key).
  absl::Status Check(const v1::GetFrame& frame, absl::Span<const absl::string_view> data,
                     uint64_t n) {
    const uint32_t index = frame.key_index();
    if (!in_key_) {
      if (next_ >= keys_.size()) {
        return Violation(absl::StrCat("a frame for key_index ", index, " after all ",
                                      keys_.size(), " keys were answered"));
      }
      if (index != next_) {
        return Violation(
            absl::StrCat("a frame for key_index ", index, " when ", next_, " was due"));
      }
      if (!frame.found()) {
        if (n != 0) {
          return Violation(absl::StrCat("data with found = false for key_index ", index));
        }
        ++next_;
        return absl::OkStatus();
      }
      in_key_ = true;
      total_ = frame.total_bytes();
      expected_crc_ = frame.crc32c();
      received_ = 0;
      crc_ = 0;
    } else if (index != next_) {
      return Violation(absl::StrCat("a frame for key_index ", index, " while key_index ",
                                    next_, " had ", received_, " of ", total_, " bytes"));
    }
    if (frame.offset() != received_) {
      return Violation(absl::StrCat("offset ", frame.offset(), " for key_index ", index,
                                    ", expected ", received_));
    }
    if (n > total_ - received_) {
      return Violation(absl::StrCat("more than total_bytes (", total_,
                                    ") for key_index ", index));
    }
    received_ += n;
    if (whole_chunks_) {
      for (absl::string_view piece : data) {
        crc_ = crc32c::Extend(crc_, piece.data(), piece.size());
      }
    }
    if (frame.last()) {
      if (received_ != total_) {
        return Violation(absl::StrCat("last frame for key_index ", index, " after ",
                                      received_, " of ", total_, " bytes"));
      }
      if (whole_chunks_ && crc_ != expected_crc_) {
        return absl::DataLossError(absl::StrFormat(
            "Get: chunk %s (key_index %u) failed its CRC32C: server says %08x, the %u "
            "bytes received give %08x",
            keys_[index].ToHex(), index, expected_crc_, received_, crc_));
      }
      in_key_ = false;
      ++next_;
    }
    return absl::OkStatus();
  }

  // Call once the server ended the stream with Ok. Returns: Ok, Internal (keys left
  // unanswered).
  absl::Status Finish() const {
    if (in_key_ || next_ != keys_.size()) {
      return Violation(absl::StrCat("end of stream after ", next_, " of ", keys_.size(),
                                    " keys", in_key_ ? " (one cut short)" : ""));
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Violation(absl::string_view what) {
    return absl::InternalError(absl::StrCat("Get: server protocol violation: ", what));
  }

  const absl::Span<const ChunkKey> keys_;
  const bool whole_chunks_;
  uint32_t next_ = 0;       // Index of the key being (or next to be) answered.
  bool in_key_ = false;     // Key next_ is found and some of its frames arrived.
  uint64_t total_ = 0;      // total_bytes of key next_.
  uint64_t received_ = 0;   // Bytes of key next_ so far.
  uint32_t expected_crc_ = 0;
  uint32_t crc_ = 0;        // CRC32C of those bytes (whole-chunk reads only).
};

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share the canonical code numbers.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

std::string TierLabel(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_UNSPECIFIED:
      return "absent";
    case v1::TIER_GPU:
      return "gpu";
    case v1::TIER_RAM:
      return "ram";
    case v1::TIER_SSD:
      return "ssd";
    default:
      break;
  }
  return absl::StrCat("tier(", static_cast<int>(tier), ")");
}

absl::Status ClientOptions::Validate() const {
  if (max_message_bytes <= kFrameOverheadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes must be greater than ", kFrameOverheadBytes));
  }
  if (max_frame_bytes == 0) {
    return absl::InvalidArgumentError("max_frame_bytes must be >= 1");
  }
  if (uint64_t{max_frame_bytes} + kFrameOverheadBytes > uint64_t(max_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_frame_bytes (", max_frame_bytes, ") must leave ", kFrameOverheadBytes,
        " bytes of room within max_message_bytes (", max_message_bytes, ")"));
  }
  if (rpc_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_deadline must be positive");
  }
  if (connect_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("connect_timeout must not be negative");
  }
  if (receive_window_bytes != 0 &&
      (receive_window_bytes < (64 << 10) || receive_window_bytes >= (1 << 30))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "receive_window_bytes must be 0 or in [65536, 1073741824), got ",
        receive_window_bytes));
  }
  return absl::OkStatus();
}

KvTierClient::KvTierClient(std::string target, ClientOptions options,
                           std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::KvCache::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<KvTierClient>> KvTierClient::Connect(
    const std::string& target, ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty");
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(options.max_message_bytes);
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  if (options.receive_window_bytes > 0) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.receive_window_bytes);
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to ", target));
  }
  if (options.connect_timeout > absl::ZeroDuration() &&
      !channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("kvtierd at ", target, " not reachable within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  return std::unique_ptr<KvTierClient>(
      new KvTierClient(target, std::move(options), std::move(channel)));
}

void KvTierClient::PrepareContext(grpc::ClientContext* ctx) const {
  // absl::ToChronoTime maps InfiniteFuture to time_point::max(), which gRPC reads as
  // "no deadline".
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_deadline));
}

absl::StatusOr<RegisterResult> KvTierClient::RegisterLayout(const LayoutSpec& layout) {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  v1::RegisterLayoutRequest request;
  *request.mutable_layout() = LayoutToProto(layout);
  absl::StatusOr<v1::RegisterLayoutResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::RegisterLayout, request);
  if (!response.ok()) return response.status();
  // Keys are computed client-side from the namespace id, so a disagreement here would
  // silently make every lookup miss: refuse it loudly.
  if (response->namespace_id() != layout.NamespaceId() ||
      response->chunk_bytes() != layout.ChunkBytes()) {
    return absl::InternalError(absl::StrFormat(
        "RegisterLayout: server says namespace %016x with %u-byte chunks, the client "
        "computes %016x with %u-byte chunks",
        response->namespace_id(), response->chunk_bytes(), layout.NamespaceId(),
        layout.ChunkBytes()));
  }
  {
    absl::MutexLock lock(&mu_);
    chunk_bytes_[response->namespace_id()] = response->chunk_bytes();
  }
  return RegisterResult{response->namespace_id(), response->chunk_bytes(),
                        response->already_registered()};
}

absl::StatusOr<LookupResult> KvTierClient::Lookup(uint64_t namespace_id,
                                                  absl::Span<const ChunkKey> keys) {
  v1::LookupRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  absl::StatusOr<v1::LookupResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::Lookup, request);
  if (!response.ok()) return response.status();
  if (static_cast<size_t>(response->tiers_size()) != keys.size()) {
    return absl::InternalError(absl::StrCat("Lookup: server returned ",
                                            response->tiers_size(), " tiers for ",
                                            keys.size(), " keys"));
  }
  LookupResult result;
  result.tiers.reserve(keys.size());
  for (int t : response->tiers()) result.tiers.push_back(static_cast<v1::Tier>(t));
  result.prefix_hits = response->prefix_hits();
  return result;
}

absl::StatusOr<PutResult> KvTierClient::Put(uint64_t namespace_id,
                                            absl::Span<const ChunkToPut> chunks,
                                            const ProgressCallback& progress) {
  std::optional<uint64_t> chunk_bytes;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = chunk_bytes_.find(namespace_id); it != chunk_bytes_.end()) {
      chunk_bytes = it->second;
    }
  }
  uint64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const uint64_t size = chunks[i].data.size();
    if (size == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Put: chunk ", i, " (", chunks[i].key.ToHex(), ") is empty"));
    }
    if (chunk_bytes.has_value() && size != *chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Put: chunk ", i, " (", chunks[i].key.ToHex(), ") has ", size,
          " bytes; the payload size of namespace ",
          absl::Hex(namespace_id, absl::kZeroPad16), " is ", *chunk_bytes));
    }
    total += size;
  }
  if (chunks.empty()) return PutResult{};

  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  // What the generated stub_->Put does, except that each frame is sent as a ByteBuffer
  // of its serialized header fields, then data's tag and length, then a slice that
  // points into the caller's chunk: the payload is not copied into a PutFrame and then
  // again into gRPC's buffer (protobuf accepts fields in any order, so the daemon parses
  // an ordinary PutFrame). The caller's bytes outlive the slices: this call returns only
  // after Finish, when gRPC holds none of them. See GetStreamRaw on the factory.
  const grpc::internal::RpcMethod method(kPutMethod,
                                         grpc::internal::RpcMethod::CLIENT_STREAMING);
  grpc::ByteBuffer response_bytes;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel_.get(), method,
                                                                    &ctx, &response_bytes));

  v1::PutFrame frame;  // Every field but data.
  frame.set_namespace_id(namespace_id);
  std::string head;
  const uint64_t max_frame = options_.max_frame_bytes;
  uint64_t sent = 0;
  bool broken = false;  // Write failed: the server ended the stream; Finish says why.
  for (const ChunkToPut& chunk : chunks) {
    frame.set_key(chunk.key.ToByteString());
    frame.set_token_count(chunk.token_count);
    const uint64_t size = chunk.data.size();
    uint32_t crc = 0;
    for (uint64_t offset = 0; offset < size;) {
      const uint64_t n = std::min(max_frame, size - offset);
      const char* p = chunk.data.data() + offset;
      frame.set_offset(offset);
      crc = crc32c::Extend(crc, p, n);
      offset += n;
      if (offset == size) {
        frame.set_crc32c(crc);
      } else {
        frame.clear_crc32c();
      }
      head.clear();
      frame.AppendToString(&head);
      head.push_back(kPutDataTag);
      AppendVarint(head, n);
      grpc::Slice slices[2] = {grpc::Slice(head),
                               grpc::Slice(p, n, grpc::Slice::STATIC_SLICE)};
      grpc::ByteBuffer message(slices, 2);
      if (!writer->Write(message)) {
        broken = true;
        break;
      }
      sent += n;
      if (progress) progress(sent, total);
    }
    if (broken) break;
  }
  // A failed WritesDone means the stream is already broken; Finish reports the cause.
  if (!broken) broken = !writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (broken) {
    return absl::InternalError(absl::StrCat("Put: the server closed the stream after ", sent,
                                            " of ", total, " bytes without an error"));
  }
  v1::PutResponse response;
  grpc::Slice flat;
  if (!response_bytes.DumpToSingleSlice(&flat).ok() ||
      !response.ParseFromArray(flat.begin(), static_cast<int>(flat.size()))) {
    return absl::InternalError("Put: the daemon's response is not a PutResponse");
  }
  return PutResult{response.chunks_stored(), response.chunks_already_present(),
                   response.bytes_received()};
}

absl::StatusOr<std::vector<GotChunk>> KvTierClient::Get(uint64_t namespace_id,
                                                        absl::Span<const ChunkKey> keys,
                                                        std::optional<LayerRange> layers,
                                                        const ProgressCallback& progress) {
  std::vector<GotChunk> out(keys.size());
  // Progress bookkeeping: the total is the sizes of keys already started plus, for the
  // keys not yet answered, the size of the first chunk received (all chunks of a
  // namespace, or of one layer range, have the same size).
  int64_t current = -1;         // key_index of the previous frame.
  uint64_t started = 0;         // Keys answered or being answered.
  uint64_t known_total = 0;     // Bytes of the found keys among them.
  uint64_t per_chunk = 0;       // total_bytes of the first found key.
  uint64_t done = 0;
  absl::Status status = GetStreamRaw(
      namespace_id, keys, layers,
      [&](uint32_t index, const GetFrameHeader& frame,
          absl::Span<const absl::string_view> data) -> absl::Status {
        GotChunk& got = out[index];
        if (index != current) {  // The checker guarantees indices only grow.
          current = index;
          ++started;
          got.found = frame.found();
          if (got.found) {
            got.crc32c = frame.crc32c();
            got.token_count = frame.token_count();
            got.tier = frame.tier();
            known_total += frame.total_bytes();
            if (per_chunk == 0) per_chunk = frame.total_bytes();
            // The checker has bounded this frame's data by total_bytes, not yet the
            // whole key's; a lying server costs at most this one reservation.
            got.data.reserve(frame.total_bytes());
          }
        }
        // A missing key shrinks the estimated total, so report it too: the last call
        // then always has done == total.
        if (!got.found) {
          if (progress) progress(done, known_total + (keys.size() - started) * per_chunk);
          return absl::OkStatus();
        }
        // The one copy of the payload after the kernel's: gRPC's slices into the result.
        for (absl::string_view piece : data) {
          got.data.append(piece.data(), piece.size());
          done += piece.size();
        }
        if (frame.last()) got.crc_verified = !layers.has_value();
        if (progress) progress(done, known_total + (keys.size() - started) * per_chunk);
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return out;
}

absl::Status KvTierClient::GetStream(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                                     std::optional<LayerRange> layers,
                                     const GetFrameCallback& on_frame) {
  if (!on_frame) return absl::InvalidArgumentError("GetStream: on_frame is empty");
  v1::GetFrame frame;  // Reused: data keeps its capacity from frame to frame.
  return GetStreamRaw(namespace_id, keys, layers,
                      [&](uint32_t index, const GetFrameHeader& header,
                          absl::Span<const absl::string_view> data) {
                        frame = header;  // header.data() is empty: clears data.
                        std::string* bytes = frame.mutable_data();
                        size_t n = 0;
                        for (absl::string_view piece : data) n += piece.size();
                        bytes->reserve(n);
                        for (absl::string_view piece : data) {
                          bytes->append(piece.data(), piece.size());
                        }
                        return on_frame(index, frame);
                      });
}

absl::Status KvTierClient::GetStreamRaw(uint64_t namespace_id,
                                        absl::Span<const ChunkKey> keys,
                                        std::optional<LayerRange> layers,
                                        const GetFrameRawCallback& on_frame) {
  if (!on_frame) return absl::InvalidArgumentError("GetStreamRaw: on_frame is empty");
  if (layers.has_value() && layers->end <= layers->begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Get: layer_range [", layers->begin, ", ", layers->end, ") is empty"));
  }
  if (keys.empty()) return absl::OkStatus();
  v1::GetRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  if (layers.has_value()) {
    request.mutable_layer_range()->set_begin(layers->begin);
    request.mutable_layer_range()->set_end(layers->end);
  }
  request.set_max_frame_bytes(options_.max_frame_bytes);

  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  // What the generated stub_->Get does, except that each response stays the ByteBuffer
  // gRPC received (SerializationTraits<ByteBuffer> hands it over without a copy) instead
  // of being parsed into a GetFrame, which would copy `data` out of gRPC's slices. The
  // ClientReaderFactory is the generated code's own entry point (gRPC's `internal`
  // namespace, but a generated stub, which this binary also links, needs it exactly as
  // used here). The method is not pre-registered on the channel: gRPC then passes its
  // name with each call, which costs nothing next to a multi-megabyte stream.
  const grpc::internal::RpcMethod method(kGetMethod,
                                         grpc::internal::RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), method,
                                                                    &ctx, request));
  GetFrameChecker checker(keys, /*whole_chunks=*/!layers.has_value());
  GetFrameParser parser;
  grpc::ByteBuffer message;
  absl::Status client_error;
  while (reader->Read(&message)) {
    client_error = parser.Parse(message);
    if (client_error.ok()) {
      client_error = checker.Check(parser.header(), parser.pieces(), parser.data_size());
    }
    if (client_error.ok()) {
      client_error = on_frame(parser.header().key_index(), parser.header(), parser.pieces());
    }
    if (!client_error.ok()) break;
  }
  if (!client_error.ok()) {
    ctx.TryCancel();
    while (reader->Read(&message)) {
    }
    // Ends CANCELLED (or with a server error racing the cancel); client_error is the
    // cause the caller needs.
    FromGrpcStatus(reader->Finish()).IgnoreError();
    return client_error;
  }
  if (grpc::Status status = reader->Finish(); !status.ok()) return FromGrpcStatus(status);
  return checker.Finish();
}

absl::StatusOr<PinResult> KvTierClient::Pin(uint64_t namespace_id,
                                            absl::Span<const ChunkKey> keys,
                                            uint32_t ttl_seconds) {
  v1::PinRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  request.set_ttl_seconds(ttl_seconds);
  absl::StatusOr<v1::PinResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::Pin, request);
  if (!response.ok()) return response.status();
  return PinResult{response->pinned(), response->not_found()};
}

absl::StatusOr<uint32_t> KvTierClient::Unpin(uint64_t namespace_id,
                                             absl::Span<const ChunkKey> keys) {
  v1::UnpinRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  absl::StatusOr<v1::UnpinResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::Unpin, request);
  if (!response.ok()) return response.status();
  return response->unpinned();
}

absl::StatusOr<uint32_t> KvTierClient::Delete(uint64_t namespace_id,
                                              absl::Span<const ChunkKey> keys) {
  v1::DeleteRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  absl::StatusOr<v1::DeleteResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::Delete, request);
  if (!response.ok()) return response.status();
  return response->deleted();
}

absl::StatusOr<uint64_t> KvTierClient::Clear(uint64_t namespace_id) {
  v1::ClearRequest request;
  request.set_namespace_id(namespace_id);
  absl::StatusOr<v1::ClearResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::Clear, request);
  if (!response.ok()) return response.status();
  return response->chunks_removed();
}

absl::StatusOr<v1::StatsResponse> KvTierClient::Stats() {
  return CallUnary(*this, &v1::KvCache::Stub::Stats, v1::StatsRequest());
}

}  // namespace kvtier
