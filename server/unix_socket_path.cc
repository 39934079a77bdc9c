#include "server/unix_socket_path.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status ClaimSocketPath(const std::string& path, int type, absl::string_view option) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();  // Nothing there.
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "option ", option, ": ", path, " exists and is not a socket; not replacing it"));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("option ", option, ": '", path, "' is too long for a Unix socket path"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("option ", option, ": socket: ", std::strerror(errno)));
  }
  const int err =
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 ? 0 : errno;
  close(fd);
  if (err == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "option ", option, ": ", path, " is in use: a running process (another kvtierd?) "
        "answers on it; stop it or choose another path"));
  }
  if (err == ENOENT) return absl::OkStatus();  // Removed since the lstat(): nothing there.
  if (err != ECONNREFUSED) {
    // Only ECONNREFUSED says nobody listens. EPROTOTYPE is a live listener of another
    // socket type (a region socket on the listen_unix path, or the reverse), EACCES one
    // this user may not write to: unlinking either would take a running process's socket
    // away from it.
    return absl::FailedPreconditionError(absl::StrCat(
        "option ", option, ": ", path, " is a socket this daemon cannot tell is stale (connect: ",
        std::strerror(err), err == EPROTOTYPE ? "; a socket of another type listens on it" : "",
        "); not replacing it: stop whatever uses it, remove it, or choose another path"));
  }
  unlink(path.c_str());  // Left by a daemon that was killed.
  return absl::OkStatus();
}

}  // namespace kvtier
