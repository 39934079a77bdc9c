// How the native module reports errors to Python: every failed absl::Status becomes a
// StatusError, which module.cc translates into the matching kvtier.errors exception
// (kvtier/errors.py: one class per gRPC code, carrying the code and what to do).
#ifndef KVTIER_CLIENT_PYTHON_NATIVE_STATUS_ERROR_H_
#define KVTIER_CLIENT_PYTHON_NATIVE_STATUS_ERROR_H_

#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier::python {

class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const absl::Status& status)
      : std::runtime_error(std::string(status.message())), code_(status.code()) {}
  absl::StatusCode code() const { return code_; }

 private:
  absl::StatusCode code_;
};

// Throws StatusError unless `status` is Ok.
inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> v) {
  if (!v.ok()) throw StatusError(v.status());
  return *std::move(v);
}

}  // namespace kvtier::python

#endif  // KVTIER_CLIENT_PYTHON_NATIVE_STATUS_ERROR_H_
