// RedisSocket: the byte stream under a RedisConnection: a non-blocking TCP socket to
// one server (TCP_NODELAY, keepalive), optionally wrapped in TLS, where every wait is a
// poll() bounded by a timeout. It knows nothing of RESP.
//
// Writes never raise SIGPIPE (send with MSG_NOSIGNAL, also under TLS): a server that
// went away is an error, not the end of the process.
//
// Thread-safety: not thread-safe; one user at a time.
#ifndef KVTIER_STORAGE_REDIS_REDIS_SOCKET_H_
#define KVTIER_STORAGE_REDIS_REDIS_SOCKET_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "storage/redis/redis_connection.h"

struct ssl_st;

namespace kvtier {

class RedisSocket {
 public:
  // Resolves `endpoint` (IPv4 or IPv6; the name lookup itself is not bounded), connects
  // within `connect_timeout`, and with `tls` completes the handshake and verifies the
  // server's certificate within another `connect_timeout`. Error messages are the
  // reason only ("cannot connect: Connection refused", "TLS handshake failed:
  // certificate verify failed: hostname mismatch"); the caller names the endpoint.
  // Returns: Ok, Unavailable.
  static absl::StatusOr<std::unique_ptr<RedisSocket>> Connect(const RedisEndpoint& endpoint,
                                                              const RedisTlsContext* tls,
                                                              absl::Duration connect_timeout);
  ~RedisSocket();
  RedisSocket(const RedisSocket&) = delete;
  RedisSocket& operator=(const RedisSocket&) = delete;

  // Writes all of `data`, failing after `timeout` without progress. Returns: Ok,
  // Unavailable (the stream is then unusable).
  absl::Status WriteAll(absl::string_view data, absl::Duration timeout);
  // Reads between 1 and `size` bytes into `buf`, waiting up to `timeout` for the first.
  // The server closing the connection is an error. Returns: Ok, Unavailable.
  absl::StatusOr<size_t> ReadSome(char* buf, size_t size, absl::Duration timeout);

  bool tls() const { return ssl_ != nullptr; }
  // Whether the last WriteAll or ReadSome that failed did so because its timeout ran
  // out (the server silent), rather than the server closing or resetting the stream.
  bool timed_out() const { return timed_out_; }

 private:
  RedisSocket(int fd, ssl_st* ssl) : fd_(fd), ssl_(ssl) {}
  absl::Status Handshake(absl::Duration timeout);
  // A failed wait of WriteAll or ReadSome: notes whether it timed out; Unavailable.
  absl::Status WaitFailed(const absl::Status& s);

  const int fd_;
  ssl_st* const ssl_;  // Null for plaintext. Owned.
  bool timed_out_ = false;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_REDIS_SOCKET_H_
