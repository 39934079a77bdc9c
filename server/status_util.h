// The one place where absl::Status becomes grpc::Status. The canonical codes have the
// same numbers in both; the message is kept as is.
#ifndef KVTIER_SERVER_STATUS_UTIL_H_
#define KVTIER_SERVER_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvtier {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace kvtier

#endif  // KVTIER_SERVER_STATUS_UTIL_H_
