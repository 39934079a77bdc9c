// PyClient: the KvTierClient as the Python package's native layer (kvtier._native.Client).
// kvtier/client.py wraps it into the public kvtier.Client; nothing else calls it.
//
// Every method that talks to the daemon releases the GIL for the whole RPC, so other
// Python threads (an engine's scheduler, a compute thread) run while bytes move, and the
// bytes move once: Put hands the caller's buffers to gRPC as they are (the C++ client's
// zero-copy Put), GetInto copies each frame from gRPC's receive buffers straight into the
// caller's buffer. The GIL is taken again only to call a Python callback (on_layer) or
// allocate a result object (Get), once per chunk or layer, never per byte.
//
// Buffers are held through BufferRef for the whole call, so Python cannot free or resize
// them while the daemon's bytes are being copied in; once a method returns (or raises),
// nothing in this process writes into them any more. A buffer in shared memory
// (AllocateShared) is the exception: the daemon writes it directly, and after a failed
// or cancelled call finishes the chunk copy it is in (KvTierClient::GetInto).
//
// Threading: thread-safe, like KvTierClient: any number of Python threads may call any
// method concurrently.
#ifndef KVTIER_CLIENT_PYTHON_NATIVE_PY_CLIENT_H_
#define KVTIER_CLIENT_PYTHON_NATIVE_PY_CLIENT_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/kvtier_client.h"
#include "client/python/native/buffer_ref.h"
#include "client/python/native/py_canceller.h"

namespace kvtier::python {

class PyClient {
 public:
  // Raises kvtier errors (InvalidArgument for bad options, Unavailable when
  // connect_timeout_seconds > 0 and the daemon is not reachable in time).
  // The tls_* and bearer_token arguments are ClientOptions' ("" : unset).
  PyClient(const std::string& target, uint32_t max_frame_bytes, double rpc_deadline_seconds,
           double connect_timeout_seconds, int receive_window_bytes,
           const std::string& tls_ca_file = "", const std::string& tls_cert_file = "",
           const std::string& tls_key_file = "", const std::string& tls_server_name = "",
           const std::string& bearer_token = "", uint64_t malloc_top_pad_bytes = 16 << 20,
           uint32_t malloc_arena_max = 0);
  // Tears the client down without the GIL: its staging regions are unregistered with
  // the daemon as they go, which waits as long as the daemon takes to answer.
  ~PyClient();

  // Returns (namespace_id, chunk_bytes, already_registered).
  pybind11::tuple RegisterLayout(const std::string& model_id, const std::string& model_revision,
                                 uint32_t dtype, uint32_t num_layers, uint32_t num_kv_heads,
                                 uint32_t head_dim, uint32_t tokens_per_chunk,
                                 uint32_t tp_world_size, uint32_t tp_rank,
                                 uint32_t key_position);
  // Returns (tiers: list[int], prefix_hits: int, lease_id: int).
  pybind11::tuple Lookup(uint64_t namespace_id, const pybind11::list& keys,
                         uint32_t lease_seconds);
  // Returns whether a lease was ended.
  bool ReleaseLease(uint64_t namespace_id, uint64_t lease_id);
  // Returns (stored, already_present, bytes). `buffers[i]` is chunk i's whole payload.
  pybind11::tuple Put(uint64_t namespace_id, const pybind11::list& keys,
                      const pybind11::list& buffers, const pybind11::object& token_counts,
                      const pybind11::object& chain_start, const pybind11::object& prev_key,
                      PyCanceller* canceller);
  // Fills outs[i] (a writable C-contiguous buffer) with key i's bytes: the whole chunk,
  // or layers [layers[0], layers[1]) of it. `order`: 0 chunk-major, 1 layer-major.
  // on_layer(l), if not None, is called (GIL taken) once layer l of every found chunk
  // has landed (layer-major only). Returns (found: list[bool], tiers: list[int],
  // token_counts: list[int], bytes: int). A key's buffer is complete only when the call
  // returns; an error leaves every buffer in an unspecified state.
  pybind11::tuple GetInto(uint64_t namespace_id, const pybind11::list& keys,
                          const pybind11::list& outs, const pybind11::object& layers,
                          int order, const pybind11::object& on_layer, uint64_t lease_id,
                          PyCanceller* canceller);
  // GPU memory of this process, registered by its CUDA IPC handle, with the IPC handles
  // of interprocess events for record_events. Returns (region_id, token, bytes).
  pybind11::tuple RegisterDeviceMemory(const pybind11::bytes& ipc_handle, uint64_t nbytes,
                                       const std::vector<std::string>& event_handles);
  void ReleaseDeviceMemory(uint64_t region_id);
  // Stores chunk i from a registered GPU region at offsets[i], checked against
  // crc32cs[i] (KvTierClient::PutFromDevice); chain_start and prev_key as Put. Returns
  // (stored, already_present, bytes).
  pybind11::tuple PutFromDevice(uint64_t namespace_id, const pybind11::list& keys,
                                uint64_t region_id, uint64_t token, uint64_t region_bytes,
                                const std::vector<uint64_t>& offsets,
                                const std::vector<uint32_t>& crc32cs,
                                const pybind11::object& token_counts,
                                const pybind11::object& chain_start,
                                const pybind11::object& prev_key);
  // Loads keys into a registered GPU region at `offset` (key i at offset + i x bytes
  // per key), the daemon copying on its CUDA streams. on_layer as GetInto, but with
  // record_events it runs once the layer's copies are queued (the worker waits on the
  // region's events). Same result tuple as GetInto.
  pybind11::tuple GetIntoDevice(uint64_t namespace_id, const pybind11::list& keys,
                                uint64_t region_id, uint64_t token, uint64_t offset,
                                const pybind11::object& layers, int order,
                                const pybind11::object& on_layer, uint64_t lease_id,
                                PyCanceller* canceller, bool record_events);
  // Returns a list with, per key, bytes (the chunk or its layer range) or None (absent).
  pybind11::list Get(uint64_t namespace_id, const pybind11::list& keys,
                     const pybind11::object& layers, int order, uint64_t lease_id,
                     PyCanceller* canceller);
  // Returns (pinned, not_found).
  pybind11::tuple Pin(uint64_t namespace_id, const pybind11::list& keys, uint32_t ttl_seconds);
  uint32_t Unpin(uint64_t namespace_id, const pybind11::list& keys);
  uint32_t Delete(uint64_t namespace_id, const pybind11::list& keys);
  uint64_t Clear(uint64_t namespace_id);
  // The serialized kvtier.v1.StatsResponse (parsed by kvtier/v1/kvtier_pb2.py).
  pybind11::bytes Stats();
  // `requests`: a list of (namespace_id, list of keys). The serialized
  // kvtier.v1.HintResponse.
  pybind11::bytes Hint(const std::string& client_id, const pybind11::list& requests);

  const std::string& target() const { return client_->target(); }
  KvTierClient& client() { return *client_; }

 private:
  // True when refs are equal-sized and back to back: one span of memory.
  static bool IsOneSpan(const std::vector<BufferRef>& refs);
  // GetInto of one span through KvTierClient::GetInto (same result tuple).
  pybind11::tuple GetIntoSpan(uint64_t namespace_id, const std::vector<ChunkKey>& keys,
                              absl::Span<char> out, std::optional<LayerRange> range,
                              v1::GetOrder order, const pybind11::object& on_layer,
                              uint64_t lease_id, PyCanceller* canceller);

  // The per-item callback of KvTierClient::GetInto/GetIntoDevice for on_layer: checks
  // the canceller, and calls on_layer(l) once a layer's pass is over (a new layer, or
  // the end, via ClosePasses).
  class PassCloser;
  // The (found, tiers, token_counts, bytes) tuple of a GetIntoResult.
  static pybind11::tuple ResultTuple(const GetIntoResult& v, uint64_t key_bytes);

  std::unique_ptr<KvTierClient> client_;
};

// Converts a Python list of 16-byte `bytes` keys. Raises InvalidArgument naming the
// bad index.
std::vector<ChunkKey> KeysFromList(const pybind11::list& keys);

}  // namespace kvtier::python

#endif  // KVTIER_CLIENT_PYTHON_NATIVE_PY_CLIENT_H_
