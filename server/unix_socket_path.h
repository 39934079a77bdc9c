// ClaimSocketPath: makes a Unix-domain socket path free to bind, for listen_unix and a
// path shm_socket. A socket file left by a daemon that was killed is removed; one that
// a running process still answers on is not (a second daemon must not take over, or
// remove, a live daemon's socket), nor is anything that is not a socket.
//
// Thread-safety: thread-safe (no state).
#ifndef KVTIER_SERVER_UNIX_SOCKET_PATH_H_
#define KVTIER_SERVER_UNIX_SOCKET_PATH_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvtier {

// `type`: the socket's (SOCK_STREAM, SOCK_SEQPACKET); `option`: named in errors.
// Returns: Ok (nothing there, or a stale socket removed), FailedPrecondition (not a
// socket, or a live one).
absl::Status ClaimSocketPath(const std::string& path, int type, absl::string_view option);

}  // namespace kvtier

#endif  // KVTIER_SERVER_UNIX_SOCKET_PATH_H_
