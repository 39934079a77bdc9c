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
  if (fd >= 0) {
    const bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (live) {
      return absl::FailedPreconditionError(absl::StrCat(
          "option ", option, ": ", path, " is in use: a running process (another kvtierd?) "
          "answers on it; stop it or choose another path"));
    }
  }
  unlink(path.c_str());  // Left by a daemon that was killed.
  return absl::OkStatus();
}

}  // namespace kvtier
