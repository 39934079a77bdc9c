// KvTierClient: the C++ client of kvtierd (service kvtier.v1.KvCache). This is the only
// header an application includes; the wire contract is proto/kvtier/v1/kvtier.proto.
//
// Threading model: thread-safe. A client holds one gRPC channel and stub, both
// thread-safe, and one small mutex-guarded map (the chunk size of each namespace this
// client registered), so any number of threads may call any methods concurrently (each
// call is its own RPC; gRPC multiplexes them over the channel). Every method is synchronous: it returns when its RPC has finished. Callbacks
// (Put progress, Get frames) run on the calling thread, inside the call, in stream
// order, and never after the method returned. Each client's channel has a connection of
// its own (a local subchannel pool). gRPC does not survive fork(): a child process must
// not use a client, or make one, once its parent has used gRPC.
//
// Lifetimes: data passed in (ChunkToPut::data, key spans) is only read during the call;
// no copy outlives it.
//
// Errors: server errors keep their gRPC code and message (see the "Errors" section of
// the proto for what each code asks the caller to do). Errors the client detects
// itself: InvalidArgument (bad arguments, nothing sent), DataLoss (a received chunk
// failed its CRC32C), Internal (the server broke the protocol, e.g. a Get frame out of
// order), DeadlineExceeded (ClientOptions::rpc_deadline passed).
#ifndef KVTIER_CLIENT_KVTIER_CLIENT_H_
#define KVTIER_CLIENT_KVTIER_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/region_channel.h"
#include "client/shared_buffer.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "storage/chunk_key.h"
#include "storage/layout_spec.h"

namespace kvtier {

// Short lower-case name of a tier: "absent", "gpu", "ram", "ssd", or "tier(N)".
std::string TierLabel(v1::Tier tier);

struct ClientOptions {
  // Payload bytes per PutFrame, and the per-frame cap asked of the server in Get.
  // Must be >= 1 and leave room for a frame's header within max_message_bytes.
  // 4 MiB: large enough that per-frame overhead is negligible, small enough that a
  // frame never waits long behind HTTP/2 flow control.
  uint32_t max_frame_bytes = 4u << 20;
  // Deadline of each RPC, measured from its start. A whole Put or Get stream is one RPC,
  // so this also bounds the largest transfer; raise it for multi-GiB batches.
  absl::Duration rpc_deadline = absl::Seconds(60);
  // A Put the daemon refuses at admission (RESOURCE_EXHAUSTED with a
  // kvtier-retry-after-ms hint, before it read any frame: its Put streams are all taken)
  // is opened again after the hinted wait, doubled with jitter as refusals repeat,
  // until rpc_deadline; then the refusal is returned. False: returned at once.
  bool retry_refused_puts = true;
  // Tests only (a sync point): runs as a refused Put starts to back off, before it waits.
  std::function<void()> before_put_backoff;
  // When a Put sends its first frame. kAdaptive: at once while the daemon's last Put
  // answer to this client said its Put places were free (trailer kvtier-put-places),
  // else after the daemon's headers, so that a Put waiting in the daemon's line or
  // refused there costs no payload bytes. The wait is one round trip per Put (14-26% of
  // a 2 MiB put on loopback); under overload it keeps refused and waiting Puts from
  // filling their stream windows in the daemon (bench/RESULTS.md, optimisation log).
  // kAlways: every Put waits for the headers.
  enum class PutHeaderWait { kAdaptive, kAlways };
  PutHeaderWait put_header_wait = PutHeaderWait::kAdaptive;
  // gRPC's limit on one message, sent or received (bytes). 64 MiB, well above a frame.
  int max_message_bytes = 64 << 20;
  // If > 0, Connect() waits this long for the channel to be ready and fails with
  // Unavailable otherwise. 0: connect lazily; the first RPC reports an unreachable
  // daemon (Unavailable).
  absl::Duration connect_timeout = absl::ZeroDuration();
  // HTTP/2 receive window per stream (bytes): how far the daemon may run ahead of this
  // client's reads on a Get. Fixed, because gRPC's default (64 KiB, grown by BDP probes)
  // starts every new connection slow and grows slowest when many connections share the
  // link. 0 keeps gRPC's BDP-probed default. Must be 0 or in [64 KiB, 1 GiB).
  int receive_window_bytes = 8 << 20;
  // Largest HTTP/2 DATA frame the daemon may send this client (gRPC's default: 16 KiB,
  // which cuts a 4 MiB Get frame into 256 frames, each parsed on its own). 1 MiB: one
  // client's 2 MiB RAM gets 6% faster on 16% less client CPU per GB; 4 clients and
  // larger chunks within noise (bench/RESULTS.md, optimisation log). 0 keeps gRPC's
  // default. Must be 0 or in [16 KiB, 16 MiB).
  int http2_max_frame_bytes = 1 << 20;
  // Free memory glibc keeps at the top of each malloc arena of this process
  // (client/allocator_tuning.h, which says what else it changes): without it, gRPC's
  // per-read buffers are given back to the kernel and faulted in again on every frame,
  // which made the client's CPU the limit of a Get (2 MiB chunks, 1 client: 0.36 GB/s
  // instead of 2.2). Process-wide: the first Connect whose options pass Validate() sets
  // it, before it makes its channel (so even if that Connect then fails); never set when
  // GLIBC_TUNABLES tunes malloc. If glibc refuses it, the
  // allocator stays as it was (only speed is at stake). 0 leaves the process's
  // allocator alone. At most 1 GiB.
  uint64_t malloc_top_pad_bytes = 16 << 20;
  // At most this many malloc arenas in this process (glibc's M_ARENA_MAX;
  // client/allocator_tuning.h), set with the pad above and only with it (a
  // malloc_top_pad_bytes of 0 leaves the arenas alone too), and not when the process
  // started with MALLOC_ARENA_MAX set. For a process that runs many client threads at
  // once: 64 client threads in one process spent 1.75x the CPU per GiB got of 4 with
  // glibc's default (8 arenas per core), and their Gets ran at 0.72-0.76 of the 4-thread
  // rate; with 2 arenas, 0.81-0.89, and about 30% less client CPU per GiB (kv_bench RAM
  // grid, no put cells, medians of 3; bench/RESULTS.md, optimisation log). It holds for
  // the whole process, whose other threads then share those arenas too, so it is off by
  // default. glibc applies a cap only to arenas made after it, and not at all once the
  // process has made more than 8; a later Connect's value is ignored: set it on the
  // first Connect, before the process's threads start (or MALLOC_ARENA_MAX in the
  // environment). 0: glibc's default. At most 1024.
  uint32_t malloc_arena_max = 0;

  // How chunk bytes travel (kvtier.proto, "Same-host data plane"). kAuto: through shared
  // memory when the daemon is on this host and admits this process, else the gRPC
  // stream. kStream: always the stream. kSharedMemory: shared memory or fail (the first
  // Put or Get returns why).
  enum class DataPlane { kAuto, kStream, kSharedMemory };
  DataPlane data_plane = DataPlane::kAuto;
  // Shared memory this client may hold to stage transfers from and into the caller's
  // own buffers (buffers from AllocateShared need none). A transfer that needs more
  // streams. 0: stage nothing (only AllocateShared buffers use shared memory).
  uint64_t staging_bytes = 1ull << 30;

  // Security (kvtierd's tls_* and tenants_file options). With tls_ca_file the channel is
  // TLS, verifying the daemon's certificate against these CA certificates (PEM);
  // tls_cert_file and tls_key_file add a client certificate (mutual TLS).
  // tls_server_name overrides the name checked in the daemon's certificate (default:
  // the target's host). bearer_token is sent as "authorization: Bearer <token>" on
  // every call. A "unix:/path" target reaches the daemon's listen_unix socket, where the
  // daemon knows this process's uid.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  std::string bearer_token;

  // Returns: Ok, InvalidArgument naming the bad field.
  absl::Status Validate() const;
};

struct RegisterResult {
  uint64_t namespace_id = 0;
  uint64_t chunk_bytes = 0;
  bool already_registered = false;
};

struct LookupResult {
  std::vector<v1::Tier> tiers;   // One per key, in request order; TIER_UNSPECIFIED: absent.
  uint32_t prefix_hits = 0;  // Leading keys present.
  // The lease on the hits, when Lookup asked for one and the daemon granted it; 0
  // otherwise. Pass it to the Get that loads them, or to ReleaseLease.
  uint64_t lease_id = 0;
};

struct ChunkToPut {
  ChunkKey key;
  absl::string_view data;    // The whole chunk: exactly the namespace's chunk_bytes.
  uint32_t token_count = 0;  // Informational (tokens_per_chunk for a full chunk).
  // Optional, for the daemon's eviction: i for key[i], and key[i-1] (none for chunk 0).
  // A worker putting a request's chunks knows both; see kvtier.proto PutFrame.
  std::optional<uint32_t> chunk_index;
  std::optional<ChunkKey> prev_key;
};

// A chunk in GPU memory this process registered (RegisterDeviceMemory), for
// PutFromDevice: its bytes are region[offset, offset + chunk_bytes).
struct DeviceChunkToPut {
  ChunkKey key;
  uint64_t offset = 0;
  // CRC32C of the chunk's bytes, as the worker knows them: computed on its GPU, or kept
  // from the Get that loaded the chunk. The daemon copies the bytes into its pool on the
  // device and stores the chunk only if the pool's copy matches it, so a chunk still
  // being written on the GPU, or one that a copy tore, is never stored.
  uint32_t crc32c = 0;
  uint32_t token_count = 0;  // As ChunkToPut.
  std::optional<uint32_t> chunk_index;
  std::optional<ChunkKey> prev_key;
};

struct PutResult {
  uint32_t stored = 0;           // Chunks newly stored.
  uint32_t already_present = 0;  // Chunks the server already had.
  uint64_t bytes = 0;            // Payload bytes the server received.
};

// One upcoming request of a scheduler's queue, for Hint: its keys from chunk 0.
struct HintedRequest {
  uint64_t namespace_id = 0;
  std::vector<ChunkKey> keys;
};

// The largest chunk this client accepts from a daemon (1 TiB: past any host's memory).
// A daemon's answer naming a larger one (DataPlane's chunk_bytes, a Get frame's
// total_bytes, a Prefill Plan's chunk_bytes) is a protocol violation (Internal).
inline constexpr uint64_t kMaxAcceptedChunkBytes = uint64_t{1} << 40;

// A half-open layer range [begin, end), end exclusive.
struct LayerRange {
  uint32_t begin = 0;
  uint32_t end = 0;
};

struct GotChunk {
  bool found = false;
  std::string data;           // The chunk, or its requested layer range.
  uint32_t crc32c = 0;        // CRC32C of the whole chunk, as stored.
  uint32_t token_count = 0;   // As given at Put.
  v1::Tier tier = v1::TIER_UNSPECIFIED;  // Tier the server read it from.
  // True when `data` is the whole chunk and matched crc32c. A layer-range read cannot be
  // checked (the CRC covers the whole chunk) and leaves this false.
  bool crc_verified = false;
};

// How a client's transfers go: decided at its first transfer (or data_path() call).
enum class DataPath { kStream, kSharedMemory };

// Called as items of a GetInto land: key `key_index`'s bytes (chunk-major) or its layer
// `layer` (layer-major) are in place. Not called for absent keys. Returning non-Ok
// cancels the transfer and GetInto returns that status.
using GetIntoItemCallback = std::function<absl::Status(uint32_t key_index, uint32_t layer)>;

struct GetIntoResult {
  std::vector<bool> found;                // Per key.
  std::vector<v1::Tier> tiers;            // Per key; TIER_UNSPECIFIED when absent.
  std::vector<uint32_t> token_counts;     // Per key, as given at Put; 0 when absent.
  DataPath path = DataPath::kStream;      // How the bytes came.
};

struct PinResult {
  uint32_t pinned = 0;
  uint32_t not_found = 0;
};

// Called as a transfer progresses: payload bytes sent (Put) or received (Get) so far,
// and the total expected. For Get the total is an estimate until the stream ends: it
// assumes every chunk not yet seen has the size of the first one received. A Put the
// daemon refused at admission and this client opened again (retry_refused_puts) starts
// over from 0: bytes sent on the refused attempt are counted again.
using ProgressCallback = std::function<void(uint64_t bytes_done, uint64_t bytes_total)>;

// Receives each frame of a Get stream, after the client checked it (key order,
// contiguous offsets, sizes; for a whole-chunk read, the CRC32C). `key_index` indexes
// the keys passed to GetStream. The frame is only valid during the call. Returning
// non-Ok cancels the stream and GetStream returns that status.
//
// Chunk-major order (the default): indices only grow, and every key gets at least one
// frame. The first frame with a given key_index carries found, total_bytes, crc32c,
// token_count and tier; a key with found = false gets no other. A key's bytes are
// complete (and, for whole chunks, verified) when the frame with last = true arrives; if
// the stream fails before that, discard what was received for that key.
//
// Layer-major order (v1::GET_ORDER_LAYER_MAJOR): one pass per layer, frame.layer() saying
// which; in each pass the found keys in index order (the first pass also answers each
// absent key once, found = false), each key's piece (that layer of it, total_bytes
// long) as frames with offsets within the piece, the first carrying the fields above
// and `last` ending it. Layer l of key k goes at byte (l - first layer) * total_bytes
// of k's result. Whole chunks are CRC-checked only when the stream ends: nothing
// received is verified until GetStream returns Ok.
using GetFrameCallback =
    std::function<absl::Status(uint32_t key_index, const v1::GetFrame& frame)>;

// A Get frame's fields other than `data`: header.data() is always empty.
using GetFrameHeader = v1::GetFrame;

// Like GetFrameCallback, with the frame's `data` as gRPC received it instead of copied
// into the frame: `data` are the pieces of GetFrame.data in order (none empty; their
// total is the frame's payload size), pointing into gRPC's receive buffers. The header
// and every piece are only valid during the call. Same order, checks and guarantees as
// GetFrameCallback (whole chunks are CRC-checked over the pieces as they arrive).
using GetFrameRawCallback = std::function<absl::Status(
    uint32_t key_index, const GetFrameHeader& header,
    absl::Span<const absl::string_view> data)>;

class SharedMemoryPlane;

class KvTierClient {
 public:
  // Creates a client for `target` (a gRPC target such as "127.0.0.1:50051" or
  // "unix:/run/kvtier.sock"), over an insecure channel.
  // Returns: Ok, InvalidArgument (bad options or empty target), Unavailable (only with
  // options.connect_timeout > 0: not ready in time).
  static absl::StatusOr<std::unique_ptr<KvTierClient>> Connect(const std::string& target,
                                                               ClientOptions options = {});

  ~KvTierClient();
  KvTierClient(const KvTierClient&) = delete;
  KvTierClient& operator=(const KvTierClient&) = delete;

  // Registers `layout` (idempotent). The client validates it first and checks that the
  // server's namespace id and chunk size agree with its own computation.
  // Returns: Ok, InvalidArgument, FailedPrecondition (e.g. chunk larger than the server
  // allows), Unavailable, Internal (server and client disagree on the namespace id or
  // chunk size).
  absl::StatusOr<RegisterResult> RegisterLayout(const LayoutSpec& layout);

  // Where each key lives, and the prefix hit length. `lease_seconds` > 0 asks the daemon
  // to hold the hits (those in RAM) until the Get that names the lease ends, the lease
  // is released, or it expires (LookupRequest in kvtier.proto).
  // Returns: Ok, InvalidArgument, NotFound (namespace), Unavailable, Internal.
  absl::StatusOr<LookupResult> Lookup(uint64_t namespace_id,
                                      absl::Span<const ChunkKey> keys,
                                      uint32_t lease_seconds = 0);
  // Ends a Lookup lease without a Get. Returns whether there was one to end.
  // Returns: Ok, NotFound (namespace), Unavailable.
  absl::StatusOr<bool> ReleaseLease(uint64_t namespace_id, uint64_t lease_id);

  // Tells the daemon what this scheduler will run next (see HintRequest): replaces the
  // previous hint of `client_id`; an empty `requests` withdraws it.
  // Returns: Ok, InvalidArgument, NotFound (a namespace), ResourceExhausted (too many
  // hinting clients), Unavailable.
  absl::StatusOr<v1::HintResponse> Hint(const std::string& client_id,
                                        absl::Span<const HintedRequest> requests);

  // Follows the daemon's chunk events (Events) of `namespace_id` (0: all), from after
  // sequence `after` (0: from now on), calling `on_batch` for each batch until it
  // returns false (the call is then cancelled and this returns Ok) or the stream ends.
  // `after_instance`: the instance_id of the batch `after` came from, so that a cursor
  // from an earlier run of the daemon (sequences restart with each run) gets the
  // oldest events kept, marked resync, instead of skipping the new run's first ones;
  // 0: not checked. No deadline: it runs until stopped. Returns: Ok, ResourceExhausted
  // (too many subscribers), Unavailable, Cancelled.
  absl::Status WatchEvents(uint64_t namespace_id, uint64_t after,
                           const std::function<bool(const v1::EventBatch&)>& on_batch,
                           uint64_t after_instance = 0);

  // Stores `chunks` in one Put stream, each cut into frames of max_frame_bytes, the last
  // frame of each carrying the CRC32C of the whole chunk. `progress`, if set, is called
  // after every frame. Chunks that completed before an error stay stored. An empty
  // `chunks` returns a zero result without contacting the server. If this client
  // registered the namespace, chunk sizes are checked before anything is sent;
  // otherwise the server checks them (and the first Put of a client that knows no frame
  // limit of the daemon asks for it: one DataPlane call).
  // Returns: Ok, InvalidArgument (e.g. an empty chunk, or a size other than the
  // namespace's chunk_bytes), NotFound, ResourceExhausted, Unavailable,
  // DeadlineExceeded.
  absl::StatusOr<PutResult> Put(uint64_t namespace_id, absl::Span<const ChunkToPut> chunks,
                                const ProgressCallback& progress = nullptr);

  // Reads `keys`, optionally only `layers` of each, into memory: one GotChunk per key,
  // in order; an absent key is a GotChunk with found = false, not an error. Whole
  // chunks are CRC32C-checked. Empty `keys`: empty result, no RPC.
  // Returns: Ok, InvalidArgument, NotFound (namespace), DataLoss (a chunk failed its
  // checksum on the server, which deleted it, or in transit), Unavailable, Internal.
  // `order` changes only the order on the wire (layer-major: each chunk is assembled
  // from its layers as they arrive); the result is the same.
  absl::StatusOr<std::vector<GotChunk>> Get(
      uint64_t namespace_id, absl::Span<const ChunkKey> keys,
      std::optional<LayerRange> layers = std::nullopt,
      const ProgressCallback& progress = nullptr,
      v1::GetOrder order = v1::GET_ORDER_CHUNK_MAJOR, uint64_t lease_id = 0);

  // Streaming Get: hands each frame to `on_frame` as it arrives, so a caller can write
  // chunks to their destination without holding them all. Same checks and codes as
  // Get(), plus whatever `on_frame` returns.
  // Builds one GetFrame per frame, copying its data; GetStreamRaw avoids that copy.
  absl::Status GetStream(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                         std::optional<LayerRange> layers,
                         const GetFrameCallback& on_frame,
                         v1::GetOrder order = v1::GET_ORDER_CHUNK_MAJOR,
                         uint64_t lease_id = 0);

  // Zero-copy streaming Get: hands each frame's data to `on_frame` as views into the
  // received message, so the only copy of the payload after the kernel's is whatever
  // `on_frame` makes. Same checks and codes as GetStream.
  absl::Status GetStreamRaw(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                            std::optional<LayerRange> layers,
                            const GetFrameRawCallback& on_frame,
                            v1::GetOrder order = v1::GET_ORDER_CHUNK_MAJOR,
                            uint64_t lease_id = 0);

  // Reads `keys` (optionally `layers` of each) into `out`: key i's bytes at
  // out[i * key_bytes], where key_bytes is the chunk size (or the layer range's part of
  // it); `out` must hold keys.size() * key_bytes bytes. When `out` lies in a buffer from
  // AllocateShared, the daemon writes the bytes there directly; otherwise they come
  // through a staging buffer or the stream. Absent keys leave their bytes untouched.
  // The namespace's layout sizes `out` (known from RegisterLayout, else asked of the
  // daemon). If GetInto fails, bytes of keys it did not report may still be landing in
  // registered memory for a moment (the daemon finishes the copy it is in).
  // Returns: as Get (NotFound: namespace unknown; InvalidArgument: layers outside it,
  // or `out` the wrong size).
  absl::StatusOr<GetIntoResult> GetInto(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                                        absl::Span<char> out,
                                        std::optional<LayerRange> layers = std::nullopt,
                                        v1::GetOrder order = v1::GET_ORDER_CHUNK_MAJOR,
                                        uint64_t lease_id = 0,
                                        const GetIntoItemCallback& on_item = nullptr);

  // Same host, GPU: registers `bytes` of this process's GPU memory, from the start of
  // the allocation whose CUDA IPC handle (cudaIpcGetMemHandle, 64 bytes) is
  // `ipc_handle`, on the daemon's region socket. Returns: Ok, FailedPrecondition (the
  // data path is the stream, or the daemon has no GPU), InvalidArgument (a stale or
  // foreign handle, an allocation smaller than `bytes`), ResourceExhausted.
  // `event_handles` (cudaIpcGetEventHandle of events made with cudaEventInterprocess |
  // cudaEventDisableTiming; at most 512) are for GetIntoDevice's record_events.
  absl::StatusOr<RegionChannel::Registration> RegisterDeviceMemory(
      absl::string_view ipc_handle, uint64_t bytes,
      absl::Span<const std::string> event_handles = {});
  // Forgets a registration. Returns: Ok, NotFound, FailedPrecondition (no data plane).
  absl::Status ReleaseDeviceMemory(uint64_t region_id);

  // Same host, GPU: stores chunks from GPU memory this process registered on the
  // daemon's region socket (RegisterDeviceMemory), on one Put stream: the daemon copies
  // each chunk from the region into its pool on its CUDA streams (no byte crosses the
  // socket) and checks it against the chunk's CRC32C before it becomes visible. Each
  // chunk is the namespace's chunk_bytes.
  // Returns: as Put (NotFound: namespace unknown), plus FailedPrecondition (no GPU on
  // the daemon, or the region unknown; like GetIntoDevice) and InvalidArgument (a chunk
  // outside the region, a CRC32C that does not match the bytes: nothing of that chunk
  // is stored).
  absl::StatusOr<PutResult> PutFromDevice(uint64_t namespace_id,
                                          absl::Span<const DeviceChunkToPut> chunks,
                                          const RegionChannel::Registration& region);

  // Same host, GPU: reads `keys` straight into GPU memory this process registered on
  // the daemon's region socket (RegionChannel::AddDevice, on a daemon whose DataPlane
  // says device_memory): key k's bytes (its layers `layers`) at `offset` + k *
  // key_bytes of the region. The daemon copies on its CUDA streams and answers each key
  // (chunk-major) or each layer (layer-major) once it has landed, when `on_item` runs.
  // `record_events` (a region registered with event handles): `on_item` runs as soon
  // as the item's copies are queued on the daemon's stream, before they land; the
  // worker makes its stream wait on the region's event number item (the key's index
  // chunk-major; (layer - layers->begin) * keys.size() + key layer-major) before
  // reading them, writes nothing there before the call returns (the daemon may still be
  // checking what landed), and uses nothing unless it returns Ok, its verdict on every
  // item. One such call per region at a time.
  // Returns: as GetInto, plus FailedPrecondition (no GPU on the daemon, region unknown),
  // InvalidArgument (the keys do not fit the region; record_events with more items
  // than the region has events) and Aborted (record_events: the region's events are
  // in use by another call).
  absl::StatusOr<GetIntoResult> GetIntoDevice(uint64_t namespace_id,
                                              absl::Span<const ChunkKey> keys,
                                              const RegionChannel::Registration& region,
                                              uint64_t offset,
                                              std::optional<LayerRange> layers = std::nullopt,
                                              v1::GetOrder order = v1::GET_ORDER_CHUNK_MAJOR,
                                              uint64_t lease_id = 0,
                                              const GetIntoItemCallback& on_item = nullptr,
                                              bool record_events = false);

  // Memory shared with the daemon (same host only): Put from it and GetInto it move
  // each byte once. Returns: Ok, FailedPrecondition (the data path is the stream: see
  // data_path_detail()), the daemon's refusal (ResourceExhausted: region limit).
  absl::StatusOr<std::shared_ptr<SharedBuffer>> AllocateShared(uint64_t bytes);
  // True when [p, p + n) lies in one buffer from this client's AllocateShared: GetInto
  // and Put of that memory move the bytes without staging.
  bool InSharedMemory(const void* p, uint64_t n);
  // The buffer from this client's AllocateShared that holds [p, p + n), or null: for a
  // caller naming it in a request of its own (a Prefill session's target).
  std::shared_ptr<SharedBuffer> SharedBufferOf(const void* p, uint64_t n);
  // A namespace's chunk_bytes: from RegisterLayout, else asked of the daemon once.
  // Nullopt when the daemon cannot say (unknown namespace, unreachable).
  std::optional<uint64_t> ChunkBytes(uint64_t namespace_id) {
    auto sizes = ItemSizes(namespace_id, std::nullopt);
    if (!sizes.ok()) return std::nullopt;
    return sizes->first;
  }
  // The data path this client's transfers take, and why (e.g. which socket, or why not
  // shared memory). Decided once, at the first transfer or call of these.
  DataPath data_path();
  std::string data_path_detail();

  // Pins keys in the RAM tier for `ttl_seconds` (0: until Unpin).
  // Returns: Ok, InvalidArgument, NotFound (namespace), ResourceExhausted, Unavailable.
  absl::StatusOr<PinResult> Pin(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                                uint32_t ttl_seconds);
  // Returns the number of keys that were pinned. Codes as Pin, less ResourceExhausted.
  absl::StatusOr<uint32_t> Unpin(uint64_t namespace_id, absl::Span<const ChunkKey> keys);
  // Returns the number of keys that were present. Codes as Unpin.
  absl::StatusOr<uint32_t> Delete(uint64_t namespace_id, absl::Span<const ChunkKey> keys);
  // Removes every chunk of the namespace (the layout stays registered); returns how many.
  // Returns: Ok, NotFound, Unavailable.
  absl::StatusOr<uint64_t> Clear(uint64_t namespace_id);
  // Returns: Ok, Unavailable.
  absl::StatusOr<v1::StatsResponse> Stats();

  // Raw access for tests that need to send what this class never would (malformed
  // frames, bad key lengths). Use PrepareContext() to get the same deadline.
  v1::KvCache::Stub* stub() const { return stub_.get(); }
  // Sets `ctx`'s deadline to now + options().rpc_deadline, or, inside a Put or Get on
  // this thread, to that call's deadline (one rpc_deadline bounds all its RPCs).
  void PrepareContext(grpc::ClientContext* ctx) const;
  const ClientOptions& options() const { return options_; }
  const std::string& target() const { return target_; }

 private:
  KvTierClient(std::string target, ClientOptions options,
               std::shared_ptr<grpc::Channel> channel);
  // Takes a finished Put's kvtier-put-places trailer: the next Put skips the header
  // wait only after "free" (ClientOptions::put_header_wait).
  void NotePutPlaces(const grpc::ClientContext& ctx);
  // GetStreamRaw over shared memory: the bytes land in `staging` (key i at
  // i * key_bytes) and `on_frame` gets views of them. Error kUnimplemented: not
  // applicable (stream instead).
  // `host` is the region's memory in this process, or null for GPU memory (the frames'
  // data views are then empty).
  absl::Status GetViaRegion(uint64_t namespace_id, absl::Span<const ChunkKey> keys,
                            std::optional<LayerRange> layers, v1::GetOrder order,
                            uint64_t lease_id, uint64_t region_id, uint64_t token,
                            const char* host, uint64_t offset, uint64_t key_bytes,
                            uint64_t layer_bytes, const GetFrameRawCallback& on_frame,
                            bool record_events = false);
  // Key bytes and layer bytes of a namespace this client registered.
  // Returns: Ok, NotFound (namespace unknown), InvalidArgument (layers outside it): the
  // daemon's codes for the same request; Internal (a DataPlane answer no layout has);
  // or the status of asking the daemon (Unavailable and the like).
  absl::StatusOr<std::pair<uint64_t, uint64_t>> ItemSizes(uint64_t namespace_id,
                                                         std::optional<LayerRange> layers);

  const std::string target_;
  const ClientOptions options_;
  // The daemon's frame limit, from RegisterLayoutResponse or DataPlaneResponse (0: not
  // known yet, or a daemon that does not say).
  std::atomic<uint32_t> daemon_max_frame_{0};
  std::atomic<bool> daemon_limits_asked_{false};  // A DataPlane answer was read.
  // Learns the daemon's frame limit with one DataPlane call, once (Put, unless an
  // earlier DataPlane answer or RegisterLayout said it). Errors are left to the Put
  // that follows; transient ones are asked again at the next Put.
  void LearnDaemonLimits();
  // Records the limits a DataPlane answer carries.
  void NoteDaemonLimits(const v1::DataPlaneResponse& info);
  // The last Put's kvtier-put-places trailer said "free": the next Put need not wait for
  // the headers (ClientOptions::put_header_wait).
  std::atomic<bool> put_places_free_{false};
  // The stub also holds a reference to the channel; keeping one here makes the
  // channel's lifetime visibly the client's.
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::KvCache::Stub> stub_;

  // chunk_bytes of every namespace RegisterLayout succeeded for, so Put can reject a
  // wrong-sized chunk before streaming it. Never shrinks: a layout's chunk size is
  // fixed by its namespace id.
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, uint64_t> chunk_bytes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint32_t> num_layers_ ABSL_GUARDED_BY(mu_);

  // The same-host data plane, resolved at the first transfer (one DataPlane RPC and a
  // socket connect, outside mu_; other callers of Plane wait for it): null when
  // transfers stream; with data_plane = kSharedMemory, why not. An unreachable daemon
  // is not a decision: the next call tries again. Resolved again when the daemon behind
  // the plane has gone (restarted).
  absl::StatusOr<SharedMemoryPlane*> Plane();
  bool plane_resolving_ ABSL_GUARDED_BY(mu_) = false;
  bool plane_resolved_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<SharedMemoryPlane> plane_ ABSL_GUARDED_BY(mu_);
  // Planes of daemons that went away: kept, as calls and SharedBuffers may hold them.
  std::vector<std::unique_ptr<SharedMemoryPlane>> retired_planes_ ABSL_GUARDED_BY(mu_);
  absl::Status plane_status_ ABSL_GUARDED_BY(mu_);
  std::string plane_detail_ ABSL_GUARDED_BY(mu_);
};

// The one mapping from grpc::Status to absl::Status: same code number, same message.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_KVTIER_CLIENT_H_
