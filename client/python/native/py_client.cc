#include "client/python/native/py_client.h"

#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/python/native/buffer_ref.h"
#include "client/python/native/status_error.h"

namespace py = pybind11;

namespace kvtier::python {
namespace {

absl::Duration Seconds(double s) {
  return s <= 0 ? absl::ZeroDuration() : absl::Seconds(s);
}

std::optional<LayerRange> LayersFromObject(const py::object& layers) {
  if (layers.is_none()) return std::nullopt;
  auto t = layers.cast<std::pair<uint32_t, uint32_t>>();
  return LayerRange{t.first, t.second};
}

std::vector<BufferRef> AcquireAll(const py::list& buffers, bool writable) {
  std::vector<BufferRef> refs;
  refs.reserve(buffers.size());
  for (py::handle b : buffers) refs.push_back(BufferRef::Acquire(b, writable));
  return refs;
}

// The part of a Get frame handler that both GetInto and Get share: checks each found
// key's size against its destination and copies the frame's pieces into it.
//
// Layer-major order: a key's destination holds its layers in order, so the piece of
// layer l lands at (l - first_layer) * piece_bytes; the destination must be a whole
// number of pieces, and at the end every found key must have filled it. `on_pass(l)` is
// called when the pass of layer l is complete (the checker in the C++ client lets a new
// pass start only after every found key's piece of the previous one); Finish() calls it
// for the last pass.
class FrameSink {
 public:
  // `dest(i, total)` returns where key i's bytes go (chunk-major: `total` of them), or
  // an error. `dest_size(i)` is the size of key i's destination (layer-major).
  using DestFn = std::function<absl::StatusOr<char*>(uint32_t index, uint64_t total)>;
  using PassFn = std::function<absl::Status(uint32_t layer)>;

  FrameSink(size_t n, DestFn dest, PyCanceller* canceller)
      : found_(n, false), started_(n, false), tiers_(n, 0), token_counts_(n, 0),
        dest_(std::move(dest)), canceller_(canceller) {}

  // Switches to layer-major order; `sizes[i]` is key i's destination size.
  void SetLayerMajor(uint32_t first_layer, std::vector<uint64_t> sizes, PassFn on_pass) {
    layer_major_ = true;
    first_layer_ = first_layer;
    sizes_ = std::move(sizes);
    filled_.assign(sizes_.size(), 0);
    on_pass_ = std::move(on_pass);
  }

  absl::Status OnFrame(uint32_t index, const GetFrameHeader& h,
                       absl::Span<const absl::string_view> pieces) {
    if (canceller_ != nullptr) {
      if (absl::Status s = canceller_->Check(); !s.ok()) return s;
    }
    if (layer_major_ && h.layer() != pass_.value_or(h.layer())) {
      if (on_pass_) {
        if (absl::Status s = on_pass_(*pass_); !s.ok()) return s;
      }
    }
    if (layer_major_) pass_ = h.layer();
    if (!started_[index]) {  // First frame of this key.
      started_[index] = true;
      if (h.found()) {
        found_[index] = true;
        tiers_[index] = h.tier();
        token_counts_[index] = h.token_count();
        auto d = dest_(index, h.total_bytes());
        if (!d.ok()) return d.status();
        bases_.resize(found_.size(), nullptr);
        bases_[index] = *d;
      }
    }
    if (!h.found()) return absl::OkStatus();
    char* base = bases_[index];
    if (layer_major_) {
      // The checker has made sure the piece size is the same for every piece, and the
      // offsets and sizes add up within it.
      const uint64_t piece = h.offset() == 0 ? h.total_bytes() : piece_bytes_;
      piece_bytes_ = piece;
      const uint64_t at = uint64_t{h.layer() - first_layer_} * piece;
      if (h.layer() < first_layer_ || piece == 0 || sizes_[index] % piece != 0 ||
          at + piece > sizes_[index]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "out[", index, "] holds ", sizes_[index], " bytes but the daemon sends layer ",
            h.layer(), " as ", piece, "-byte pieces from layer ", first_layer_,
            "; pass buffers of the chunk's (or the layer range's) size"));
      }
      base += at;
    }
    uint64_t off = h.offset();
    for (absl::string_view piece : pieces) {
      std::memcpy(base + off, piece.data(), piece.size());
      off += piece.size();
      bytes_ += piece.size();
      if (layer_major_) filled_[index] += piece.size();
    }
    return absl::OkStatus();
  }

  // Call after the stream ended Ok. Layer-major: checks that every found key's
  // destination was filled and reports the last pass.
  absl::Status Finish() {
    if (!layer_major_) return absl::OkStatus();
    for (size_t i = 0; i < found_.size(); ++i) {
      if (found_[i] && filled_[i] != sizes_[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "out[", i, "] holds ", sizes_[i], " bytes but the daemon sent ", filled_[i],
            " for key ", i, " (the chunk, or its layer range); pass buffers of that size"));
      }
    }
    if (pass_.has_value() && on_pass_) return on_pass_(*pass_);
    return absl::OkStatus();
  }

  py::tuple Result() const {
    py::list found, tiers, tokens;
    for (size_t i = 0; i < found_.size(); ++i) {
      found.append(py::bool_(found_[i]));
      tiers.append(tiers_[i]);
      tokens.append(token_counts_[i]);
    }
    return py::make_tuple(found, tiers, tokens, bytes_);
  }
  const std::vector<bool>& found() const { return found_; }

 private:
  std::vector<bool> found_;
  std::vector<bool> started_;
  std::vector<int> tiers_;
  std::vector<uint32_t> token_counts_;
  std::vector<char*> bases_;
  DestFn dest_;
  PyCanceller* canceller_;
  uint64_t bytes_ = 0;
  // Layer-major.
  bool layer_major_ = false;
  uint32_t first_layer_ = 0;
  std::vector<uint64_t> sizes_;
  std::vector<uint64_t> filled_;
  uint64_t piece_bytes_ = 0;
  std::optional<uint32_t> pass_;
  PassFn on_pass_;
};

// Calls on_layer(layer) with the GIL. If it raises, keeps the exception in `error` (to
// re-raise once the transfer is torn down) and returns Cancelled to stop the transfer.
absl::Status CallOnLayer(const py::object& on_layer, uint32_t layer,
                         std::optional<py::error_already_set>* error) {
  py::gil_scoped_acquire gil;
  try {
    on_layer(layer);
  } catch (py::error_already_set& e) {
    error->emplace(std::move(e));
    return absl::CancelledError(absl::StrCat("on_layer(", layer, ") raised"));
  }
  return absl::OkStatus();
}

v1::GetOrder OrderFromInt(int order) {
  switch (order) {
    case 0:
      return v1::GET_ORDER_CHUNK_MAJOR;
    case 1:
      return v1::GET_ORDER_LAYER_MAJOR;
    default:
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat("order: ", order, " is not 0 (chunk-major) or 1 (layer-major)")));
  }
}

}  // namespace

std::vector<ChunkKey> KeysFromList(const py::list& keys) {
  std::vector<ChunkKey> out;
  out.reserve(keys.size());
  size_t i = 0;
  for (py::handle k : keys) {
    if (!py::isinstance<py::bytes>(k)) {
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat("keys[", i, "]: expected bytes (a 16-byte chunk key), got ",
                       std::string(py::str(py::type::of(k).attr("__name__"))))));
    }
    auto key = ChunkKey::FromBytes(k.cast<std::string>());
    if (!key.ok()) {
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat("keys[", i, "]: ", key.status().message())));
    }
    out.push_back(*key);
    ++i;
  }
  return out;
}

PyClient::PyClient(const std::string& target, uint32_t max_frame_bytes,
                   double rpc_deadline_seconds, double connect_timeout_seconds,
                   int receive_window_bytes, const std::string& tls_ca_file,
                   const std::string& tls_cert_file, const std::string& tls_key_file,
                   const std::string& tls_server_name, const std::string& bearer_token,
                   uint64_t malloc_top_pad_bytes, uint32_t malloc_arena_max) {
  ClientOptions options;
  options.malloc_top_pad_bytes = malloc_top_pad_bytes;
  options.malloc_arena_max = malloc_arena_max;
  options.tls_ca_file = tls_ca_file;
  options.tls_cert_file = tls_cert_file;
  options.tls_key_file = tls_key_file;
  options.tls_server_name = tls_server_name;
  options.bearer_token = bearer_token;
  options.max_frame_bytes = max_frame_bytes;
  options.rpc_deadline =
      rpc_deadline_seconds <= 0 ? absl::InfiniteDuration() : absl::Seconds(rpc_deadline_seconds);
  options.connect_timeout = Seconds(connect_timeout_seconds);
  options.receive_window_bytes = receive_window_bytes;
  absl::StatusOr<std::unique_ptr<KvTierClient>> c;
  {
    py::gil_scoped_release nogil;
    c = KvTierClient::Connect(target, options);
  }
  client_ = ValueOrThrow(std::move(c));
}

PyClient::~PyClient() {
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    client_.reset();
  } else {
    client_.reset();
  }
}

py::tuple PyClient::RegisterLayout(const std::string& model_id,
                                   const std::string& model_revision, uint32_t dtype,
                                   uint32_t num_layers, uint32_t num_kv_heads,
                                   uint32_t head_dim, uint32_t tokens_per_chunk,
                                   uint32_t tp_world_size, uint32_t tp_rank,
                                   uint32_t key_position) {
  LayoutSpec l;
  l.model_id = model_id;
  l.model_revision = model_revision;
  l.dtype = static_cast<LayoutSpec::DType>(dtype);
  l.num_layers = num_layers;
  l.num_kv_heads = num_kv_heads;
  l.head_dim = head_dim;
  l.tokens_per_chunk = tokens_per_chunk;
  l.tp_world_size = tp_world_size;
  l.tp_rank = tp_rank;
  l.key_position = static_cast<LayoutSpec::KeyPosition>(key_position);
  absl::StatusOr<RegisterResult> r;
  {
    py::gil_scoped_release nogil;
    r = client_->RegisterLayout(l);
  }
  RegisterResult v = ValueOrThrow(std::move(r));
  return py::make_tuple(v.namespace_id, v.chunk_bytes, v.already_registered);
}

py::tuple PyClient::Lookup(uint64_t namespace_id, const py::list& keys,
                           uint32_t lease_seconds) {
  std::vector<ChunkKey> k = KeysFromList(keys);
  absl::StatusOr<LookupResult> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Lookup(namespace_id, k, lease_seconds);
  }
  LookupResult v = ValueOrThrow(std::move(r));
  py::list tiers;
  for (v1::Tier t : v.tiers) tiers.append(static_cast<int>(t));
  return py::make_tuple(tiers, v.prefix_hits, v.lease_id);
}

bool PyClient::ReleaseLease(uint64_t namespace_id, uint64_t lease_id) {
  absl::StatusOr<bool> r;
  {
    py::gil_scoped_release nogil;
    r = client_->ReleaseLease(namespace_id, lease_id);
  }
  return ValueOrThrow(std::move(r));
}

namespace {

// token_counts (None: zeros), one per key.
std::vector<uint32_t> TokenCounts(const py::object& token_counts, size_t keys) {
  std::vector<uint32_t> tokens(keys, 0);
  if (!token_counts.is_none()) tokens = token_counts.cast<std::vector<uint32_t>>();
  if (tokens.size() != keys) {
    throw StatusError(absl::InvalidArgumentError("token_counts: one per key"));
  }
  return tokens;
}

// Sets each chunk's place in its request's chain (ChunkToPut or DeviceChunkToPut):
// chunks[i] is chunk chain_start + i, its parent keys[i - 1] (prev_key for the first).
template <typename Chunk>
void SetChain(std::vector<Chunk>& chunks, const std::vector<ChunkKey>& k,
              const py::object& chain_start, const py::object& prev_key) {
  if (!chain_start.is_none()) {
    const uint32_t start = chain_start.cast<uint32_t>();
    for (size_t i = 0; i < k.size(); ++i) {
      chunks[i].chunk_index = start + static_cast<uint32_t>(i);
      if (i > 0) chunks[i].prev_key = k[i - 1];
    }
    if (!prev_key.is_none()) {
      if (start == 0) {
        throw StatusError(absl::InvalidArgumentError(
            "prev_key: chunk 0 of a chain has no previous key"));
      }
      auto parent = ChunkKey::FromBytes(prev_key.cast<std::string>());
      if (!parent.ok()) {
        throw StatusError(absl::InvalidArgumentError(
            absl::StrCat("prev_key: ", parent.status().message())));
      }
      if (!chunks.empty()) chunks[0].prev_key = *parent;
    }
  } else if (!prev_key.is_none()) {
    throw StatusError(absl::InvalidArgumentError("prev_key: needs chain_start"));
  }
}

}  // namespace

py::tuple PyClient::Put(uint64_t namespace_id, const py::list& keys, const py::list& buffers,
                        const py::object& token_counts, const py::object& chain_start,
                        const py::object& prev_key, PyCanceller* canceller) {
  CallCancellation::Scope cancel_scope(ScopeOf(canceller));
  std::vector<ChunkKey> k = KeysFromList(keys);
  if (buffers.size() != k.size()) {
    throw StatusError(absl::InvalidArgumentError(absl::StrCat(
        "buffers: ", buffers.size(), " buffers for ", k.size(), " keys; pass one per key")));
  }
  const std::vector<uint32_t> tokens = TokenCounts(token_counts, k.size());
  std::vector<BufferRef> refs = AcquireAll(buffers, /*writable=*/false);
  std::vector<ChunkToPut> chunks(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    chunks[i].key = k[i];
    chunks[i].data = absl::string_view(refs[i].data(), refs[i].size());
    chunks[i].token_count = tokens[i];
  }
  SetChain(chunks, k, chain_start, prev_key);
  absl::StatusOr<PutResult> r;
  {
    py::gil_scoped_release nogil;
    if (canceller != nullptr && canceller->cancelled()) {
      r = canceller->Check();
    } else {
      r = client_->Put(namespace_id, chunks);
    }
  }
  PutResult v = ValueOrThrow(std::move(r));
  return py::make_tuple(v.stored, v.already_present, v.bytes);
}

py::tuple PyClient::GetInto(uint64_t namespace_id, const py::list& keys, const py::list& outs,
                            const py::object& layers, int order, const py::object& on_layer,
                            uint64_t lease_id, PyCanceller* canceller) {
  CallCancellation::Scope cancel_scope(ScopeOf(canceller));
  std::vector<ChunkKey> k = KeysFromList(keys);
  if (outs.size() != k.size()) {
    throw StatusError(absl::InvalidArgumentError(absl::StrCat(
        "out: ", outs.size(), " buffers for ", k.size(), " keys; pass one per key")));
  }
  const v1::GetOrder get_order = OrderFromInt(order);
  const bool layer_major = get_order == v1::GET_ORDER_LAYER_MAJOR;
  if (!on_layer.is_none() && !layer_major) {
    throw StatusError(absl::InvalidArgumentError("on_layer: only with layer-major order"));
  }
  std::optional<LayerRange> range = LayersFromObject(layers);
  std::vector<BufferRef> refs = AcquireAll(outs, /*writable=*/true);
  bool in_shared_memory = false;
  if (IsOneSpan(refs)) {
    // Without the GIL: the look-up may hold the last reference to a buffer another
    // thread just let go of, and destroying it unregisters it, a round trip to the
    // daemon (SharedMemoryPlane::Find).
    py::gil_scoped_release nogil;
    in_shared_memory = client_->InSharedMemory(refs[0].data(), refs.size() * refs[0].size());
  }
  if (in_shared_memory) {
    // One span of a shared_buffer() (usually: one buffer split per key): the daemon
    // writes the bytes there directly.
    return GetIntoSpan(namespace_id, k,
                       absl::Span<char>(refs[0].data(), refs.size() * refs[0].size()), range,
                       get_order, on_layer, lease_id, canceller);
  }
  FrameSink sink(
      k.size(),
      [&refs, layer_major](uint32_t i, uint64_t total) -> absl::StatusOr<char*> {
        if (!layer_major && total != refs[i].size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "out[", i, "] holds ", refs[i].size(), " bytes but the daemon sends ", total,
              " for key ", i, " (the chunk, or its layer range); pass buffers of that size"));
        }
        return refs[i].data();
      },
      canceller);
  // An exception raised by on_layer, re-raised once the stream is torn down.
  std::optional<py::error_already_set> callback_error;
  if (layer_major) {
    std::vector<uint64_t> sizes;
    sizes.reserve(refs.size());
    for (const BufferRef& r : refs) sizes.push_back(r.size());
    FrameSink::PassFn on_pass;
    if (!on_layer.is_none()) {
      on_pass = [&on_layer, &callback_error](uint32_t layer) {
        return CallOnLayer(on_layer, layer, &callback_error);
      };
    }
    sink.SetLayerMajor(range.has_value() ? range->begin : 0, std::move(sizes),
                       std::move(on_pass));
  }
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = client_->GetStreamRaw(
        namespace_id, k, range,
        [&](uint32_t i, const GetFrameHeader& h, absl::Span<const absl::string_view> pieces) {
          return sink.OnFrame(i, h, pieces);
        },
        get_order, lease_id);
    if (s.ok()) s = sink.Finish();
  }
  if (callback_error.has_value()) throw std::move(*callback_error);
  ThrowIfError(s);
  return sink.Result();
}

bool PyClient::IsOneSpan(const std::vector<BufferRef>& refs) {
  if (refs.empty() || refs[0].size() == 0) return false;
  for (size_t i = 1; i < refs.size(); ++i) {
    if (refs[i].size() != refs[0].size() || refs[i].data() != refs[0].data() + i * refs[0].size()) {
      return false;
    }
  }
  return true;
}

// on_layer(l) once layer l of every found key is in: the daemon finishes a layer's pass
// before it starts the next, so a new layer in on_item closes the previous pass, and
// the end of the call closes the last.
class PyClient::PassCloser {
 public:
  PassCloser(const py::object& on_layer, bool layer_major, PyCanceller* canceller)
      : on_layer_(on_layer), layer_major_(layer_major), canceller_(canceller) {}

  // KvTierClient's on_item (runs without the GIL).
  absl::Status OnItem(uint32_t layer) {
    if (canceller_ != nullptr) {
      if (absl::Status s = canceller_->Check(); !s.ok()) return s;
    }
    if (layer_major_ && pass_.has_value() && *pass_ != layer) {
      if (absl::Status s = Close(*pass_); !s.ok()) return s;
    }
    pass_ = layer;
    return absl::OkStatus();
  }
  // After a successful call: closes the last pass.
  absl::Status Finish() {
    if (layer_major_ && pass_.has_value()) return Close(*pass_);
    return absl::OkStatus();
  }
  // Re-raises an exception on_layer raised.
  void Rethrow() {
    if (callback_error_.has_value()) throw std::move(*callback_error_);
  }

 private:
  absl::Status Close(uint32_t layer) {
    if (on_layer_.is_none()) return absl::OkStatus();
    return CallOnLayer(on_layer_, layer, &callback_error_);
  }

  const py::object& on_layer_;
  const bool layer_major_;
  PyCanceller* const canceller_;
  std::optional<uint32_t> pass_;
  std::optional<py::error_already_set> callback_error_;
};

py::tuple PyClient::ResultTuple(const GetIntoResult& v, uint64_t key_bytes) {
  py::list found, tiers, tokens;
  uint64_t bytes = 0;
  for (size_t i = 0; i < v.found.size(); ++i) {
    found.append(static_cast<bool>(v.found[i]));
    tiers.append(static_cast<int>(v.tiers[i]));
    tokens.append(v.token_counts[i]);
    if (v.found[i]) bytes += key_bytes;
  }
  return py::make_tuple(found, tiers, tokens, bytes);
}

py::tuple PyClient::GetIntoSpan(uint64_t namespace_id, const std::vector<ChunkKey>& keys,
                                absl::Span<char> out, std::optional<LayerRange> range,
                                v1::GetOrder order, const py::object& on_layer,
                                uint64_t lease_id, PyCanceller* canceller) {
  PassCloser passes(on_layer, order == v1::GET_ORDER_LAYER_MAJOR, canceller);
  absl::StatusOr<GetIntoResult> r;
  {
    py::gil_scoped_release nogil;
    r = client_->GetInto(namespace_id, keys, out, range, order, lease_id,
                         [&](uint32_t, uint32_t layer) { return passes.OnItem(layer); });
    if (r.ok()) {
      if (absl::Status s = passes.Finish(); !s.ok()) r = s;
    }
  }
  passes.Rethrow();
  GetIntoResult v = ValueOrThrow(std::move(r));
  return ResultTuple(v, keys.empty() ? 0 : out.size() / keys.size());
}

py::tuple PyClient::RegisterDeviceMemory(const py::bytes& ipc_handle, uint64_t nbytes,
                                         const std::vector<std::string>& event_handles) {
  const std::string handle = ipc_handle;
  absl::StatusOr<RegionChannel::Registration> r;
  {
    py::gil_scoped_release nogil;
    r = client_->RegisterDeviceMemory(handle, nbytes, event_handles);
  }
  RegionChannel::Registration reg = ValueOrThrow(std::move(r));
  return py::make_tuple(reg.region_id, reg.token, reg.bytes);
}

void PyClient::ReleaseDeviceMemory(uint64_t region_id) {
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = client_->ReleaseDeviceMemory(region_id);
  }
  ThrowIfError(s);
}

py::tuple PyClient::PutFromDevice(uint64_t namespace_id, const py::list& keys,
                                  uint64_t region_id, uint64_t token, uint64_t region_bytes,
                                  const std::vector<uint64_t>& offsets,
                                  const std::vector<uint32_t>& crc32cs,
                                  const py::object& token_counts, const py::object& chain_start,
                                  const py::object& prev_key) {
  std::vector<ChunkKey> k = KeysFromList(keys);
  if (offsets.size() != k.size() || crc32cs.size() != k.size()) {
    throw StatusError(absl::InvalidArgumentError(absl::StrCat(
        "offsets, crc32cs: ", offsets.size(), " and ", crc32cs.size(), " for ", k.size(),
        " keys; pass one of each per key")));
  }
  const std::vector<uint32_t> tokens = TokenCounts(token_counts, k.size());
  std::vector<DeviceChunkToPut> chunks(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    chunks[i].key = k[i];
    chunks[i].offset = offsets[i];
    chunks[i].crc32c = crc32cs[i];
    chunks[i].token_count = tokens[i];
  }
  SetChain(chunks, k, chain_start, prev_key);
  absl::StatusOr<PutResult> r;
  {
    py::gil_scoped_release nogil;
    r = client_->PutFromDevice(namespace_id, chunks, {region_id, token, region_bytes});
  }
  PutResult v = ValueOrThrow(std::move(r));
  return py::make_tuple(v.stored, v.already_present, v.bytes);
}

py::tuple PyClient::GetIntoDevice(uint64_t namespace_id, const py::list& keys,
                                  uint64_t region_id, uint64_t token, uint64_t offset,
                                  const py::object& layers, int order,
                                  const py::object& on_layer, uint64_t lease_id,
                                  PyCanceller* canceller, bool record_events) {
  CallCancellation::Scope cancel_scope(ScopeOf(canceller));
  std::vector<ChunkKey> k = KeysFromList(keys);
  const v1::GetOrder get_order = OrderFromInt(order);
  if (!on_layer.is_none() && get_order != v1::GET_ORDER_LAYER_MAJOR) {
    throw StatusError(absl::InvalidArgumentError("on_layer: only with layer-major order"));
  }
  const std::optional<LayerRange> range = LayersFromObject(layers);
  PassCloser passes(on_layer, get_order == v1::GET_ORDER_LAYER_MAJOR, canceller);
  absl::StatusOr<GetIntoResult> r;
  {
    py::gil_scoped_release nogil;
    r = client_->GetIntoDevice(namespace_id, k, {region_id, token, 0}, offset, range,
                               get_order, lease_id,
                               [&](uint32_t, uint32_t layer) { return passes.OnItem(layer); },
                               record_events);
    if (r.ok()) {
      if (absl::Status s = passes.Finish(); !s.ok()) r = s;
    }
  }
  passes.Rethrow();
  GetIntoResult v = ValueOrThrow(std::move(r));
  return ResultTuple(v, 0);
}

py::list PyClient::Get(uint64_t namespace_id, const py::list& keys, const py::object& layers,
                       int order, uint64_t lease_id, PyCanceller* canceller) {
  CallCancellation::Scope cancel_scope(ScopeOf(canceller));
  std::vector<ChunkKey> k = KeysFromList(keys);
  const v1::GetOrder get_order = OrderFromInt(order);
  std::optional<LayerRange> range = LayersFromObject(layers);
  if (get_order == v1::GET_ORDER_LAYER_MAJOR) {
    // A chunk's size is known only once all its layers are in, so the C++ client
    // assembles each chunk and it is copied once more into its bytes object. get_into
    // (into a buffer of known size) is the zero-copy path.
    absl::StatusOr<std::vector<GotChunk>> r;
    {
      py::gil_scoped_release nogil;
      if (canceller != nullptr && canceller->cancelled()) {
        r = canceller->Check();
      } else {
        r = client_->Get(namespace_id, k, range, nullptr, get_order, lease_id);
      }
    }
    std::vector<GotChunk> got = ValueOrThrow(std::move(r));
    py::list out;
    for (const GotChunk& c : got) {
      out.append(c.found ? py::object(py::bytes(c.data)) : py::object(py::none()));
    }
    return out;
  }
  // One bytes object per found key, allocated (with the GIL) when its first frame says
  // how large it is, then filled without the GIL.
  std::vector<py::object> results(k.size());
  FrameSink sink(
      k.size(),
      [&results](uint32_t i, uint64_t total) -> absl::StatusOr<char*> {
        py::gil_scoped_acquire gil;
        PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
        if (b == nullptr) {
          PyErr_Clear();
          return absl::ResourceExhaustedError(
              absl::StrCat("cannot allocate ", total, " bytes for key ", i));
        }
        results[i] = py::reinterpret_steal<py::object>(b);
        return PyBytes_AS_STRING(b);
      },
      canceller);
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = client_->GetStreamRaw(
        namespace_id, k, range,
        [&](uint32_t i, const GetFrameHeader& h, absl::Span<const absl::string_view> pieces) {
          return sink.OnFrame(i, h, pieces);
        },
        get_order, lease_id);
  }
  ThrowIfError(s);
  py::list out;
  for (size_t i = 0; i < k.size(); ++i) {
    out.append(sink.found()[i] ? results[i] : py::none());
  }
  return out;
}

py::tuple PyClient::Pin(uint64_t namespace_id, const py::list& keys, uint32_t ttl_seconds) {
  std::vector<ChunkKey> k = KeysFromList(keys);
  absl::StatusOr<PinResult> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Pin(namespace_id, k, ttl_seconds);
  }
  PinResult v = ValueOrThrow(std::move(r));
  return py::make_tuple(v.pinned, v.not_found);
}

uint32_t PyClient::Unpin(uint64_t namespace_id, const py::list& keys) {
  std::vector<ChunkKey> k = KeysFromList(keys);
  absl::StatusOr<uint32_t> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Unpin(namespace_id, k);
  }
  return ValueOrThrow(std::move(r));
}

uint32_t PyClient::Delete(uint64_t namespace_id, const py::list& keys) {
  std::vector<ChunkKey> k = KeysFromList(keys);
  absl::StatusOr<uint32_t> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Delete(namespace_id, k);
  }
  return ValueOrThrow(std::move(r));
}

uint64_t PyClient::Clear(uint64_t namespace_id) {
  absl::StatusOr<uint64_t> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Clear(namespace_id);
  }
  return ValueOrThrow(std::move(r));
}

py::bytes PyClient::Hint(const std::string& client_id, const py::list& requests) {
  std::vector<HintedRequest> rs;
  rs.reserve(requests.size());
  for (const py::handle item : requests) {
    auto pair = item.cast<py::tuple>();
    if (pair.size() != 2) {
      throw StatusError(absl::InvalidArgumentError(
          "requests: each entry is a (namespace_id, keys) pair"));
    }
    HintedRequest& r = rs.emplace_back();
    r.namespace_id = pair[0].cast<uint64_t>();
    r.keys = KeysFromList(pair[1].cast<py::list>());
  }
  absl::StatusOr<v1::HintResponse> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Hint(client_id, rs);
  }
  return py::bytes(ValueOrThrow(std::move(r)).SerializeAsString());
}

py::bytes PyClient::Stats() {
  absl::StatusOr<v1::StatsResponse> r;
  {
    py::gil_scoped_release nogil;
    r = client_->Stats();
  }
  return py::bytes(ValueOrThrow(std::move(r)).SerializeAsString());
}

}  // namespace kvtier::python
