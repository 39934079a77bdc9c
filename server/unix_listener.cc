#include "server/unix_listener.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/unix_socket_path.h"
#include "storage/log.h"
#include "storage/log_limiter.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path,
                                                                 mode_t mode, AdmitFn admit) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() < 2 || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("option listen_unix: '", path, "' is not an absolute path"));
  }
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("option listen_unix: '", path,
                                                   "' is longer than a Unix socket path may be (",
                                                   sizeof(addr.sun_path) - 1, " bytes)"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (absl::Status s = ClaimSocketPath(path, SOCK_STREAM, "listen_unix"); !s.ok()) return s;
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("listen_unix: socket: ", std::strerror(errno)));
  }
  // Created with no permissions, then opened up: never briefly world-connectable.
  const mode_t old_mask = umask(0777);
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_mask);
  if (bound != 0 || chmod(path.c_str(), mode) != 0 || listen(fd, 128) != 0) {
    const int err = bound != 0 ? bind_errno : errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("option listen_unix: cannot listen on ", path, ": ", std::strerror(err)));
  }
  return std::unique_ptr<UnixListener>(new UnixListener(fd, path, std::move(admit)));
}

UnixListener::~UnixListener() {
  Stop();
  close(fd_);
}

void UnixListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  shutdown(fd_, SHUT_RDWR);  // Wakes the blocked accept().
  if (thread_.joinable()) thread_.join();
  unlink(path_.c_str());
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  while (true) {
    // gRPC drives the connection from its event loop: non-blocking.
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Out of descriptors or memory (any local user can hold connections open): the
        // connection waits in the backlog. Try again shortly, Stop() ending the wait,
        // instead of no longer accepting at all.
        static LogLimiter limiter(absl::Seconds(10));
        if (auto held = limiter.Allow(absl::Now())) {
          LogWarning("listen_unix: accept: ", std::strerror(err), "; retrying (", *held,
                     " more like it)");
        }
        mu_.AwaitWithTimeout(absl::Condition(&stopped_), absl::Milliseconds(100));
        continue;
      }
      LogError("listen_unix: accept: ", std::strerror(err), "; no longer accepting");
      return;
    }
    absl::StatusOr<PeerCredentials> cred = ReadPeerCredentials(conn);
    absl::Status admitted = cred.ok() ? admit_(*cred) : cred.status();
    if (!cred.ok()) cred = PeerCredentials{};
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      close(conn);
      return;
    }
    Connection connection{cred->uid, absl::OkStatus()};
    if (!admitted.ok()) {
      ++refused_;
      LogWarning("listen_unix: refused uid ", cred->uid, " (pid ", cred->pid, "): ",
                 admitted.message(), "; its calls are answered PERMISSION_DENIED");
      connection.refusal = absl::PermissionDeniedError(
          absl::StrCat("listen_unix: uid ", cred->uid, " may not call: ", admitted.message()));
    }
    peers_[conn] = std::move(connection);
    // Under the lock, so that PeerUid never sees the fd with a previous owner's uid.
    grpc::AddInsecureChannelFromFd(server, conn);
  }
}

std::optional<UnixListener::Connection> UnixListener::Find(absl::string_view peer) const {
  int fd;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

uint64_t UnixListener::refused() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

}  // namespace kvtier
