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
#include "client/get_frame_checker.h"
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
                                                  absl::Span<const ChunkKey> keys,
                                                  uint32_t lease_seconds) {
  v1::LookupRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  request.set_lease_seconds(lease_seconds);
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
  result.lease_id = response->lease_id();
  return result;
}

absl::StatusOr<bool> KvTierClient::ReleaseLease(uint64_t namespace_id, uint64_t lease_id) {
  v1::ReleaseLeaseRequest request;
  request.set_namespace_id(namespace_id);
  request.set_lease_id(lease_id);
  absl::StatusOr<v1::ReleaseLeaseResponse> response =
      CallUnary(*this, &v1::KvCache::Stub::ReleaseLease, request);
  if (!response.ok()) return response.status();
  return response->released();
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
                                                        const ProgressCallback& progress,
                                                        v1::GetOrder order, uint64_t lease_id) {
  const bool layer_major = order == v1::GET_ORDER_LAYER_MAJOR;
  std::vector<GotChunk> out(keys.size());
  std::vector<uint8_t> seen(keys.size(), 0);
  // Layers per chunk, where known before the stream ends (layer-major sizing).
  uint64_t passes = 0;
  if (layers.has_value()) {
    passes = layers->end - layers->begin;
  } else if (layer_major) {
    absl::MutexLock lock(&mu_);
    if (auto it = chunk_bytes_.find(namespace_id); it != chunk_bytes_.end()) {
      passes = it->second;  // Divided by the piece size at the first piece.
    }
  }
  // Progress bookkeeping: the total is the sizes of keys already started plus, for the
  // keys not yet answered, the size of the first chunk received (all chunks of a
  // namespace, or of one layer range, have the same size). Layer-major, a chunk's size
  // is its piece size times the layers, or times the passes seen so far when the
  // number of layers is not known: an estimate that only grows, never below `done`.
  uint64_t started = 0;         // Keys answered or being answered.
  uint64_t found = 0;           // Found keys among them.
  uint64_t per_chunk = 0;       // total_bytes of the first found key (or piece).
  uint64_t passes_seen = 0;
  std::optional<uint32_t> pass_layer;
  uint64_t done = 0;
  auto report = [&] {
    if (!progress) return;
    const uint64_t chunk = layer_major ? per_chunk * std::max(passes, passes_seen) : per_chunk;
    progress(done, (found + keys.size() - started) * chunk);
  };
  absl::Status status = GetStreamRaw(
      namespace_id, keys, layers,
      [&](uint32_t index, const GetFrameHeader& frame,
          absl::Span<const absl::string_view> data) -> absl::Status {
        GotChunk& got = out[index];
        if (layer_major && pass_layer != frame.layer()) {
          pass_layer = frame.layer();
          ++passes_seen;
        }
        if (!seen[index]) {  // The key's first frame.
          seen[index] = 1;
          ++started;
          got.found = frame.found();
          if (got.found) {
            ++found;
            got.crc32c = frame.crc32c();
            got.token_count = frame.token_count();
            got.tier = frame.tier();
            if (per_chunk == 0) {
              per_chunk = frame.total_bytes();
              if (layer_major && !layers.has_value() && passes != 0) {
                passes = per_chunk == 0 ? 0 : passes / per_chunk;
              }
            }
            // The checker has bounded this frame's data by total_bytes, not yet the
            // whole key's; a lying server costs at most this one reservation.
            got.data.reserve(frame.total_bytes() * (layer_major ? std::max<uint64_t>(passes, 1) : 1));
          }
        }
        // A missing key shrinks the estimated total, so report it too: the last call
        // then always has done == total.
        if (!got.found) {
          report();
          return absl::OkStatus();
        }
        // The one copy of the payload after the kernel's: gRPC's slices into the result
        // (layer-major: the pieces of a key arrive in layer order, so appending them
        // rebuilds the chunk).
        for (absl::string_view piece : data) {
          got.data.append(piece.data(), piece.size());
          done += piece.size();
        }
        if (!layer_major && frame.last()) got.crc_verified = !layers.has_value();
        report();
        return absl::OkStatus();
      },
      order, lease_id);
  if (!status.ok()) return status;
  if (layer_major && !layers.has_value()) {
    for (GotChunk& got : out) got.crc_verified = got.found;  // Checked at the stream's end.
  }
  return out;
}

absl::Status KvTierClient::GetStream(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                                     std::optional<LayerRange> layers,
                                     const GetFrameCallback& on_frame,
                                     v1::GetOrder order, uint64_t lease_id) {
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
                      },
                      order, lease_id);
}

absl::Status KvTierClient::GetStreamRaw(uint64_t namespace_id,
                                        absl::Span<const ChunkKey> keys,
                                        std::optional<LayerRange> layers,
                                        const GetFrameRawCallback& on_frame,
                                        v1::GetOrder order, uint64_t lease_id) {
  if (!on_frame) return absl::InvalidArgumentError("GetStreamRaw: on_frame is empty");
  if (layers.has_value() && layers->end <= layers->begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Get: layer_range [", layers->begin, ", ", layers->end, ") is empty"));
  }
  if (order != v1::GET_ORDER_CHUNK_MAJOR && order != v1::GET_ORDER_LAYER_MAJOR &&
      order != v1::GET_ORDER_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("Get: order ", static_cast<int>(order), " is not a GetOrder"));
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
  const bool layer_major = order == v1::GET_ORDER_LAYER_MAJOR;
  if (layer_major) request.set_order(order);
  request.set_lease_id(lease_id);

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
  GetFrameChecker checker(
      keys, layer_major,
      layers.has_value() ? std::optional<uint32_t>(layers->begin) : std::nullopt,
      layers.has_value() ? std::optional<uint32_t>(layers->end) : std::nullopt);
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
