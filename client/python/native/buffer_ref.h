// BufferRef: a Python object's memory seen through the buffer protocol, held (and so
// kept alive and unresizable: a bytearray with an export cannot grow or shrink) until
// the BufferRef is destroyed. Only C-contiguous buffers are accepted, so the bytes are
// one flat range: a strided numpy view or a transposed array raises BufferError at
// Acquire instead of being read or filled out of order.
//
// Threading: Acquire and the destructor need the GIL (they call into Python); data()
// and size() do not, so a call may release the GIL and copy while holding BufferRefs.
#ifndef KVTIER_CLIENT_PYTHON_NATIVE_BUFFER_REF_H_
#define KVTIER_CLIENT_PYTHON_NATIVE_BUFFER_REF_H_

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

namespace kvtier::python {

class BufferRef {
 public:
  // Raises (throws pybind11::error_already_set) if `obj` does not export a
  // C-contiguous buffer, or a writable one when `writable`.
  static BufferRef Acquire(pybind11::handle obj, bool writable) {
    BufferRef ref;
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &ref.view_, flags) != 0) {
      throw pybind11::error_already_set();
    }
    ref.held_ = true;
    return ref;
  }

  BufferRef() = default;
  BufferRef(BufferRef&& other) noexcept : view_(other.view_), held_(other.held_) {
    other.held_ = false;
  }
  BufferRef& operator=(BufferRef&& other) noexcept {
    if (this != &other) {
      Release();
      view_ = other.view_;
      held_ = other.held_;
      other.held_ = false;
    }
    return *this;
  }
  BufferRef(const BufferRef&) = delete;
  BufferRef& operator=(const BufferRef&) = delete;
  ~BufferRef() { Release(); }

  char* data() const { return static_cast<char*>(view_.buf); }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  void Release() {
    if (held_) {
      PyBuffer_Release(&view_);
      held_ = false;
    }
  }
  Py_buffer view_{};
  bool held_ = false;
};

}  // namespace kvtier::python

#endif  // KVTIER_CLIENT_PYTHON_NATIVE_BUFFER_REF_H_
