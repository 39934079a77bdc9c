// ClaimSocketPath: makes a Unix-domain socket path free to bind, for listen_unix and a
// path shm_socket. A socket file left by a daemon that was killed (connect() is refused:
// nobody listens) is removed; any other socket is not: one a running process answers on
// (a second daemon must not take over, or remove, a live daemon's socket), one of another
// type (EPROTOTYPE: listening, but not as `type`) or one this user may not connect to
// (EACCES) are both live as far as anyone can tell. Nor is anything that is not a socket.
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
// socket, a live one, or one whose connect() fails other than ECONNREFUSED),
// InvalidArgument (too long), Unavailable (no socket to test it with).
absl::Status ClaimSocketPath(const std::string& path, int type, absl::string_view option);

}  // namespace kvtier

#endif  // KVTIER_SERVER_UNIX_SOCKET_PATH_H_
