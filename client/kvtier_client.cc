#include "client/kvtier_client.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/allocator_tuning.h"
#include "client/call_cancellation.h"
#include "client/get_frame_checker.h"
#include "client/frame_parser.h"
#include "client/layout_convert.h"
#include "client/shared_memory_plane.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

// The most of a chunk's bytes a Get reserves before they arrive. Without the layout
// (DataPlane unanswered) total_bytes is the server's word alone, up to
// kMaxAcceptedChunkBytes, more than a host may grant: past this much the buffer grows
// with the bytes that do arrive. 1 GiB is twice the daemon's default max_chunk_size, so
// chunks of a default layout are reserved whole.
constexpr uint64_t kMaxUpFrontReserveBytes = uint64_t{1} << 30;

// gRPC fails every call of a channel whose client key is encrypted or belongs to another
// certificate with "empty address list", naming neither file: say which, and why.
absl::Status CheckKeyMatches(const std::string& key_path, const std::string& key_pem,
                             const std::string& cert_pem) {
  auto pem_bio = [](const std::string& pem) {
    return std::unique_ptr<BIO, decltype(&BIO_free)>(
        BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  };
  auto cert_bio = pem_bio(cert_pem);
  auto key_bio = pem_bio(key_pem);
  if (cert_bio == nullptr || key_bio == nullptr) return absl::ResourceExhaustedError("tls: out of memory");
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr), &X509_free);
  // No passphrase prompt: an encrypted key is refused, not asked for on a terminal.
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return 0; };
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_passphrase, nullptr), &EVP_PKEY_free);
  const bool matches =
      cert != nullptr && key != nullptr && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();
  if (cert == nullptr) return absl::InvalidArgumentError("tls_cert_file: not a PEM certificate");
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_key_file: ", key_path, " holds no unencrypted PEM private key"));
  }
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_key_file: ", key_path, " does not match the certificate in tls_cert_file"));
  }
  return absl::OkStatus();
}

// Room left in a message for a PutFrame's fields other than `data` (namespace id, key,
// offset, crc32c, token_count and the tags/lengths: under 64 bytes); generous so that a
// future field never pushes a full frame over the limit.
constexpr int kFrameOverheadBytes = 4096;

// Full name of the Get method, as gRPC puts it on the wire.
constexpr char kGetMethod[] = "/kvtier.v1.KvCache/Get";
constexpr char kPutMethod[] = "/kvtier.v1.KvCache/Put";
// PutFrame.data is field 4, wire type 2 (length-delimited).
constexpr char kPutDataTag = (4 << 3) | 2;
// A chunk in shared memory larger than this is put as several frames naming pieces of
// it, so that the daemon copies piece k while this client checksums piece k + 1.
constexpr uint64_t kRegionPieceBytes = 8 << 20;

// The deadline the RPCs of one public call share (Put, Get, GetInto...), set for the
// call's thread: the call is bounded by one rpc_deadline however many RPCs it makes
// (the data-plane probe on first use, a retried Put). Unset: each RPC gets its own. It
// is the calling client's only: a callback of the call that uses another client (or
// this one) from the same thread does not inherit it unless it is the same client.
struct ThreadCallDeadline {
  const void* client = nullptr;
  absl::Time deadline;
};
thread_local std::optional<ThreadCallDeadline> call_deadline;

// The current call's deadline for `client`, if one is set on this thread.
std::optional<absl::Time> CallDeadlineFor(const void* client) {
  if (call_deadline.has_value() && call_deadline->client == client) return call_deadline->deadline;
  return std::nullopt;
}

// Sets call_deadline for a public call of `client`, unless an enclosing call of the same
// client set it already.
class CallDeadline {
 public:
  CallDeadline(const void* client, absl::Duration rpc_deadline) : outer_(call_deadline) {
    if (!CallDeadlineFor(client).has_value()) {
      call_deadline = ThreadCallDeadline{client, absl::Now() + rpc_deadline};
    }
  }
  ~CallDeadline() { call_deadline = outer_; }
  CallDeadline(const CallDeadline&) = delete;
  CallDeadline& operator=(const CallDeadline&) = delete;

 private:
  const std::optional<ThreadCallDeadline> outer_;
};

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
  CallCancellation::Watch watch(&ctx);
  Resp response;
  grpc::Status status = (client.stub()->*method)(&ctx, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// How long to wait before opening again a Put the daemon refused at admission; nullopt
// when it was not such a refusal (another code, no kvtier-retry-after-ms hint), retries
// are off, or the wait would pass `deadline`. The daemon adds the hint only to a refusal
// that comes before it reads any frame, so the Put is safe to send again whether or not
// its frames had left this client. The hint, doubled for each refusal in a row up to
// 1 s, with jitter so that refused clients do not return together.
std::optional<absl::Duration> RefusalBackoff(bool enabled, const grpc::ClientContext& ctx,
                                             const grpc::Status& status, int attempt,
                                             absl::Time deadline) {
  if (!enabled || status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
    return std::nullopt;
  }
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto hint = trailers.find("kvtier-retry-after-ms");
  if (hint == trailers.end()) return std::nullopt;
  int64_t ms = 0;
  if (!absl::SimpleAtoi(absl::string_view(hint->second.data(), hint->second.size()), &ms) ||
      ms <= 0) {
    ms = 50;
  }
  // The hint is the least wait: doubled per attempt up to a second (never below the
  // hint), then spread up by as much as half again so refused clients do not return
  // together. A hint past the deadline ends the retries below.
  const double hinted = static_cast<double>(ms);
  double wait_ms = std::max(
      hinted, std::min(1000.0, hinted * static_cast<double>(1 << std::min(attempt, 5))));
  thread_local std::mt19937 rng(std::random_device{}());
  wait_ms *= std::uniform_real_distribution<double>(1.0, 1.5)(rng);
  const absl::Duration wait = absl::Milliseconds(wait_ms);
  if (absl::Now() + wait >= deadline) return std::nullopt;
  return wait;
}

// The fields a chunk's first frame carries, from a ChunkToPut or a DeviceChunkToPut.
template <typename Chunk>
void SetChunkFields(const Chunk& chunk, v1::PutFrame& frame) {
  frame.set_key(chunk.key.ToByteString());
  frame.set_token_count(chunk.token_count);
  if (chunk.chunk_index.has_value()) {
    frame.set_chunk_index(*chunk.chunk_index);
  } else {
    frame.clear_chunk_index();
  }
  if (chunk.prev_key.has_value()) {
    frame.set_prev_key(chunk.prev_key->ToByteString());
  } else {
    frame.clear_prev_key();
  }
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // gRPC's own cut-off of a message past a limit (the daemon's max_message_bytes, or
  // this client's) comes as RESOURCE_EXHAUSTED, which the contract reads as "retry";
  // it can never succeed (kvtier.proto, RegisterLayoutResponse.max_message_bytes).
  if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
      (absl::StartsWith(status.error_message(), "Received message larger than max") ||
       absl::StartsWith(status.error_message(), "Sent message larger than max"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a message is larger than gRPC allows (", status.error_message(),
        "); the daemon's limits are in RegisterLayoutResponse (max_message_bytes, "
        "max_frame_bytes): send smaller frames or fewer keys, do not retry"));
  }
  // Request headers past the daemon's 8 KiB limit (an oversized token): refused by the
  // daemon ("received initial metadata size exceeds limit") or, once this client knows
  // the limit, by gRPC here ("to-be-sent initial metadata size exceeds peer limit").
  // Final as well (kvtier.proto, "Errors").
  if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
      absl::StrContains(status.error_message(), "metadata size exceeds")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request's headers are larger than the daemon takes (", status.error_message(),
        "): a shorter bearer token, do not retry"));
  }
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
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert_file and tls_key_file go together");
  }
  if (!tls_cert_file.empty() && tls_ca_file.empty()) {
    return absl::InvalidArgumentError("tls_cert_file needs tls_ca_file (TLS)");
  }
  for (char c : bearer_token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("bearer_token: printable ASCII without spaces only");
    }
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
  if (http2_max_frame_bytes != 0 &&
      (http2_max_frame_bytes < (16 << 10) || http2_max_frame_bytes >= (16 << 20))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "http2_max_frame_bytes must be 0 or in [16384, 16777216), got ",
        http2_max_frame_bytes));
  }
  if (malloc_top_pad_bytes > (1u << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malloc_top_pad_bytes must be at most 1073741824, got ", malloc_top_pad_bytes));
  }
  if (malloc_arena_max > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malloc_arena_max must be at most 1024, got ", malloc_arena_max));
  }
  return absl::OkStatus();
}

KvTierClient::KvTierClient(std::string target, ClientOptions options,
                           std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::KvCache::NewStub(channel_)) {}

KvTierClient::~KvTierClient() = default;

absl::StatusOr<SharedMemoryPlane*> KvTierClient::Plane() {
  {
    absl::MutexLock lock(&mu_);
    // One resolution at a time, and none under mu_: its DataPlane call and socket
    // connect can take rpc_deadline, and every other use of mu_ (ItemSizes,
    // SharedBufferOf, the Python binding's InSharedMemory) once waited that long too.
    // A caller whose call is cancelled (CallCancellation) stops waiting for another's
    // resolution: nothing of its own is in flight for Cancel() to end.
    while (!mu_.AwaitWithTimeout(
        absl::Condition(+[](bool* resolving) { return !*resolving; }, &plane_resolving_),
        absl::Milliseconds(10))) {
      if (CallCancellation::CurrentCancelled()) {
        return absl::CancelledError(
            "cancelled while another call was finding out how to reach the daemon");
      }
    }
    if (plane_resolved_ && plane_ != nullptr && !plane_->channel().broken() &&
        plane_->channel().PeerGone()) {
      // The daemon exited, or restarted on the same address: its successor knows none
      // of this plane's regions. Decide afresh (a new region socket, or the stream while
      // it is not up yet). The old plane stays alive: calls in flight and SharedBuffers
      // hold it, and the latter's bytes now go by the stream. Its memory and socket are
      // not kept for a daemon that is gone (a long-lived worker sees many restarts).
      plane_->DropStaging();
      plane_->channel().Close();
      retired_planes_.push_back(std::move(plane_));
      plane_resolved_ = false;
      plane_status_ = absl::OkStatus();
    }
    if (plane_resolved_) {
      if (plane_ != nullptr && plane_->channel().broken()) {
        // The daemon left a region request unanswered and has forgotten this client's
        // regions: the stream from now on. The plane object stays (calls in flight may
        // hold it); its buffers are no longer named to the daemon (SharedBufferOf).
        if (plane_status_.ok()) {
          plane_status_ = absl::UnavailableError(
              "the region socket timed out; shared memory is off for this client");
          plane_detail_ = absl::StrCat("stream (gRPC): ", plane_status_.message());
        }
        if (options_.data_plane == ClientOptions::DataPlane::kSharedMemory) {
          return plane_status_;
        }
        return nullptr;
      }
      if (plane_ == nullptr && options_.data_plane == ClientOptions::DataPlane::kSharedMemory) {
        return plane_status_;
      }
      return plane_.get();
    }
    if (options_.data_plane == ClientOptions::DataPlane::kStream) {
      plane_resolved_ = true;
      plane_detail_ = "stream (gRPC): data_plane = stream";
      return nullptr;
    }
    plane_resolving_ = true;
  }
  absl::Status why;
  std::unique_ptr<SharedMemoryPlane> opened;
  std::string region_socket;
  // Not up yet, or this call was cancelled (CallCancellation): decide at the next call.
  std::optional<absl::Status> undecided;
  auto info = CallUnary(*this, &v1::KvCache::Stub::DataPlane, v1::DataPlaneRequest());
  if (info.ok()) NoteDaemonLimits(*info);
  if (!info.ok()) {
    // Anything else (an older daemon answers UNIMPLEMENTED): the stream.
    if (absl::IsUnavailable(info.status()) || absl::IsDeadlineExceeded(info.status()) ||
        absl::IsCancelled(info.status())) {
      undecided = info.status();
    } else {
      why = info.status();
    }
  } else if (info->region_socket().empty()) {
    why = absl::FailedPreconditionError("the daemon serves no shared memory (shm_socket = off)");
  } else {
    auto plane = SharedMemoryPlane::Open(*info, options_.staging_bytes, options_.rpc_deadline);
    if (plane.ok()) {
      opened = *std::move(plane);
      region_socket = info->region_socket();
    } else if (absl::IsCancelled(plane.status())) {
      undecided = plane.status();
    } else {
      why = plane.status();
    }
  }
  absl::MutexLock lock(&mu_);
  plane_resolving_ = false;
  if (undecided.has_value()) {
    return options_.data_plane == ClientOptions::DataPlane::kSharedMemory
               ? absl::StatusOr<SharedMemoryPlane*>(*undecided)
               : absl::StatusOr<SharedMemoryPlane*>(nullptr);
  }
  plane_resolved_ = true;
  if (opened != nullptr) {
    plane_ = std::move(opened);
    plane_detail_ = absl::StrCat("shared memory (region socket ", region_socket, ")");
    return plane_.get();
  }
  plane_status_ = why;
  plane_detail_ = absl::StrCat("stream (gRPC): ", why.message());
  if (options_.data_plane == ClientOptions::DataPlane::kSharedMemory) return plane_status_;
  return nullptr;
}

DataPath KvTierClient::data_path() {
  auto plane = Plane();
  return plane.ok() && *plane != nullptr ? DataPath::kSharedMemory : DataPath::kStream;
}

std::string KvTierClient::data_path_detail() {
  Plane().IgnoreError();
  absl::MutexLock lock(&mu_);
  return plane_resolved_ ? plane_detail_ : "not decided yet (the daemon was unreachable)";
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> KvTierClient::AllocateShared(uint64_t bytes) {
  auto plane = Plane();
  if (!plane.ok()) return plane.status();
  if (*plane == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("AllocateShared: no shared memory with this daemon: ", data_path_detail()));
  }
  return (*plane)->Allocate(bytes);
}

bool KvTierClient::InSharedMemory(const void* p, uint64_t n) {
  return SharedBufferOf(p, n) != nullptr;
}

std::shared_ptr<SharedBuffer> KvTierClient::SharedBufferOf(const void* p, uint64_t n) {
  SharedMemoryPlane* plane;
  {
    absl::MutexLock lock(&mu_);
    plane = plane_.get();  // Retired planes stay alive (retired_planes_).
  }
  // After a region-socket timeout the daemon forgot the buffers: their bytes go by the
  // stream like any other memory.
  if (plane == nullptr || plane->channel().broken()) return nullptr;
  return plane->Find(p, n);
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> KvTierClient::ItemSizes(
    uint64_t namespace_id, std::optional<LayerRange> layers) {
  uint64_t chunk_bytes = 0;
  uint32_t num_layers = 0;
  {
    absl::MutexLock lock(&mu_);
    auto bytes = chunk_bytes_.find(namespace_id);
    auto count = num_layers_.find(namespace_id);
    if (bytes != chunk_bytes_.end() && count != num_layers_.end()) {
      chunk_bytes = bytes->second;
      num_layers = count->second;
    }
  }
  if (num_layers == 0) {
    // A namespace another process registered: ask the daemon its sizes, once.
    v1::DataPlaneRequest req;
    req.set_namespace_id(namespace_id);
    auto info = CallUnary(*this, &v1::KvCache::Stub::DataPlane, req);
    if (!info.ok()) return info.status();  // Unavailable and the like: retry.
    NoteDaemonLimits(*info);
    if (info->num_layers() == 0 || info->chunk_bytes() == 0) {
      // The daemon's code for the same request (kvtier.proto, "Errors").
      return absl::NotFoundError(absl::StrCat(
          "namespace ", absl::Hex(namespace_id, absl::kZeroPad16),
          " is not registered (register its layout first)"));
    }
    // Sizes every buffer and bound below is computed from: a layout's chunk is whole
    // layers, and no daemon stores a chunk past kMaxAcceptedChunkBytes. Anything else is
    // not a daemon's answer, and trusting it would size buffers wrong (or divide by 0).
    if (info->chunk_bytes() % info->num_layers() != 0 ||
        info->chunk_bytes() > kMaxAcceptedChunkBytes) {
      return absl::InternalError(absl::StrCat(
          "DataPlane: the daemon answered chunk_bytes ", info->chunk_bytes(), " for ",
          info->num_layers(), " layers of namespace ", absl::Hex(namespace_id, absl::kZeroPad16),
          ": not a layout's (whole layers, at most ", kMaxAcceptedChunkBytes, " bytes)"));
    }
    chunk_bytes = info->chunk_bytes();
    num_layers = info->num_layers();
    absl::MutexLock lock(&mu_);
    chunk_bytes_[namespace_id] = chunk_bytes;
    num_layers_[namespace_id] = num_layers;
  }
  const uint64_t layer_bytes = chunk_bytes / num_layers;
  if (!layers.has_value()) return std::make_pair(chunk_bytes, layer_bytes);
  if (layers->end <= layers->begin || layers->end > num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers [", layers->begin, ", ", layers->end, ") are not a range of namespace ",
        absl::Hex(namespace_id, absl::kZeroPad16), "'s ", num_layers, " layers"));
  }
  return std::make_pair(layer_bytes * (layers->end - layers->begin), layer_bytes);
}

absl::StatusOr<std::unique_ptr<KvTierClient>> KvTierClient::Connect(
    const std::string& target, ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty");
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (options.malloc_top_pad_bytes > 0) {
    // Before the channel, whose creation may start gRPC's threads: an arena cap holds
    // only for arenas made after it. The result only says whether this call changed
    // anything; none is an error.
    // MALLOC_ARENA_MAX is glibc's older name for glibc.malloc.arena_max: the
    // operator's cap wins as their tunables do.
    const uint32_t arena_max =
        std::getenv("MALLOC_ARENA_MAX") != nullptr ? 0 : options.malloc_arena_max;
    (void)TuneAllocatorForTransfers(options.malloc_top_pad_bytes, StartupGlibcTunables(),
                                    arena_max);
  }
  grpc::ChannelArguments args;
  // A connection of its own, never one another client (or, after fork, the parent
  // process's client) holds in gRPC's global subchannel pool: a forked child's new
  // client sharing the parent's socket broke the parent's connection for good.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  if (options.receive_window_bytes > 0) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.receive_window_bytes);
  }
  if (options.http2_max_frame_bytes > 0) {
    args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, options.http2_max_frame_bytes);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    // gRPC takes the files' text and, when it is not PEM, fails every call with
    // "empty address list" naming no file; a PEM block of the right kind is checked here.
    auto read = [](const std::string& path, const char* field,
                   absl::string_view pem_kind) -> absl::StatusOr<std::string> {
      std::ifstream in(path, std::ios::binary);
      std::stringstream text;
      text << in.rdbuf();
      if (!in.good() && !in.eof()) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read ", path));
      }
      std::string pem = text.str();
      const size_t begin = pem.find("-----BEGIN ");
      if (begin == std::string::npos ||
          pem.find(absl::StrCat(pem_kind, "-----"), begin) == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": ", path, " holds no PEM ", absl::AsciiStrToLower(pem_kind)));
      }
      return pem;
    };
    auto ca = read(options.tls_ca_file, "tls_ca_file", "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    if (!options.tls_cert_file.empty()) {
      auto cert = read(options.tls_cert_file, "tls_cert_file", "CERTIFICATE");
      if (!cert.ok()) return cert.status();
      auto key = read(options.tls_key_file, "tls_key_file", "PRIVATE KEY");
      if (!key.ok()) return key.status();
      if (absl::Status s = CheckKeyMatches(options.tls_key_file, *key, *cert); !s.ok()) return s;
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, args);
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

void KvTierClient::NotePutPlaces(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find("kvtier-put-places");
  const bool free = it != trailers.end() && it->second == "free";
  put_places_free_.store(free, std::memory_order_relaxed);
}

void KvTierClient::PrepareContext(grpc::ClientContext* ctx) const {
  // absl::ToChronoTime maps InfiniteFuture to time_point::max(), which gRPC reads as
  // "no deadline".
  const absl::Time deadline = CallDeadlineFor(this).value_or(absl::Now() + options_.rpc_deadline);
  ctx->set_deadline(absl::ToChronoTime(deadline));
  if (!options_.bearer_token.empty()) {
    ctx->AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
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
    num_layers_[response->namespace_id()] = layout.num_layers;
  }
  // The daemon's frame limit (0 from a daemon that does not say): Put frames fit it.
  daemon_max_frame_.store(response->max_frame_bytes(), std::memory_order_relaxed);
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
  uint32_t leading = 0;  // The present keys before the first absent one.
  for (int t : response->tiers()) {
    if (t == v1::TIER_UNSPECIFIED) break;
    ++leading;
  }
  // An engine schedules prefix_hits chunks' worth of tokens as cached: a count the
  // tiers do not bear out is the daemon's error, never the caller's to act on.
  if (response->prefix_hits() != leading) {
    return absl::InternalError(absl::StrCat(
        "Lookup: server protocol violation: prefix_hits ", response->prefix_hits(),
        " but the tiers show ", leading, " leading present keys of ", keys.size()));
  }
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

absl::StatusOr<v1::HintResponse> KvTierClient::Hint(const std::string& client_id,
                                                    absl::Span<const HintedRequest> requests) {
  v1::HintRequest request;
  request.set_client_id(client_id);
  for (const HintedRequest& r : requests) {
    v1::HintedRequest* out = request.add_requests();
    out->set_namespace_id(r.namespace_id);
    for (const ChunkKey& k : r.keys) out->add_keys(k.ToByteString());
  }
  return CallUnary(*this, &v1::KvCache::Stub::Hint, request);
}

absl::Status KvTierClient::WatchEvents(
    uint64_t namespace_id, uint64_t after,
    const std::function<bool(const v1::EventBatch&)>& on_batch, uint64_t after_instance) {
  v1::EventsRequest request;
  request.set_namespace_id(namespace_id);
  request.set_after_sequence(after);
  request.set_instance_id(after_instance);
  grpc::ClientContext ctx;
  // No deadline: a subscription lasts until on_batch stops it, or CallCancellation
  // cancels it (the only way out while no event comes); only the credentials.
  if (!options_.bearer_token.empty()) {
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
  CallCancellation::Watch watch(&ctx);
  std::unique_ptr<grpc::ClientReader<v1::EventBatch>> reader = stub_->Events(&ctx, request);
  v1::EventBatch batch;
  bool stopped = false;
  while (reader->Read(&batch)) {
    if (!on_batch(batch)) {
      stopped = true;
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (stopped) return absl::OkStatus();
  return FromGrpcStatus(s);
}

void KvTierClient::LearnDaemonLimits() {
  if (daemon_limits_asked_.load(std::memory_order_relaxed)) return;
  auto info = CallUnary(*this, &v1::KvCache::Stub::DataPlane, v1::DataPlaneRequest());
  if (info.ok()) {
    NoteDaemonLimits(*info);
  } else if (!absl::IsUnavailable(info.status()) && !absl::IsDeadlineExceeded(info.status()) &&
             !absl::IsCancelled(info.status()) && !absl::IsResourceExhausted(info.status())) {
    // An older daemon (UNIMPLEMENTED) or a refusal that stays: not asked again.
    daemon_limits_asked_.store(true, std::memory_order_relaxed);
  }
}

void KvTierClient::NoteDaemonLimits(const v1::DataPlaneResponse& info) {
  daemon_limits_asked_.store(true, std::memory_order_relaxed);
  if (info.max_frame_bytes() == 0) return;  // A daemon that does not say.
  uint32_t expected = 0;  // A RegisterLayout answer meanwhile says the same.
  daemon_max_frame_.compare_exchange_strong(expected, info.max_frame_bytes(),
                                            std::memory_order_relaxed);
}

absl::StatusOr<PutResult> KvTierClient::Put(uint64_t namespace_id,
                                            absl::Span<const ChunkToPut> chunks,
                                            const ProgressCallback& progress) {
  const CallDeadline call(this, options_.rpc_deadline);
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
  if (daemon_max_frame_.load(std::memory_order_relaxed) == 0) LearnDaemonLimits();

  // Same host: chunks in AllocateShared buffers go by reference; the others are copied
  // into one staging buffer (with their CRC32C in the same pass) when it fits the
  // staging budget, else streamed.
  auto plane = Plane();
  if (!plane.ok()) return plane.status();
  struct Source {
    const SharedBuffer* buffer = nullptr;  // Null: stream the chunk's bytes.
    uint64_t offset = 0;
    std::optional<uint32_t> crc;
  };
  std::vector<Source> sources(chunks.size());
  std::vector<std::shared_ptr<SharedBuffer>> held;
  std::shared_ptr<SharedBuffer> staging;
  if (*plane != nullptr) {
    uint64_t unshared = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const absl::string_view data = chunks[i].data;
      if (auto b = (*plane)->Find(data.data(), data.size())) {
        sources[i].buffer = b.get();
        sources[i].offset = static_cast<uint64_t>(data.data() - b->data());
        held.push_back(std::move(b));
      } else {
        unshared += data.size();
      }
    }
    if (unshared > 0) staging = (*plane)->AcquireStaging(unshared);
    if (staging) {
      uint64_t at = 0;
      for (size_t i = 0; i < chunks.size(); ++i) {
        if (sources[i].buffer != nullptr) continue;
        const absl::string_view data = chunks[i].data;
        sources[i] = {staging.get(), at,
                      crc32c::CopyAndExtend(0, staging->data() + at, data.data(), data.size(),
                                            crc32c::CrcOver::kSource)};
        at += data.size();
      }
    }
  }
  // The staging buffer goes back to the pool after a put that succeeded; after one that
  // failed the daemon may still be reading it, so it is dropped.
  bool put_ok = false;
  struct StagingReturn {
    SharedMemoryPlane* plane;
    std::shared_ptr<SharedBuffer>& buffer;
    const bool& ok;
    ~StagingReturn() {
      if (!buffer) return;
      if (ok) {
        plane->ReleaseStaging(std::move(buffer));
      } else {
        plane->DiscardStaging(std::move(buffer));
      }
    }
  } staging_return{*plane, staging, put_ok};

  // One deadline for every attempt: a Put the daemon refuses at admission is retried
  // (ClientOptions::retry_refused_puts) until then.
  const absl::Time deadline = *CallDeadlineFor(this);
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    PrepareContext(&ctx);
    CallCancellation::Watch watch(&ctx);
    ctx.set_deadline(absl::ToChronoTime(deadline));
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
    // The daemon sends headers as soon as it accepts the stream; one refused at admission
    // gets its status instead, and Finish below reports it before any payload is sent.
    // Skipped while the daemon says its Put places are free (put_header_wait).
    if (options_.put_header_wait == ClientOptions::PutHeaderWait::kAlways ||
        !put_places_free_.load(std::memory_order_relaxed)) {
      writer->WaitForInitialMetadata();
    }

    v1::PutFrame frame;  // Every field but data.
    frame.set_namespace_id(namespace_id);
    std::string head;
    // Our frame size, or the daemon's limit if that is smaller (learnt at RegisterLayout,
  // or from DataPlane).
    const uint32_t daemon_max = daemon_max_frame_.load(std::memory_order_relaxed);
    const uint64_t max_frame =
        daemon_max != 0 ? std::min(options_.max_frame_bytes, daemon_max) : options_.max_frame_bytes;
    uint64_t sent = 0;
    bool broken = false;  // Write failed: the server ended the stream; Finish says why.
    for (size_t i = 0; i < chunks.size(); ++i) {
      const ChunkToPut& chunk = chunks[i];
      SetChunkFields(chunk, frame);
      const uint64_t size = chunk.data.size();
      if (const Source& src = sources[i]; src.buffer != nullptr) {
        // Frames naming the bytes in shared memory; the daemon copies them. The chunk's
        // CRC32C (on the last frame) is this client's own reading of the bytes, so the
        // daemon stores nothing torn by a writer still busy in the buffer. A chunk staged
        // above has it already; for one in the caller's buffer it is computed piece by
        // piece, each piece after the frame naming it is sent: the daemon's copy of a
        // piece overlaps the checksum of the next instead of waiting for all of it.
        uint32_t crc = src.crc.value_or(0);
        for (uint64_t offset = 0; offset < size && !broken;) {
          const uint64_t n = std::min(kRegionPieceBytes, size - offset);
          const bool last = offset + n == size;
          if (last && !src.crc) crc = crc32c::Extend(crc, chunk.data.data() + offset, n);
          frame.set_offset(offset);
          if (last) {
            frame.set_crc32c(crc);
          } else {
            frame.clear_crc32c();
          }
          v1::RegionRef* ref = frame.mutable_region();
          ref->set_region_id(src.buffer->region_id());
          ref->set_token(src.buffer->token());
          ref->set_offset(src.offset + offset);
          ref->set_length(n);
          grpc::Slice slice(frame.SerializeAsString());
          frame.clear_region();
          grpc::ByteBuffer message(&slice, 1);
          if (!writer->Write(message)) {
            broken = true;
            break;
          }
          if (!last && !src.crc) crc = crc32c::Extend(crc, chunk.data.data() + offset, n);
          offset += n;
          sent += n;
          if (progress) progress(sent, total);
        }
        frame.clear_crc32c();
        if (broken) break;
        continue;
      }
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
    NotePutPlaces(ctx);
    if (!status.ok()) {
      // Refused at admission (nothing read, a retry hint): back off as the hint says,
      // doubling with jitter as refusals repeat, and open the stream again.
      if (std::optional<absl::Duration> wait =
              RefusalBackoff(options_.retry_refused_puts, ctx, status, attempt, deadline)) {
        if (options_.before_put_backoff) options_.before_put_backoff();
        // Cancel() ends the wait at once (as it ends a call waiting on the daemon).
        absl::Notification cancelled;
        {
          CallCancellation::Hook hook([&cancelled] {
            if (!cancelled.HasBeenNotified()) cancelled.Notify();
          });
          cancelled.WaitForNotificationWithTimeout(*wait);
        }
        if (cancelled.HasBeenNotified()) {
          return absl::CancelledError("Put: cancelled while backing off a refusal");
        }
        continue;
      }
      return FromGrpcStatus(status);
    }
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
    put_ok = true;
    return PutResult{response.chunks_stored(), response.chunks_already_present(),
                     response.bytes_received()};
  }
}

absl::StatusOr<std::vector<GotChunk>> KvTierClient::Get(uint64_t namespace_id,
                                                        absl::Span<const ChunkKey> keys,
                                                        std::optional<LayerRange> layers,
                                                        const ProgressCallback& progress,
                                                        v1::GetOrder order, uint64_t lease_id) {
  const CallDeadline call(this, options_.rpc_deadline);
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
            // whole key's, and total_bytes by the layout only when the client knows it:
            // reserve no more than kMaxUpFrontReserveBytes of what it announces (the
            // division keeps the product from wrapping).
            const uint64_t times = layer_major ? std::max<uint64_t>(passes, 1) : 1;
            got.data.reserve(std::min(frame.total_bytes(), kMaxUpFrontReserveBytes / times) *
                             times);
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
  const CallDeadline call(this, options_.rpc_deadline);
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

namespace {

// The Get request both data paths send.
v1::GetRequest MakeGetRequest(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                              std::optional<LayerRange> layers, v1::GetOrder order,
                              uint64_t lease_id) {
  v1::GetRequest request;
  request.set_namespace_id(namespace_id);
  AddKeys(keys, request.mutable_keys());
  if (layers.has_value()) {
    request.mutable_layer_range()->set_begin(layers->begin);
    request.mutable_layer_range()->set_end(layers->end);
  }
  if (order == v1::GET_ORDER_LAYER_MAJOR) request.set_order(order);
  request.set_lease_id(lease_id);
  return request;
}

// Ends a Get stream after its read loop. On a client-side error (a bad frame, or the
// caller's callback refusing one): cancel, drain, and return that error, the cause the
// caller needs (the stream itself ends CANCELLED, or with a server error racing the
// cancel). Otherwise the server's status, then the checker's verdict on the whole.
template <typename Message>
absl::Status FinishGetStream(grpc::ClientContext& ctx, grpc::ClientReader<Message>& reader,
                             Message& scratch, const absl::Status& client_error,
                             GetFrameChecker& checker) {
  if (!client_error.ok()) {
    ctx.TryCancel();
    while (reader.Read(&scratch)) {
    }
    FromGrpcStatus(reader.Finish()).IgnoreError();
    return client_error;
  }
  if (grpc::Status status = reader.Finish(); !status.ok()) return FromGrpcStatus(status);
  return checker.Finish();
}

}  // namespace

absl::Status KvTierClient::GetStreamRaw(uint64_t namespace_id,
                                        absl::Span<const ChunkKey> keys,
                                        std::optional<LayerRange> layers,
                                        const GetFrameRawCallback& on_frame,
                                        v1::GetOrder order, uint64_t lease_id) {
  if (!on_frame) return absl::InvalidArgumentError("GetStreamRaw: on_frame is empty");
  // One deadline for the whole call, the DataPlane RPC that may decide the plane first
  // included (callers that set one already keep theirs).
  const CallDeadline call(this, options_.rpc_deadline);
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
  // The layout's sizes, which every frame is held to (one DataPlane call the first time
  // for a namespace another process registered). Without them (a namespace the daemon
  // does not know, which it answers NOT_FOUND, or a layer range past its layers, which
  // it answers INVALID_ARGUMENT) the stream is checked for consistency alone.
  const auto sizes = ItemSizes(namespace_id, layers);
  std::optional<GetFrameChecker::Shape> shape;
  if (sizes.ok()) {
    shape = GetFrameChecker::Shape{sizes->first, sizes->second,
                                   static_cast<uint32_t>(*ChunkBytes(namespace_id) /
                                                         sizes->second)};
  } else if (absl::IsUnavailable(sizes.status()) || absl::IsDeadlineExceeded(sizes.status()) ||
             absl::IsCancelled(sizes.status())) {
    return sizes.status();  // The Get would fare no better.
  }
  // Same host: through a staging buffer the daemon writes into, when this client knows
  // the layout (to size it) and the staging budget holds it.
  auto plane = Plane();
  if (!plane.ok()) return plane.status();
  if (*plane != nullptr) {
    if (sizes.ok()) {
      // keys.size() * chunk stays far below 2^64: chunks are at most 2^40 bytes
      // (ItemSizes), and a request of 2^23 keys or more goes by the stream (where the
      // daemon refuses it past max_keys_per_request).
      auto staging = keys.size() < (uint64_t{1} << 23)
                         ? (*plane)->AcquireStaging(keys.size() * sizes->first)
                         : nullptr;
      if (staging) {
        absl::Status s = GetViaRegion(namespace_id, keys, layers, order, lease_id,
                                      staging->region_id(), staging->token(),
                                      staging->data(), 0, sizes->first, sizes->second,
                                      on_frame);
        if (s.ok()) {
          (*plane)->ReleaseStaging(std::move(staging));
        } else {
          (*plane)->DiscardStaging(std::move(staging));
        }
        return s;
      }
    }
  }
  v1::GetRequest request = MakeGetRequest(namespace_id, keys, layers, order, lease_id);
  request.set_max_frame_bytes(options_.max_frame_bytes);
  const bool layer_major = order == v1::GET_ORDER_LAYER_MAJOR;

  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  CallCancellation::Watch watch(&ctx);
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
      layers.has_value() ? std::optional<uint32_t>(layers->end) : std::nullopt,
      /*verify_crc=*/true, shape);
  GetFrameParser parser;
  grpc::ByteBuffer message;
  absl::Status client_error;
  while (reader->Read(&message)) {
    client_error = parser.Parse(message)
                       ? absl::OkStatus()
                       : absl::InternalError(
                             "Get: server protocol violation: a message that is not a GetFrame");
    if (client_error.ok()) {
      client_error = checker.Check(parser.header(), parser.pieces(), parser.data_size());
    }
    if (client_error.ok()) {
      client_error = on_frame(parser.header().key_index(), parser.header(), parser.pieces());
    }
    if (!client_error.ok()) break;
  }
  return FinishGetStream(ctx, *reader, message, client_error, checker);
}

absl::Status KvTierClient::GetViaRegion(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                                        std::optional<LayerRange> layers, v1::GetOrder order,
                                        uint64_t lease_id, uint64_t region_id,
                                        uint64_t token, const char* host, uint64_t offset,
                                        uint64_t key_bytes, uint64_t layer_bytes,
                                        const GetFrameRawCallback& on_frame,
                                        bool record_events) {
  const bool layer_major = order == v1::GET_ORDER_LAYER_MAJOR;
  v1::GetRequest request = MakeGetRequest(namespace_id, keys, layers, order, lease_id);
  v1::RegionTarget* target = request.mutable_target();
  target->set_region_id(region_id);
  target->set_token(token);
  target->add_offsets(offset);
  target->set_record_events(record_events);

  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  CallCancellation::Watch watch(&ctx);
  std::unique_ptr<grpc::ClientReader<v1::GetFrame>> reader = stub_->Get(&ctx, request);
  const uint32_t first = layers.has_value() ? layers->begin : 0;
  const uint32_t end = layers.has_value() ? layers->end
                                          : static_cast<uint32_t>(key_bytes / layer_bytes);
  // The daemon checked each whole chunk's CRC32C as it copied it into the region.
  GetFrameChecker checker(
      keys, layer_major,
      layers.has_value() ? std::optional<uint32_t>(layers->begin) : std::nullopt,
      layers.has_value() ? std::optional<uint32_t>(layers->end) : std::nullopt,
      /*verify_crc=*/false, GetFrameChecker::Shape{key_bytes, layer_bytes, end});
  v1::GetFrame frame;
  absl::Status client_error;
  while (reader->Read(&frame)) {
    absl::string_view bytes;
    uint64_t n = 0;
    if (frame.found()) {
      // Every found item is one frame, whole, with its bytes already in the region.
      const uint64_t item = layer_major ? layer_bytes : key_bytes;
      // record_events: each found item in flight, with its own event.
      const uint64_t event = layer_major ? uint64_t{frame.layer() - first} * keys.size() +
                                               frame.key_index()
                                         : frame.key_index();
      if (!frame.data().empty() || frame.offset() != 0 || !frame.last() ||
          frame.total_bytes() != item || frame.key_index() >= keys.size() ||
          (layer_major && (frame.layer() < first || frame.layer() >= end)) ||
          frame.in_flight() != record_events ||
          (record_events && frame.event_index() != event)) {
        client_error = absl::InternalError(absl::StrCat(
            "Get: the daemon broke the registered-memory protocol at key ", frame.key_index(),
            " (frame: ", frame.total_bytes(), " bytes, offset ", frame.offset(), ", layer ",
            frame.layer(), ")"));
        break;
      }
      const uint64_t at = offset + frame.key_index() * key_bytes +
                          (layer_major ? uint64_t{frame.layer() - first} * layer_bytes : 0);
      n = item;
      if (host != nullptr) bytes = absl::string_view(host + at, item);
    }
    const absl::Span<const absl::string_view> pieces =
        bytes.empty() ? absl::Span<const absl::string_view>() : absl::MakeConstSpan(&bytes, 1);
    client_error = checker.Check(frame, pieces, n);
    if (client_error.ok()) client_error = on_frame(frame.key_index(), frame, pieces);
    if (!client_error.ok()) break;
  }
  return FinishGetStream(ctx, *reader, frame, client_error, checker);
}

absl::StatusOr<GetIntoResult> KvTierClient::GetInto(uint64_t namespace_id,
                                                    absl::Span<const ChunkKey> keys,
                                                    absl::Span<char> out,
                                                    std::optional<LayerRange> layers,
                                                    v1::GetOrder order, uint64_t lease_id,
                                                    const GetIntoItemCallback& on_item) {
  const CallDeadline call(this, options_.rpc_deadline);
  const auto sizes = ItemSizes(namespace_id, layers);
  if (!sizes.ok()) {
    return absl::Status(sizes.status().code(),
                        absl::StrCat("GetInto: ", sizes.status().message()));
  }
  // Plain locals, not a structured binding: lambdas below capture them (clang 14).
  const uint64_t key_bytes = sizes->first;
  const uint64_t layer_bytes = sizes->second;
  if (static_cast<unsigned __int128>(out.size()) !=
      static_cast<unsigned __int128>(keys.size()) * key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GetInto: out holds ", out.size(), " bytes; ", keys.size(), " keys of ", key_bytes,
        " bytes need ", keys.size() * key_bytes));
  }
  const bool layer_major = order == v1::GET_ORDER_LAYER_MAJOR;
  const uint32_t first = layers.has_value() ? layers->begin : 0;
  GetIntoResult result;
  result.found.assign(keys.size(), false);
  result.tiers.assign(keys.size(), v1::TIER_UNSPECIFIED);
  result.token_counts.assign(keys.size(), 0);
  auto plane = Plane();
  if (!plane.ok()) return plane.status();
  std::shared_ptr<SharedBuffer> shared =
      *plane != nullptr && !keys.empty() ? (*plane)->Find(out.data(), out.size()) : nullptr;
  // Where each frame's bytes belong in `out`, and the per-item callback.
  auto on_frame = [&](uint32_t index, const GetFrameHeader& frame,
                      absl::Span<const absl::string_view> data) -> absl::Status {
    if (!frame.found()) return absl::OkStatus();
    result.found[index] = true;
    if (frame.total_bytes() != 0) {
      result.tiers[index] = frame.tier();
      result.token_counts[index] = frame.token_count();
    }
    if (!shared) {
      char* dst = out.data() + index * key_bytes +
                  (layer_major ? uint64_t{frame.layer() - first} * layer_bytes : 0) +
                  frame.offset();
      for (absl::string_view piece : data) {
        std::memcpy(dst, piece.data(), piece.size());
        dst += piece.size();
      }
    }
    if (frame.last() && on_item) return on_item(index, layer_major ? frame.layer() : first);
    return absl::OkStatus();
  };
  absl::Status status;
  if (shared) {
    result.path = DataPath::kSharedMemory;
    status = GetViaRegion(namespace_id, keys, layers, order, lease_id, shared->region_id(),
                          shared->token(), shared->data(),
                          static_cast<uint64_t>(out.data() - shared->data()), key_bytes,
                          layer_bytes, on_frame);
  } else {
    result.path = *plane != nullptr ? DataPath::kSharedMemory : DataPath::kStream;
    status = GetStreamRaw(namespace_id, keys, layers, on_frame, order, lease_id);
  }
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<RegionChannel::Registration> KvTierClient::RegisterDeviceMemory(
    absl::string_view ipc_handle, uint64_t bytes, absl::Span<const std::string> event_handles) {
  auto plane = Plane();
  if (!plane.ok()) return plane.status();
  if (*plane == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "GPU memory can be registered only with a daemon on this host: ",
        data_path_detail()));
  }
  return (*plane)->channel().AddDevice(ipc_handle, bytes, event_handles);
}

absl::Status KvTierClient::ReleaseDeviceMemory(uint64_t region_id) {
  auto plane = Plane();
  if (!plane.ok()) return plane.status();
  if (*plane == nullptr) return absl::FailedPreconditionError("no same-host data plane");
  return (*plane)->channel().Remove(region_id);
}

absl::StatusOr<GetIntoResult> KvTierClient::GetIntoDevice(
    uint64_t namespace_id, absl::Span<const ChunkKey> keys,
    const RegionChannel::Registration& region, uint64_t offset,
    std::optional<LayerRange> layers, v1::GetOrder order, uint64_t lease_id,
    const GetIntoItemCallback& on_item, bool record_events) {
  const CallDeadline call(this, options_.rpc_deadline);
  const auto sizes = ItemSizes(namespace_id, layers);
  if (!sizes.ok()) {
    return absl::Status(sizes.status().code(),
                        absl::StrCat("GetIntoDevice: ", sizes.status().message()));
  }
  const auto [key_bytes, layer_bytes] = *sizes;
  const bool layer_major = order == v1::GET_ORDER_LAYER_MAJOR;
  const uint32_t first = layers.has_value() ? layers->begin : 0;
  GetIntoResult result;
  result.path = DataPath::kSharedMemory;
  result.found.assign(keys.size(), false);
  result.tiers.assign(keys.size(), v1::TIER_UNSPECIFIED);
  result.token_counts.assign(keys.size(), 0);
  auto on_frame = [&](uint32_t index, const GetFrameHeader& frame,
                      absl::Span<const absl::string_view>) -> absl::Status {
    if (!frame.found()) return absl::OkStatus();
    result.found[index] = true;
    result.tiers[index] = frame.tier();
    if (frame.last() && on_item) return on_item(index, layer_major ? frame.layer() : first);
    return absl::OkStatus();
  };
  if (keys.empty()) return result;
  absl::Status status =
      GetViaRegion(namespace_id, keys, layers, order, lease_id, region.region_id,
                   region.token, /*host=*/nullptr, offset, key_bytes, layer_bytes, on_frame,
                   record_events);
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<PutResult> KvTierClient::PutFromDevice(uint64_t namespace_id,
                                                      absl::Span<const DeviceChunkToPut> chunks,
                                                      const RegionChannel::Registration& region) {
  const CallDeadline call(this, options_.rpc_deadline);
  const auto sizes = ItemSizes(namespace_id, std::nullopt);
  if (!sizes.ok()) {
    return absl::Status(sizes.status().code(),
                        absl::StrCat("PutFromDevice: ", sizes.status().message()));
  }
  const std::optional<uint64_t> chunk_bytes = sizes->first;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].offset > region.bytes || region.bytes - chunks[i].offset < *chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PutFromDevice: chunk ", i, " (", chunks[i].key.ToHex(), ") at offset ",
          chunks[i].offset, " does not fit the ", region.bytes, "-byte region"));
    }
  }
  if (chunks.empty()) return PutResult{};
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  CallCancellation::Watch watch(&ctx);
  v1::PutResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::PutFrame>> writer = stub_->Put(&ctx, &response);
  // Headers first: a stream refused at admission gets its status before any frame.
  writer->WaitForInitialMetadata();
  v1::PutFrame frame;
  frame.set_namespace_id(namespace_id);
  frame.set_offset(0);
  v1::RegionRef* ref = frame.mutable_region();
  ref->set_region_id(region.region_id);
  ref->set_token(region.token);
  ref->set_length(*chunk_bytes);
  bool broken = false;
  for (const DeviceChunkToPut& chunk : chunks) {
    SetChunkFields(chunk, frame);
    frame.set_crc32c(chunk.crc32c);
    ref->set_offset(chunk.offset);
    if (!writer->Write(frame)) {
      broken = true;  // The daemon ended the stream; Finish says why.
      break;
    }
  }
  if (!broken) broken = !writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (broken) {
    return absl::InternalError("PutFromDevice: the daemon closed the stream without an error");
  }
  return PutResult{response.chunks_stored(), response.chunks_already_present(),
                   response.bytes_received()};
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
