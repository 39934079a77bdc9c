#include "server/region_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/unix_socket_path.h"
#include "storage/log.h"

namespace kvtier {
namespace {

// Requests are a few dozen bytes, up to 35 KB for a device registration with
// DeviceRegion::kMaxEvents event handles; anything longer is not ours.
constexpr size_t kMaxPacket = 64 << 10;
// Descriptors one packet may carry before it is rejected (extra ones are closed).
constexpr int kMaxFds = 4;
// Connections of peers the daemon does not admit, open at once (each until its first
// request is answered), outside max_connections.
constexpr size_t kMaxRefusedConnections = 16;
// How long the listening socket sits out of poll() when the daemon is out of
// descriptors and has none in reserve (see Loop).
constexpr std::chrono::milliseconds kAcceptRetry{100};

absl::StatusOr<sockaddr_un> SocketAddress(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const bool abstract = !name.empty() && name[0] == '@';
  if (name.size() < 2 || (!abstract && name[0] != '/')) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_socket: '", name, "' is neither an absolute path nor an @abstract name"));
  }
  if (name.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_socket: '", name, "' is longer than a Unix socket name may be (",
        sizeof(addr.sun_path) - 1, " bytes)"));
  }
  std::memcpy(addr.sun_path, name.data(), name.size());
  if (abstract) addr.sun_path[0] = '\0';  // Abstract: leading NUL, no terminator.
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() +
                                (abstract ? 0 : 1));
  return addr;
}

}  // namespace

absl::Status AdmitPeer(const PeerCredentials& peer, uid_t self_uid,
                       std::optional<gid_t> allowed_gid) {
  if (peer.uid == self_uid || peer.uid == 0) return absl::OkStatus();
  if (allowed_gid && peer.InGroup(*allowed_gid)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "region socket: uid ", peer.uid, " (pid ", peer.pid, ") may not register memory: "
      "only the daemon's user (uid ", self_uid, "), root",
      allowed_gid ? absl::StrCat(" and members of gid ", *allowed_gid)
                  : std::string(" (set shm_allowed_group to admit a group)"),
      " may; use the gRPC stream instead"));
}

struct RegionSocket::Connection {
  int fd = -1;
  uint64_t id = 0;
  absl::Status admitted;
};

absl::StatusOr<std::unique_ptr<RegionSocket>> RegionSocket::Start(RegionSocketOptions options,
                                                                  RegionTable* regions) {
  socklen_t len = 0;
  auto addr = SocketAddress(options.name, &len);
  if (!addr.ok()) return addr.status();
  const bool path = options.name[0] == '/';
  if (path) {
    // A socket left by a daemon that was killed is removed; a live one, or anything
    // else, is not.
    if (absl::Status s = ClaimSocketPath(options.name, SOCK_SEQPACKET, "shm_socket"); !s.ok()) {
      return s;
    }
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_socket: socket: ", std::strerror(errno)));
  if (bind(fd, reinterpret_cast<const sockaddr*>(&*addr), len) != 0 || listen(fd, 128) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("shm_socket: cannot bind '", options.name,
                                               "': ", std::strerror(err)));
  }
  if (path && chmod(options.name.c_str(), options.mode) != 0) {
    const int err = errno;
    close(fd);
    unlink(options.name.c_str());
    return absl::UnavailableError(
        absl::StrCat("shm_socket: chmod '", options.name, "': ", std::strerror(err)));
  }
  // A path socket's group is the one admitted: connect() needs write permission on it,
  // which the mode gives the socket's group, not shm_allowed_group's members otherwise.
  if (path && options.allowed_gid.has_value() &&
      chown(options.name.c_str(), static_cast<uid_t>(-1), *options.allowed_gid) != 0) {
    const int err = errno;
    close(fd);
    unlink(options.name.c_str());
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_socket: cannot give '", options.name, "' to shm_allowed_group (gid ",
        *options.allowed_gid, "): ", std::strerror(err),
        "; the daemon's user must be a member of that group (or use an @abstract socket)"));
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("shm_socket: eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<RegionSocket>(new RegionSocket(std::move(options), regions, fd, wake));
}

RegionSocket::RegionSocket(RegionSocketOptions options, RegionTable* regions, int listen_fd,
                           int wake_fd)
    : options_(std::move(options)),
      regions_(regions),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      reserve_fd_(open("/dev/null", O_RDONLY | O_CLOEXEC)) {
  thread_ = std::thread([this] { Loop(); });
}

RegionSocket::~RegionSocket() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  close(listen_fd_);
  close(wake_fd_);
  if (reserve_fd_ >= 0) close(reserve_fd_);
  if (options_.name[0] == '/') unlink(options_.name.c_str());
}

void RegionSocket::Loop() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  // Out of descriptors with none kept to refuse connections with, the listening socket
  // stays readable: it sits out of poll() until this time instead of spinning.
  std::optional<std::chrono::steady_clock::time_point> retry_accept_at;
  for (;;) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({retry_accept_at.has_value() ? -1 : listen_fd_, POLLIN, 0});
    for (const Connection& c : conns) fds.push_back({c.fd, POLLIN, 0});
    int timeout_ms = -1;
    if (retry_accept_at.has_value()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, std::chrono::ceil<std::chrono::milliseconds>(*retry_accept_at -
                                                          std::chrono::steady_clock::now())
                 .count()));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      LogError("region socket: poll: ", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    // Connections first (their indices match fds[2..]), then new ones.
    for (size_t i = conns.size(); i-- > 0;) {
      if (fds[i + 2].revents == 0) continue;
      if (!Serve(conns[i])) {
        const int removed = regions_->RemoveOwner(conns[i].id);
        if (removed > 0) {
          LogInfo("region socket: client ", conns[i].id, " went away; forgot ", removed,
                  " region(s)");
        }
        close(conns[i].fd);
        conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    const bool accept = retry_accept_at.has_value()
                            ? std::chrono::steady_clock::now() >= *retry_accept_at
                            : fds[1].revents != 0;
    if (accept) {
      retry_accept_at.reset();
      if (!Accept(conns)) {
        retry_accept_at = std::chrono::steady_clock::now() + kAcceptRetry;
      }
    }
  }
  for (Connection& c : conns) {
    regions_->RemoveOwner(c.id);
    close(c.fd);
  }
}

bool RegionSocket::Accept(std::vector<Connection>& conns) {
  // Lost when another thread took the descriptor RefuseWithReserve freed: kept again.
  if (reserve_fd_ < 0) reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // EAGAIN: all taken; anything else but a full descriptor table: the next poll
      // retries. A full table with no reserve to refuse with: stuck for now.
      if (errno != EMFILE && errno != ENFILE) return true;
      if (RefuseWithReserve()) continue;
      return false;
    }
    Connection c;
    c.fd = fd;
    c.id = ++next_connection_id_;
    auto peer = ReadPeerCredentials(fd);
    c.admitted = peer.ok() ? AdmitPeer(*peer, geteuid(), options_.allowed_gid) : peer.status();
    // Peers the daemon does not admit get their refusal on their first request and are
    // closed; a few at a time, outside max_connections, so that they cannot take the
    // places of the workers it admits.
    const size_t refused = static_cast<size_t>(std::count_if(
        conns.begin(), conns.end(), [](const Connection& k) { return !k.admitted.ok(); }));
    const size_t open = c.admitted.ok() ? conns.size() - refused : refused;
    const size_t limit = c.admitted.ok() ? options_.max_connections : kMaxRefusedConnections;
    if (open >= limit) {
      if (limiter_.Allow(absl::Now()).has_value()) {
        LogWarning("region socket: ", open, c.admitted.ok() ? " connections" : " refused peers",
                   " open; closing another", c.admitted.ok() ? "" : absl::StrCat(" (", c.admitted.message(), ")"));
      }
      close(fd);
      continue;
    }
    if (!c.admitted.ok() && limiter_.Allow(absl::Now()).has_value()) {
      LogWarning(c.admitted.message());
    }
    conns.push_back(std::move(c));
  }
}

bool RegionSocket::RefuseWithReserve() {
  // Out of descriptors, a pending connection keeps the listening socket readable and
  // poll() returns at once, for ever: accept it with the descriptor kept for this, and
  // close it, so that the client learns now (and the loop sleeps) instead of waiting.
  if (reserve_fd_ < 0) return false;
  close(reserve_fd_);
  const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd >= 0) close(fd);
  reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (limiter_.Allow(absl::Now()).has_value()) {
    LogWarning("region socket: the daemon is out of file descriptors (RLIMIT_NOFILE); "
               "closed a new connection (the client uses the gRPC stream)");
  }
  return fd >= 0;
}

namespace {

// A registration's answer: the region's id, token and size, or the error.
absl::Status Answer(const absl::StatusOr<RegionTable::Added>& added,
                    v1::RegionSocketResponse& resp) {
  if (!added.ok()) return added.status();
  resp.set_region_id(added->id);
  resp.set_token(added->token);
  resp.set_bytes(added->bytes);
  return absl::OkStatus();
}

}  // namespace

bool RegionSocket::Serve(Connection& conn) {
  if (packet_.size() < kMaxPacket) packet_.resize(kMaxPacket);
  char* const buf = packet_.data();
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  iovec iov{buf, kMaxPacket};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(conn.fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EINTR;

  // Every descriptor that came is collected (and closed below), whatever the packet: an
  // empty packet may carry some too.
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.push_back(fd);
      }
    }
  }

  if (n == 0 && fds.empty()) return false;  // The client closed (or exited).

  v1::RegionSocketRequest req;
  v1::RegionSocketResponse resp;
  resp.set_instance_id(options_.instance_id);
  absl::Status status;
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    status = absl::InvalidArgumentError("region socket: request too long (or too many descriptors)");
  } else if (!req.ParseFromArray(buf, static_cast<int>(n))) {
    status = absl::InvalidArgumentError("region socket: not a RegionSocketRequest");
  } else if (!conn.admitted.ok()) {
    status = conn.admitted;
  } else if (req.has_add() != (fds.size() == 1) || fds.size() > 1) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "region socket: ", fds.size(), " descriptors attached; add takes exactly one memfd "
        "and other requests none"));
  } else if (req.has_hello()) {
    // The answer's instance_id is the whole reply.
  } else if (req.has_add()) {
    status = Answer(regions_->Add(conn.id, fds[0], req.add().bytes()), resp);
  } else if (req.has_add_device()) {
    if (options_.device == nullptr) {
      status = absl::FailedPreconditionError(
          "region socket: this daemon has no GPU; register host memory (a memfd) instead");
    } else {
      const std::vector<std::string> events(req.add_device().event_handles().begin(),
                                            req.add_device().event_handles().end());
      status = Answer(regions_->AddDevice(conn.id, options_.device,
                                          req.add_device().ipc_handle(),
                                          req.add_device().bytes(), events),
                      resp);
    }
  } else if (req.has_remove()) {
    status = regions_->Remove(conn.id, req.remove().region_id());
  } else {
    status = absl::InvalidArgumentError("region socket: empty request");
  }
  for (int fd : fds) close(fd);  // A mapped region does not need its descriptor.

  resp.set_code(static_cast<int>(status.code()));
  resp.set_message(std::string(status.message()));
  const std::string out = resp.SerializeAsString();
  // Never block the loop on one client: one that does not read its answers is dropped.
  const bool sent = send(conn.fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT) ==
                    static_cast<ssize_t>(out.size());
  // A peer the daemon does not admit has had its answer.
  return sent && conn.admitted.ok();
}

}  // namespace kvtier
