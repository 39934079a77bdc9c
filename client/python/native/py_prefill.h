// PyPrefillSession: the C++ PrefillSession (client/prefill_session.h) for Python
// (kvtier._native.PrefillSession; kvtier/prefill.py wraps it). Same contract, same
// exactly-once guarantee: chunks reach the caller only complete and CRC32C-verified,
// each once, in decreasing index order.
//
// Where streamed chunks go, chosen at start:
//  - `dest`: a writable C-contiguous buffer of at least len(keys) * chunk_bytes bytes
//    (smaller: start raises InvalidArgument); chunk i lands at [i * chunk_bytes,
//    (i + 1) * chunk_bytes), written by the daemon when dest is client.shared_buffer()
//    memory (same host), else by the session's reader thread once the chunk's frames
//    are all in and its CRC32C checked, without the GIL (PrefillOptions::into).
//  - `on_chunk(index, data: bytes, tier: int)`: called on the reader thread with the GIL
//    taken. An exception it raises ends the session at once: the call is cancelled, no
//    callback runs again, and finish raises Internal naming it.
//  - `device_dest`: (region_id, token, region_bytes, offset) of GPU memory this process
//    registered (Client.register_device_memory): the daemon copies chunk i to offset +
//    i * chunk_bytes on its CUDA streams (PrefillOptions::into_device), and
//    `on_in_place(index, tier: int)`, if not None, is called (GIL taken) once a chunk's
//    bytes have landed. An exception it raises fails the session like on_chunk's.
//  - none: chunks are checked and dropped (benchmarks).
//
// Threading: as PrefillSession. Every method that may wait (start, report_computed,
// finish, close) releases the GIL, so on_chunk can run meanwhile; should_compute only
// takes the session's lock. A callback may call should_compute and report_computed;
// finish and close from a callback raise FailedPreconditionError (they wait for the
// thread running it). A callback may drop the last reference to its session: the
// session is then destroyed (cancelled, its thread joined) on a thread started for it
// (kvtier/prefill.py, _release_elsewhere), not on the thread it would join.
#ifndef KVTIER_CLIENT_PYTHON_NATIVE_PY_PREFILL_H_
#define KVTIER_CLIENT_PYTHON_NATIVE_PY_PREFILL_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "client/prefill_session.h"
#include "client/python/native/buffer_ref.h"
#include "client/python/native/py_client.h"

namespace kvtier::python {

class PyPrefillSession {
 public:
  // Opens the session and waits for the plan (GIL released). Raises kvtier errors as
  // PrefillSession::Start returns them.
  PyPrefillSession(PyClient& client, uint64_t namespace_id, const pybind11::list& keys,
                   const pybind11::object& dest, const pybind11::object& on_chunk,
                   const pybind11::object& compute_estimate, uint64_t max_bytes_per_second,
                   uint32_t max_frame_bytes, double rpc_deadline_seconds, bool use_forecast,
                   const pybind11::object& device_dest, const pybind11::object& on_in_place);
  ~PyPrefillSession();

  // The serialized kvtier.v1.PrefillPlan.
  pybind11::bytes plan() const;
  uint32_t num_keys() const { return session_->num_keys(); }
  uint32_t stream_reached() const { return session_->stream_reached(); }
  bool ShouldCompute(uint32_t i) const { return session_->ShouldCompute(i); }
  void ReportComputed(uint32_t i);
  // Returns a dict with PrefillResult's fields (see prefill_session.h).
  pybind11::dict Finish();
  void Close();

  // The garbage collector's view (tp_traverse, tp_clear; module.cc): the callbacks are
  // the references a cycle runs through (on_chunk=self.method, self.session = s).
  // Clearing drops them (a call still made gets None and fails the session, which is
  // being destroyed anyway); dest stays, as the reader thread may be writing into it.
  int Traverse(visitproc visit, void* arg) const;
  void ClearCallbacks();

  // Whether this thread is running one of this session's callbacks.
  bool CallingBack() const;

 private:
  void OnChunk(uint32_t index, std::string data, v1::Tier tier);
  void OnInPlace(uint32_t index, v1::Tier tier);
  // Runs `call` with the GIL; an exception it raises becomes chunk_error_ (the first).
  template <typename Call>
  void CallPython(const char* what, uint32_t index, Call call);
  // Throws FailedPrecondition when this thread is running one of this session's
  // callbacks: `method` would wait for that very thread.
  void CheckNotCallingBack(const char* method) const;

  // Declared before session_: the reader thread (owned by session_) uses them until
  // session_ is closed, which the destructor does first.
  BufferRef dest_;
  bool has_dest_ = false;
  pybind11::object on_chunk_;     // None when unused. Touched only with the GIL.
  pybind11::object on_in_place_;  // Likewise.
  absl::Mutex mu_;
  absl::Status chunk_error_ ABSL_GUARDED_BY(mu_);  // First failure of a delivery.

  PyClient* client_;  // Outlives the session (kvtier/prefill.py holds a reference).
  std::unique_ptr<PrefillSession> session_;
};

}  // namespace kvtier::python

#endif  // KVTIER_CLIENT_PYTHON_NATIVE_PY_PREFILL_H_
