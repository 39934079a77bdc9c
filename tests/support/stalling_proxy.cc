#include "tests/support/stalling_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvtier::testing {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StallingProxy>> StallingProxy::Start(int upstream_port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  sockaddr_in addr = Loopback(0);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 16) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, "bind/listen on 127.0.0.1:0");
  }
  return std::unique_ptr<StallingProxy>(new StallingProxy(fd, ntohs(addr.sin_port), upstream_port));
}

StallingProxy::StallingProxy(int listen_fd, int port, int upstream_port)
    : listen_fd_(listen_fd), port_(port), upstream_port_(upstream_port) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

StallingProxy::~StallingProxy() {
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);  // Ends the pumps' reads and writes.
  }
  shutdown(listen_fd_, SHUT_RDWR);  // Ends accept().
  acceptor_.join();
  {
    absl::MutexLock lock(&mu_);
    pumps = std::move(pumps_);
  }
  for (std::thread& t : pumps) t.join();
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) close(fd);
  close(listen_fd_);
}

std::string StallingProxy::target() const { return absl::StrCat("127.0.0.1:", port_); }

void StallingProxy::PauseDownstream() {
  absl::MutexLock lock(&mu_);
  paused_ = true;
}

void StallingProxy::AcceptLoop() {
  while (true) {
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      if (errno == EINTR) continue;
      return;  // Shut down.
    }
    const int upstream = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = Loopback(upstream_port_);
    if (upstream < 0 ||
        connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(client);
      if (upstream >= 0) close(upstream);
      continue;
    }
    const int one = 1;
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(upstream, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    absl::MutexLock lock(&mu_);
    fds_.push_back(client);
    fds_.push_back(upstream);
    if (stopping_) {
      shutdown(client, SHUT_RDWR);
      shutdown(upstream, SHUT_RDWR);
    }
    pumps_.emplace_back([this, client, upstream] { Pump(client, upstream, false); });
    pumps_.emplace_back([this, client, upstream] { Pump(upstream, client, true); });
  }
}

void StallingProxy::Pump(int from, int to, bool downstream) {
  char buf[64 << 10];
  while (true) {
    if (downstream) {
      absl::MutexLock lock(&mu_);
      auto may_read = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !paused_ || stopping_;
      };
      mu_.Await(absl::Condition(&may_read));
      if (stopping_) break;
    }
    const ssize_t n = read(from, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t off = 0; off < n;) {
      // MSG_NOSIGNAL: a side that closed (the daemon cancelling a stalled call) must
      // not end the test with SIGPIPE.
      const ssize_t w = send(to, buf + off, static_cast<size_t>(n - off), MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        shutdown(from, SHUT_RDWR);
        return;
      }
      off += w;
    }
  }
  shutdown(to, SHUT_WR);
}

}  // namespace kvtier::testing
