// kvtier._native: the C++ client bound for Python. The public API is the pure-Python
// package around it (kvtier/__init__.py); this module's names are private.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "client/python/native/py_canceller.h"
#include "client/python/native/py_client.h"
#include "client/python/native/py_prefill.h"
#include "client/python/native/status_error.h"
#include "storage/crc32c.h"

namespace py = pybind11;
using kvtier::python::PyCanceller;
using kvtier::python::PyClient;
using kvtier::python::PyPrefillSession;
using kvtier::python::StatusError;
using kvtier::SharedBuffer;
using kvtier::python::ThrowIfError;

namespace {

// The session a kvtier._native.PrefillSession holds, or null while its constructor is
// still running (pybind11 builds the holder after it returns).
PyPrefillSession* ConstructedSession(PyObject* self) {
  py::detail::value_and_holder v_h =
      reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder();
  return v_h.holder_constructed() ? v_h.value_ptr<PyPrefillSession>() : nullptr;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvtier's native client (private; use the kvtier package)";

  // StatusError -> kvtier.errors.<Code>Error, built by kvtier.errors.from_status so the
  // mapping from codes to classes and advice lives in one place (Python).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object errors = py::module_::import("kvtier.errors");
      py::object exc = errors.attr("from_status")(static_cast<int>(e.code()), e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<PyCanceller>(m, "Canceller")
      .def(py::init<>())
      .def("cancel", &PyCanceller::Cancel)
      .def_property_readonly("cancelled", &PyCanceller::cancelled)
      // Tests only (a sync point): whether a call with this canceller is waiting now on
      // an RPC or region request that cancel() would end, so a test cancels it mid-wait.
      .def_property_readonly("watching",
                             [](PyCanceller& c) { return c.cancellation()->watching(); });

  // Memory shared with a same-host daemon: a writable buffer (memoryview, numpy.frombuffer,
  // torch.frombuffer) that puts and gets move through with one copy, the daemon's.
  py::class_<SharedBuffer, std::shared_ptr<SharedBuffer>>(m, "SharedBuffer", py::buffer_protocol())
      .def_buffer([](SharedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      })
      .def("__len__", &SharedBuffer::size)
      .def_property_readonly("region_id", &SharedBuffer::region_id);

  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, uint32_t, double, double, int, const std::string&,
                    const std::string&, const std::string&, const std::string&,
                    const std::string&, uint64_t, uint32_t>(),
           py::arg("target"), py::arg("max_frame_bytes"), py::arg("rpc_deadline_seconds"),
           py::arg("connect_timeout_seconds"), py::arg("receive_window_bytes"),
           py::arg("tls_ca_file") = "", py::arg("tls_cert_file") = "",
           py::arg("tls_key_file") = "", py::arg("tls_server_name") = "",
           py::arg("bearer_token") = "", py::arg("malloc_top_pad_bytes") = 16 << 20,
           py::arg("malloc_arena_max") = 0)
      .def_property_readonly("target", &PyClient::target)
      .def("shared_buffer",
           [](PyClient& c, uint64_t nbytes) {
             std::shared_ptr<SharedBuffer> b;
             absl::Status status;
             {
               py::gil_scoped_release release;
               auto r = c.client().AllocateShared(nbytes);
               if (r.ok()) b = *std::move(r);
               status = r.status();
             }
             ThrowIfError(status);
             // Freed from Python, the buffer unregisters its region (a round trip to
             // the daemon, up to 5 s while calls still use it): not with the GIL held,
             // or every Python thread waits on the daemon. The C++ client's own
             // references go without the GIL already.
             SharedBuffer* raw = b.get();
             return std::shared_ptr<SharedBuffer>(raw, [owned = std::move(b)](SharedBuffer*) mutable {
               if (PyGILState_Check()) {
                 py::gil_scoped_release release;
                 owned.reset();
               } else {
                 owned.reset();
               }
             });
           })
      .def_property_readonly("data_path", [](PyClient& c) {
        py::gil_scoped_release release;
        return c.client().data_path_detail();
      })
      .def("register_layout", &PyClient::RegisterLayout)
      .def("lookup", &PyClient::Lookup, py::arg("namespace_id"), py::arg("keys"),
           py::arg("lease_seconds"))
      .def("release_lease", &PyClient::ReleaseLease)
      .def("put", &PyClient::Put, py::arg("namespace_id"), py::arg("keys"), py::arg("buffers"),
           py::arg("token_counts"), py::arg("chain_start"), py::arg("prev_key"),
           py::arg("canceller"))
      .def("get_into", &PyClient::GetInto, py::arg("namespace_id"), py::arg("keys"),
           py::arg("outs"), py::arg("layers"), py::arg("order"), py::arg("on_layer"),
           py::arg("lease_id"), py::arg("canceller"))
      .def("register_device_memory", &PyClient::RegisterDeviceMemory, py::arg("ipc_handle"),
           py::arg("nbytes"), py::arg("event_handles"))
      .def("release_device_memory", &PyClient::ReleaseDeviceMemory, py::arg("region_id"))
      .def("put_from_device", &PyClient::PutFromDevice, py::arg("namespace_id"),
           py::arg("keys"), py::arg("region_id"), py::arg("token"), py::arg("region_bytes"),
           py::arg("offsets"), py::arg("crc32cs"), py::arg("token_counts"),
           py::arg("chain_start"), py::arg("prev_key"))
      .def("get_into_device", &PyClient::GetIntoDevice, py::arg("namespace_id"),
           py::arg("keys"), py::arg("region_id"), py::arg("token"), py::arg("offset"),
           py::arg("layers"), py::arg("order"), py::arg("on_layer"), py::arg("lease_id"),
           py::arg("canceller"), py::arg("record_events"))
      .def("get", &PyClient::Get, py::arg("namespace_id"), py::arg("keys"), py::arg("layers"),
           py::arg("order"), py::arg("lease_id"), py::arg("canceller"))
      .def("pin", &PyClient::Pin)
      .def("unpin", &PyClient::Unpin)
      .def("delete", &PyClient::Delete)
      .def("clear", &PyClient::Clear)
      .def("stats", &PyClient::Stats)
      .def("hint", &PyClient::Hint, py::arg("client_id"), py::arg("requests"));

  // Collectable: a session never closed whose callback holds it (a worker's method,
  // the worker holding the session) is a cycle through the native object, which the
  // collector sees only through these hooks. Before init_instance has built the holder
  // (the constructor is still running) there is nothing to visit.
  py::class_<PyPrefillSession>(m, "PrefillSession", py::custom_type_setup([](PyHeapTypeObject* heap) {
    PyTypeObject* type = &heap->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
      Py_VISIT(Py_TYPE(self));  // A heap type's instances own a reference to it.
      const PyPrefillSession* s = ConstructedSession(self);
      return s == nullptr ? 0 : s->Traverse(visit, arg);
    };
    type->tp_clear = [](PyObject* self) {
      if (PyPrefillSession* s = ConstructedSession(self)) s->ClearCallbacks();
      return 0;
    };
    // Untracked before anything is destroyed: pybind11 2.10.3's dealloc does not do it
    // (fixed upstream in 2.10.4), and the destructor releases the GIL while it joins
    // the reader thread, so a collection on another thread would find the dying object
    // still tracked, with no references: it would clear and free it a second time.
    type->tp_dealloc = [](PyObject* self) {
      PyObject_GC_UnTrack(self);
      py::detail::pybind11_object_dealloc(self);
    };
  }))
      .def(py::init<PyClient&, uint64_t, const py::list&, const py::object&, const py::object&,
                    const py::object&, uint64_t, uint32_t, double, bool, const py::object&,
                    const py::object&>(),
           py::arg("client"), py::arg("namespace_id"), py::arg("keys"), py::arg("dest"),
           py::arg("on_chunk"), py::arg("compute_estimate"), py::arg("max_bytes_per_second"),
           py::arg("max_frame_bytes"), py::arg("rpc_deadline_seconds"),
           py::arg("use_forecast"), py::arg("device_dest") = py::none(),
           py::arg("on_in_place") = py::none(), py::keep_alive<1, 2>())
      .def("plan", &PyPrefillSession::plan)
      .def_property_readonly("num_keys", &PyPrefillSession::num_keys)
      .def_property_readonly("stream_reached", &PyPrefillSession::stream_reached)
      .def("should_compute", &PyPrefillSession::ShouldCompute)
      .def("report_computed", &PyPrefillSession::ReportComputed)
      .def("finish", &PyPrefillSession::Finish)
      .def("close", &PyPrefillSession::Close)
      .def_property_readonly("calling_back", &PyPrefillSession::CallingBack);

  // CRC32C of a buffer (hardware-accelerated where the CPU has it); for tests and for
  // workers that check what they load.
  m.def("crc32c", [](py::buffer b, uint32_t crc) {
    kvtier::python::BufferRef ref = kvtier::python::BufferRef::Acquire(b, false);
    py::gil_scoped_release nogil;
    return kvtier::crc32c::Extend(crc, ref.data(), ref.size());
  }, py::arg("data"), py::arg("crc") = 0);
}
