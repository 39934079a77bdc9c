#include "storage/redis/redis_socket.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "storage/redis/redis_tls_context.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point DeadlineAfter(absl::Duration timeout) {
  return Clock::now() + absl::ToChronoNanoseconds(timeout);
}

// Waits until `fd` is ready for `events` (or has failed: the next call says how).
// Returns: Ok, DeadlineExceeded ("timed out after <timeout>"), Unavailable (poll failed).
// Callers outside this file see Unavailable either way (RedisSocket::WaitFailed).
absl::Status WaitFor(int fd, short events, Clock::time_point deadline, absl::Duration timeout) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (n > 0) return absl::OkStatus();
    if (n == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out after ", absl::FormatDuration(timeout)));
    }
    if (errno != EINTR) return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
  }
}

// OpenSSL on the socket through a BIO of our own rather than BIO_s_socket, whose write()
// raises SIGPIPE on a connection the server reset. EOF is remembered for BIO_eof, which
// OpenSSL asks to tell "the server hung up mid-record" from a transient failure.
struct SocketBio {
  int fd = -1;
  bool eof = false;
};

int BioWrite(BIO* b, const char* data, int len) {
  auto* s = static_cast<SocketBio*>(BIO_get_data(b));
  BIO_clear_retry_flags(b);
  ssize_t n;
  do {
    n = send(s->fd, data, static_cast<size_t>(len), MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_write(b);
  return static_cast<int>(n);
}

int BioRead(BIO* b, char* data, int len) {
  auto* s = static_cast<SocketBio*>(BIO_get_data(b));
  BIO_clear_retry_flags(b);
  ssize_t n;
  do {
    n = recv(s->fd, data, static_cast<size_t>(len), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_read(b);
  if (n == 0) s->eof = true;
  return static_cast<int>(n);
}

long BioCtrl(BIO* b, int cmd, long, void*) {
  switch (cmd) {
    case BIO_CTRL_FLUSH:
      return 1;  // Nothing buffered here.
    case BIO_CTRL_EOF:
      return static_cast<SocketBio*>(BIO_get_data(b))->eof ? 1 : 0;
    default:
      return 0;
  }
}

int BioCreate(BIO* b) {
  BIO_set_data(b, new SocketBio);
  BIO_set_init(b, 1);
  return 1;
}

int BioDestroy(BIO* b) {
  delete static_cast<SocketBio*>(BIO_get_data(b));
  BIO_set_data(b, nullptr);
  return 1;
}

// Made once, never freed (OpenSSL keeps pointers to it in every BIO made from it).
BIO_METHOD* SocketBioMethod() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m =
        BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "kvtier redis socket");
    if (m == nullptr) return m;
    BIO_meth_set_write(m, BioWrite);
    BIO_meth_set_read(m, BioRead);
    BIO_meth_set_ctrl(m, BioCtrl);
    BIO_meth_set_create(m, BioCreate);
    BIO_meth_set_destroy(m, BioDestroy);
    return m;
  }();
  return method;
}

// Why a TLS call failed: the reasons OpenSSL queued, else what the socket said.
// `saved_errno` is errno right after the call.
std::string TlsWhy(int ssl_error, int saved_errno) {
  std::string why;
  while (unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    absl::StrAppend(&why, why.empty() ? "" : "; ", reason != nullptr ? reason : absl::StrCat("error ", e));
  }
  if (!why.empty()) return why;
  switch (ssl_error) {
    case SSL_ERROR_ZERO_RETURN:
      return "the server closed the TLS session";
    case SSL_ERROR_SYSCALL:
      return saved_errno != 0 ? std::string(std::strerror(saved_errno))
                              : "connection closed by the server";
    default:
      return absl::StrCat("SSL error ", ssl_error);
  }
}

void SetOptions(int fd) {
  // Best effort, as hiredis does: a socket without them still works.
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // Keepalive finds a peer that vanished without a FIN on an idle pooled connection
  // (probes after 15 s idle, every 5 s, 3 of them), like hiredis's redisEnableKeepAlive.
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  const int idle = 15, interval = 5, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

// A connected non-blocking socket to one of `host`'s addresses, tried in order within
// one deadline. Returns: the fd, Unavailable.
absl::StatusOr<int> ConnectTcp(const RedisEndpoint& endpoint, absl::Duration timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* addrs = nullptr;
  const std::string port = std::to_string(endpoint.port);
  if (int rc = getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &addrs); rc != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot resolve: ", rc == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(rc)));
  }
  const Clock::time_point deadline = DeadlineAfter(timeout);
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = addrs; a != nullptr && fd < 0; a = a->ai_next) {
    int s = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (s < 0) {
      why = std::strerror(errno);
      continue;
    }
    int err = 0;
    if (connect(s, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS || err == EINTR) {
        absl::Status ready = WaitFor(s, POLLOUT, deadline, timeout);
        if (!ready.ok()) {
          close(s);
          why = std::string(ready.message());  // Unavailable, below, whatever its code.
          break;  // The deadline covers every address.
        }
        socklen_t len = sizeof err;
        if (getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
    }
    if (err != 0) {
      why = std::strerror(err);
      close(s);
      continue;
    }
    fd = s;
  }
  freeaddrinfo(addrs);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect: ", why));
  SetOptions(fd);
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisSocket>> RedisSocket::Connect(const RedisEndpoint& endpoint,
                                                                  const RedisTlsContext* tls,
                                                                  absl::Duration connect_timeout) {
  absl::StatusOr<int> fd = ConnectTcp(endpoint, connect_timeout);
  if (!fd.ok()) return fd.status();
  if (tls == nullptr) return std::unique_ptr<RedisSocket>(new RedisSocket(*fd, nullptr));
  ERR_clear_error();
  SSL* ssl = tls->NewSession(endpoint.host);
  BIO* bio = ssl != nullptr && SocketBioMethod() != nullptr ? BIO_new(SocketBioMethod()) : nullptr;
  if (bio == nullptr) {
    SSL_free(ssl);
    close(*fd);
    ERR_clear_error();
    return absl::UnavailableError("TLS: cannot set up a session (out of memory, or no name to verify)");
  }
  static_cast<SocketBio*>(BIO_get_data(bio))->fd = *fd;
  SSL_set_bio(ssl, bio, bio);  // The session owns the BIO now.
  std::unique_ptr<RedisSocket> socket(new RedisSocket(*fd, ssl));
  if (absl::Status s = socket->Handshake(connect_timeout); !s.ok()) return s;
  return socket;
}

RedisSocket::~RedisSocket() {
  // No close_notify: Redis does not need one, and a connection dropped for an error
  // may not be able to send it.
  if (ssl_ != nullptr) SSL_free(ssl_);
  close(fd_);
}

absl::Status RedisSocket::Handshake(absl::Duration timeout) {
  const Clock::time_point deadline = DeadlineAfter(timeout);
  for (;;) {
    ERR_clear_error();
    errno = 0;
    const int rc = SSL_connect(ssl_);
    if (rc == 1) return absl::OkStatus();
    const int saved_errno = errno;
    const int error = SSL_get_error(ssl_, rc);
    short events = 0;
    if (error == SSL_ERROR_WANT_READ) {
      events = POLLIN;
    } else if (error == SSL_ERROR_WANT_WRITE) {
      events = POLLOUT;
    } else {
      std::string why = TlsWhy(error, saved_errno);
      const long verify = SSL_get_verify_result(ssl_);
      if (verify != X509_V_OK) {
        why = absl::StrCat("certificate verify failed: ", X509_verify_cert_error_string(verify));
      }
      return absl::UnavailableError(absl::StrCat("TLS handshake failed: ", why));
    }
    if (absl::Status s = WaitFor(fd_, events, deadline, timeout); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("TLS handshake failed: ", s.message()));
    }
  }
}

absl::Status RedisSocket::WriteAll(absl::string_view data, absl::Duration timeout) {
  Clock::time_point deadline = DeadlineAfter(timeout);
  while (!data.empty()) {
    short events = POLLOUT;
    if (ssl_ == nullptr) {
      const ssize_t n = send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n > 0) {
        data.remove_prefix(static_cast<size_t>(n));
        deadline = DeadlineAfter(timeout);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        return absl::UnavailableError(std::strerror(errno));
      }
    } else {
      ERR_clear_error();
      errno = 0;
      size_t n = 0;
      const int rc = SSL_write_ex(ssl_, data.data(), data.size(), &n);
      if (rc == 1) {
        data.remove_prefix(n);
        deadline = DeadlineAfter(timeout);
        continue;
      }
      const int saved_errno = errno;
      const int error = SSL_get_error(ssl_, rc);
      if (error == SSL_ERROR_WANT_READ) {
        events = POLLIN;  // A TLS 1.3 key update or the like, mid-write.
      } else if (error != SSL_ERROR_WANT_WRITE) {
        return absl::UnavailableError(absl::StrCat("TLS: ", TlsWhy(error, saved_errno)));
      }
    }
    if (absl::Status s = WaitFor(fd_, events, deadline, timeout); !s.ok()) return WaitFailed(s);
  }
  return absl::OkStatus();
}

absl::Status RedisSocket::WaitFailed(const absl::Status& s) {
  timed_out_ = absl::IsDeadlineExceeded(s);
  return absl::UnavailableError(ssl_ == nullptr ? std::string(s.message())
                                                : absl::StrCat("TLS: ", s.message()));
}

absl::StatusOr<size_t> RedisSocket::ReadSome(char* buf, size_t size, absl::Duration timeout) {
  const Clock::time_point deadline = DeadlineAfter(timeout);
  size_t got = 0;
  while (got < size) {
    short events = POLLIN;
    if (ssl_ == nullptr) {
      const ssize_t n = recv(fd_, buf, size, 0);
      if (n > 0) return static_cast<size_t>(n);
      if (n == 0) return absl::UnavailableError("connection closed by the server");
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return absl::UnavailableError(std::strerror(errno));
      }
    } else {
      ERR_clear_error();
      errno = 0;
      size_t n = 0;
      const int rc = SSL_read_ex(ssl_, buf + got, size - got, &n);
      if (rc == 1) {
        got += n;
        // SSL_read returns one record at a time; take what is already buffered (read
        // ahead) without another trip to the socket.
        if (SSL_has_pending(ssl_) != 1) break;
        continue;
      }
      if (got > 0) break;  // Return what came; the failure repeats on the next call.
      const int saved_errno = errno;
      const int error = SSL_get_error(ssl_, rc);
      if (error == SSL_ERROR_WANT_WRITE) {
        events = POLLOUT;
      } else if (error != SSL_ERROR_WANT_READ) {
        return absl::UnavailableError(absl::StrCat("TLS: ", TlsWhy(error, saved_errno)));
      }
    }
    if (absl::Status s = WaitFor(fd_, events, deadline, timeout); !s.ok()) return WaitFailed(s);
  }
  return got;
}

}  // namespace kvtier
