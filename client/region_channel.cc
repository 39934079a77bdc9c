#include "client/region_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "client/call_cancellation.h"

namespace kvtier {

absl::StatusOr<std::shared_ptr<RegionChannel>> RegionChannel::Connect(
    const std::string& name, uint64_t instance_id, absl::Duration timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() < 2 || name.size() >= sizeof(addr.sun_path) ||
      (name[0] != '@' && name[0] != '/')) {
    return absl::InvalidArgumentError(absl::StrCat("region socket: bad name '", name, "'"));
  }
  std::memcpy(addr.sun_path, name.data(), name.size());
  const bool abstract = name[0] == '@';
  if (abstract) addr.sun_path[0] = '\0';
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() +
                                          (abstract ? 0 : 1));
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("region socket: ", std::strerror(errno)));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("region socket '", name, "': ",
                                               std::strerror(err),
                                               " (the daemon is on another host, or has none)"));
  }
  // Sends and receives give up after `timeout` (EAGAIN): a stopped daemon must not hang
  // the client.
  const timeval tv = absl::ToTimeval(std::max(timeout, absl::Milliseconds(1)));
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("region socket: SO_RCVTIMEO: ", std::strerror(err)));
  }
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("region socket: eventfd: ", std::strerror(err)));
  }
  std::shared_ptr<RegionChannel> channel(new RegionChannel(fd, wake_fd, timeout));
  v1::RegionSocketRequest hello;
  hello.mutable_hello();
  auto answer = channel->Call(hello, -1);
  if (!answer.ok()) return answer.status();
  if (answer->code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(answer->code()), answer->message());
  }
  if (answer->instance_id() != instance_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region socket '", name, "' belongs to another daemon (instance ",
        absl::Hex(answer->instance_id()), ", not ", absl::Hex(instance_id), ")"));
  }
  return channel;
}

RegionChannel::~RegionChannel() { Close(); }

void RegionChannel::Close() {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  closed_ = true;
  close(fd_.exchange(-1));
  close(wake_fd_);
  wake_fd_ = -1;
}

absl::StatusOr<v1::RegionSocketResponse> RegionChannel::Call(
    const v1::RegionSocketRequest& request, int fd) {
  const std::string out = request.SerializeAsString();
  iovec iov{const_cast<char*>(out.data()), out.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  // Cancelled before it was sent: nothing to owe, the channel stays as it was.
  if (CallCancellation::CurrentCancelled()) {
    return absl::CancelledError("region socket: the call was cancelled");
  }
  absl::MutexLock lock(&mu_);
  if (closed_) {
    return absl::UnavailableError(
        "region socket: closed (the daemon behind it went away); shared memory goes by the "
        "new daemon's socket");
  }
  if (broken_.load()) {
    return absl::UnavailableError(
        "region socket: closed after the daemon left a request unanswered");
  }
  const auto timed_out = [this](const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    broken_.store(true);
    shutdown(fd_, SHUT_RDWR);  // The daemon forgets this connection's regions.
    return absl::DeadlineExceededError(absl::StrCat(
        "region socket: the daemon did not ", what, " within ", absl::FormatDuration(timeout_),
        " (stopped or overloaded?); shared memory is off for this client"));
  };
  // A caller that cancels (CallCancellation) stops waiting at once; the answer it was
  // owed is read and dropped by the next request, so answers stay in step with requests
  // and the connection (with every region registered on it) lives on.
  std::atomic<bool> cancelled{false};
  // The descriptor by value: Close waits for mu_, and the hook is gone before it is freed.
  CallCancellation::Hook on_cancel([wake_fd = wake_fd_, &cancelled] {
    cancelled.store(true);
    const uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof(one));
  });
  const auto cancelled_error = [] {
    return absl::CancelledError(
        "region socket: the call was cancelled before the daemon answered");
  };
  char buf[4096];
  const auto receive = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<ssize_t> {
    ssize_t n;
    do {
      n = recv(fd_, buf, sizeof(buf), 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return timed_out("answer");
    if (n <= 0) {
      return absl::UnavailableError(n == 0 ? "region socket: the daemon closed it"
                                           : absl::StrCat("region socket: ", std::strerror(errno)));
    }
    return n;
  };
  while (owed_ > 0) {
    switch (WaitReadable(cancelled)) {
      case WaitResult::kCancelled:
        return cancelled_error();
      case WaitResult::kTimedOut:
        return timed_out("answer an earlier, cancelled request");
      case WaitResult::kReady: {
        absl::StatusOr<ssize_t> n = receive();
        if (!n.ok()) return n.status();
        --owed_;
        // A registration whose caller gave up (and unmapped its memory): removed, or the
        // daemon would keep its mapping, and count it, until the channel closes. Only
        // an add's answer names a region.
        v1::RegionSocketResponse dropped;
        if (!dropped.ParseFromArray(buf, static_cast<int>(*n)) || dropped.code() != 0 ||
            dropped.region_id() == 0) {
          break;
        }
        v1::RegionSocketRequest remove;
        remove.mutable_remove()->set_region_id(dropped.region_id());
        const std::string bytes = remove.SerializeAsString();
        ssize_t removed;
        do {
          removed = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        } while (removed < 0 && errno == EINTR);
        if (removed < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          return timed_out("take a request");
        }
        if (removed != static_cast<ssize_t>(bytes.size())) {
          return absl::UnavailableError(absl::StrCat("region socket: send: ", std::strerror(errno)));
        }
        ++owed_;  // Its answer, read and dropped next.
        break;
      }
    }
  }
  ssize_t sent;
  do {
    sent = sendmsg(fd_, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return timed_out("take a request");
  if (sent != static_cast<ssize_t>(out.size())) {
    return absl::UnavailableError(absl::StrCat("region socket: send: ", std::strerror(errno)));
  }
  switch (WaitReadable(cancelled)) {
    case WaitResult::kCancelled:
      ++owed_;
      return cancelled_error();
    case WaitResult::kTimedOut:
      return timed_out("answer");
    case WaitResult::kReady:
      break;
  }
  absl::StatusOr<ssize_t> n = receive();
  if (!n.ok()) return n.status();
  v1::RegionSocketResponse response;
  if (!response.ParseFromArray(buf, static_cast<int>(*n))) {
    return absl::InternalError("region socket: the answer is not a RegionSocketResponse");
  }
  return response;
}

RegionChannel::WaitResult RegionChannel::WaitReadable(const std::atomic<bool>& cancelled) {
  const absl::Time deadline = timeout_ == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + std::max(timeout_, absl::Milliseconds(1));
  for (;;) {
    if (cancelled.load()) return WaitResult::kCancelled;
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    int wait_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return WaitResult::kTimedOut;
      wait_ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1,
                                                   std::numeric_limits<int>::max()));
    }
    const int r = poll(fds, 2, wait_ms);
    if (r < 0 && errno != EINTR) return WaitResult::kReady;  // recv reports the error.
    if (r <= 0) continue;
    if (fds[1].revents != 0) {
      uint64_t count;
      (void)!read(wake_fd_, &count, sizeof(count));  // An earlier call's wake-up, or ours.
    }
    if (cancelled.load()) return WaitResult::kCancelled;
    if (fds[0].revents != 0) return WaitResult::kReady;
  }
}

bool RegionChannel::broken() const { return broken_.load(); }

bool RegionChannel::PeerGone() const {
  char byte;
  ssize_t n;
  do {
    n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  // 0: end of stream. An error other than "nothing to read": reset or shut down.
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

absl::StatusOr<RegionChannel::Registration> RegionChannel::Add(int fd, uint64_t bytes) {
  v1::RegionSocketRequest req;
  req.mutable_add()->set_bytes(bytes);
  return Register(req, fd);
}

absl::StatusOr<RegionChannel::Registration> RegionChannel::AddDevice(
    absl::string_view ipc_handle, uint64_t bytes, absl::Span<const std::string> event_handles) {
  v1::RegionSocketRequest req;
  req.mutable_add_device()->set_ipc_handle(std::string(ipc_handle));
  req.mutable_add_device()->set_bytes(bytes);
  for (const std::string& h : event_handles) req.mutable_add_device()->add_event_handles(h);
  return Register(req, -1);
}

absl::StatusOr<RegionChannel::Registration> RegionChannel::Register(
    const v1::RegionSocketRequest& req, int fd) {
  auto answer = Call(req, fd);
  if (!answer.ok()) return answer.status();
  if (answer->code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(answer->code()), answer->message());
  }
  return Registration{answer->region_id(), answer->token(), answer->bytes()};
}

absl::Status RegionChannel::Remove(uint64_t region_id, absl::Duration wait_for_calls) {
  v1::RegionSocketRequest req;
  req.mutable_remove()->set_region_id(region_id);
  const absl::Time give_up = absl::Now() + wait_for_calls;
  absl::Duration backoff = absl::Milliseconds(1);
  while (true) {
    auto answer = Call(req, -1);
    if (!answer.ok()) return answer.status();
    absl::Status s(static_cast<absl::StatusCode>(answer->code()), answer->message());
    if (!absl::IsFailedPrecondition(s) || absl::Now() + backoff > give_up) return s;
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Milliseconds(50));
  }
}

}  // namespace kvtier
