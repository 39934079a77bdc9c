#include "client/python/native/py_prefill.h"

#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/python/native/status_error.h"

namespace py = pybind11;

namespace kvtier::python {
namespace {

// The session whose callback this thread is running (the session's reader thread, while
// on_chunk or on_in_place runs), or null.
thread_local const PyPrefillSession* calling_back = nullptr;

}  // namespace

PyPrefillSession::PyPrefillSession(PyClient& client, uint64_t namespace_id,
                                   const py::list& keys, const py::object& dest,
                                   const py::object& on_chunk,
                                   const py::object& compute_estimate,
                                   uint64_t max_bytes_per_second, uint32_t max_frame_bytes,
                                   double rpc_deadline_seconds, bool use_forecast,
                                   const py::object& device_dest,
                                   const py::object& on_in_place)
    : on_chunk_(py::none()), on_in_place_(py::none()), client_(&client) {
  std::vector<ChunkKey> k = KeysFromList(keys);
  if (int(!dest.is_none()) + int(!on_chunk.is_none()) + int(!device_dest.is_none()) > 1) {
    throw StatusError(
        absl::InvalidArgumentError("pass one of dest, on_chunk and device_dest"));
  }
  if (!on_in_place.is_none() && device_dest.is_none()) {
    throw StatusError(absl::InvalidArgumentError("on_in_place: only with device_dest"));
  }
  if (!dest.is_none()) {
    dest_ = BufferRef::Acquire(dest, /*writable=*/true);
    has_dest_ = true;
  }
  on_chunk_ = on_chunk;
  PrefillOptions options;
  if (has_dest_) {
    // The session writes chunks into dest itself; when dest is client.shared_buffer()
    // memory, the daemon does, with no stream (PrefillOptions::into).
    options.into = absl::Span<char>(dest_.data(), dest_.size());
  } else if (!on_chunk_.is_none()) {
    options.on_chunk = [this](uint32_t index, std::string data, v1::Tier tier) {
      OnChunk(index, std::move(data), tier);
    };
  } else if (!device_dest.is_none()) {
    auto [region_id, token, region_bytes, offset] =
        device_dest.cast<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t>>();
    options.into_device = PrefillOptions::DeviceInto{{region_id, token, region_bytes}, offset};
    on_in_place_ = on_in_place;
    if (!on_in_place_.is_none()) {
      options.on_chunk_in_place = [this](uint32_t index, v1::Tier tier) {
        OnInPlace(index, tier);
      };
    }
  }
  // A callback that raised ends the session (no chunk is handed over after it).
  options.callback_status = [this] {
    absl::MutexLock lock(&mu_);
    return chunk_error_;
  };
  if (!compute_estimate.is_none()) {
    auto ab = compute_estimate.cast<std::pair<double, double>>();
    options.compute_estimate = ComputeEstimate{ab.first, ab.second};
  }
  options.max_bytes_per_second = max_bytes_per_second;
  options.max_frame_bytes = max_frame_bytes;
  if (rpc_deadline_seconds > 0) options.rpc_deadline = absl::Seconds(rpc_deadline_seconds);
  options.use_forecast = use_forecast;
  absl::StatusOr<std::unique_ptr<PrefillSession>> s;
  {
    py::gil_scoped_release nogil;
    s = PrefillSession::Start(client.client(), namespace_id, std::move(k), std::move(options));
  }
  session_ = ValueOrThrow(std::move(s));
}

PyPrefillSession::~PyPrefillSession() {
  // Joins the reader thread, which may need the GIL for on_chunk: let it have it.
  if (session_ != nullptr) {
    py::gil_scoped_release nogil;
    session_.reset();
  }
}

template <typename Call>
void PyPrefillSession::CallPython(const char* what, uint32_t index, Call call) {
  py::gil_scoped_acquire gil;
  // The callback may drop the last reference to this session (del worker.session). The
  // session must then not be destroyed on this thread, which its destructor joins: hold
  // a reference across the call, and if it is the last one afterwards, hand it to
  // another thread. Null while the constructor runs (not registered yet; its caller holds
  // the object).
  py::object self = py::reinterpret_borrow<py::object>(py::detail::get_object_handle(
      this, py::detail::get_type_info(typeid(PyPrefillSession))));
  calling_back = this;
  try {
    call();
  } catch (py::error_already_set& e) {
    absl::MutexLock lock(&mu_);
    if (chunk_error_.ok()) {
      chunk_error_ = absl::InternalError(
          absl::StrCat(what, " raised for chunk ", index, ": ", e.what()));
    }
  }
  calling_back = nullptr;
  if (self && Py_REFCNT(self.ptr()) == 1) {
    // Another thread drops it (kvtier/prefill.py, _release_elsewhere): its destructor
    // cancels the call and joins this thread once this callback has returned. If no
    // thread can be started (interpreter shutdown), the session is leaked, never
    // destroyed here.
    py::list holder;
    holder.append(self);
    self = py::object();  // The list's reference is now the only one.
    try {
      py::module_::import("kvtier.prefill").attr("_release_elsewhere")(holder);
    } catch (py::error_already_set&) {
      holder.release();  // Leaked, with the session in it.
    }
  }
}

bool PyPrefillSession::CallingBack() const { return calling_back == this; }

void PyPrefillSession::CheckNotCallingBack(const char* method) const {
  if (CallingBack()) {
    throw StatusError(absl::FailedPreconditionError(absl::StrCat(
        method, "() called from inside the session's own on_chunk or on_in_place: it "
                "waits for the thread that runs them; call it from the worker's thread")));
  }
}

void PyPrefillSession::OnChunk(uint32_t index, std::string data, v1::Tier tier) {
  CallPython("on_chunk", index,
             [&] { on_chunk_(index, py::bytes(data), static_cast<int>(tier)); });
}

void PyPrefillSession::OnInPlace(uint32_t index, v1::Tier tier) {
  CallPython("on_in_place", index, [&] { on_in_place_(index, static_cast<int>(tier)); });
}

py::bytes PyPrefillSession::plan() const {
  return py::bytes(session_->plan().SerializeAsString());
}

void PyPrefillSession::ReportComputed(uint32_t i) {
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = session_->ReportComputed(i);
  }
  ThrowIfError(s);
}

py::dict PyPrefillSession::Finish() {
  CheckNotCallingBack("finish");
  absl::StatusOr<PrefillResult> r;
  {
    py::gil_scoped_release nogil;
    r = session_->Finish();
  }
  {
    absl::MutexLock lock(&mu_);
    ThrowIfError(chunk_error_);
  }
  PrefillResult v = ValueOrThrow(std::move(r));
  py::dict d;
  d["first_streamed"] = v.first_streamed;
  d["cached_prefix"] = v.cached_prefix;
  d["reason"] = static_cast<int>(v.reason);
  d["detail"] = v.detail;
  py::list sources;
  for (ChunkSource c : v.sources) sources.append(c == ChunkSource::kStreamed ? "streamed" : "computed");
  d["sources"] = sources;
  d["chunks_streamed"] = v.chunks_streamed;
  d["bytes_streamed"] = v.bytes_streamed;
  d["bytes_discarded"] = v.bytes_discarded;
  d["computed_reported"] = v.computed_reported;
  d["compute_begin"] = v.compute_begin;
  d["compute_end"] = v.compute_end;
  d["raced"] = v.raced;
  d["elapsed_seconds"] = absl::ToDoubleSeconds(v.elapsed);
  d["daemon_elapsed_seconds"] = v.daemon_elapsed_seconds;
  d["path"] = v.path == DataPath::kSharedMemory ? "shared_memory" : "stream";
  return d;
}

int PyPrefillSession::Traverse(visitproc visit, void* arg) const {
  Py_VISIT(on_chunk_.ptr());
  Py_VISIT(on_in_place_.ptr());
  return 0;
}

void PyPrefillSession::ClearCallbacks() {
  on_chunk_ = py::none();
  on_in_place_ = py::none();
}

void PyPrefillSession::Close() {
  CheckNotCallingBack("close");
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = session_->Close();
  }
  // The reader thread is joined: nothing calls back or writes into dest any more. Let
  // go of them now (with the GIL), not when the session object is collected: a
  // callback that holds the session (on_chunk=self.method, self.session = s) is a cycle
  // the GC cannot see through this object, and dest stayed exported (a bytearray
  // could not be resized after `with client.prefill(dest=...)`).
  ClearCallbacks();
  dest_ = BufferRef();
  ThrowIfError(s);
}

}  // namespace kvtier::python
