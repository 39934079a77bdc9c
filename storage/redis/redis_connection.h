// RedisConnection: one blocking connection to one Redis server, plaintext or TLS
// (RedisSocket), speaking RESP through hiredis's codec: redisFormatCommandArgv encodes
// commands and a redisReader parses replies. This class adds timeouts, AUTH,
// pipelining (append many commands, send them in one write, read the replies in order)
// and errors as absl::Status. Once a read or write fails the connection is broken for
// good: its reply stream can no longer be matched to the commands sent, so its owner
// drops it.
//
// Thread-safety: not thread-safe; one user at a time (RedisCluster pools them).
#ifndef KVTIER_STORAGE_REDIS_REDIS_CONNECTION_H_
#define KVTIER_STORAGE_REDIS_REDIS_CONNECTION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

struct redisReader;
struct redisReply;

namespace kvtier {

class RedisSocket;
class RedisTlsContext;

struct RedisEndpoint {
  std::string host;
  int port = 0;

  std::string ToString() const;
  // "host:port" (an IPv6 host in brackets). Returns: Ok, InvalidArgument.
  static absl::StatusOr<RedisEndpoint> Parse(absl::string_view text);
  friend bool operator==(const RedisEndpoint&, const RedisEndpoint&) = default;
};

// AUTH sent on connect: none when password is empty; `user` set means an ACL user.
struct RedisAuth {
  std::string user;
  std::string password;
};

// TLS to the servers (built into a RedisTlsContext once per cluster). The server's
// certificate is always verified: against ca_file, or the system's trust store when
// ca_file is empty; and it must name server_name, or when that is empty the host the
// connection went to (a DNS name, or an IP address matched against the certificate's IP
// SANs). cert_file and key_file together (PEM) are the client certificate for servers
// that require one (tls-auth-clients yes); neither for none.
struct RedisTls {
  bool enabled = false;
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string server_name;
};

struct RedisReplyDeleter {
  void operator()(redisReply* reply) const;
};
using RedisReplyPtr = std::unique_ptr<redisReply, RedisReplyDeleter>;

// What a reply says, read without touching hiredis's struct from callers.
bool IsErrorReply(const redisReply& reply);
bool IsNilReply(const redisReply& reply);
// The bytes of a bulk string, status or error reply; empty for others.
absl::string_view ReplyString(const redisReply& reply);

class RedisConnection {
 public:
  // Connects within `connect_timeout` (and, with `tls`, completes the TLS handshake
  // within another `connect_timeout`), then sends AUTH if `auth` has a password. Every
  // later read or write fails after `io_timeout` without progress. `tls` null means
  // plaintext; it is used only during the call (the connection keeps its own reference
  // to the OpenSSL context). Returns: Ok, Unavailable (cannot connect, TLS handshake or
  // certificate verification failed, or timed out), PermissionDenied (AUTH refused).
  static absl::StatusOr<std::unique_ptr<RedisConnection>> Connect(
      const RedisEndpoint& endpoint, const RedisAuth& auth, absl::Duration connect_timeout,
      absl::Duration io_timeout, const RedisTlsContext* tls = nullptr);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Queues one command; nothing is sent until Flush or Read. The arguments are copied.
  void Append(absl::Span<const absl::string_view> argv);
  // Sends everything queued. Returns: Ok, Unavailable (broken).
  absl::Status Flush();
  // The next reply, in the order the commands were appended (sending what is queued
  // first). An error reply is a reply, not a failed status. `first_wait` (at most
  // io_timeout) bounds the wait for its first bytes when none are buffered: a caller
  // that sent to several nodes at once need not give each the whole timeout in turn.
  // Returns: Ok, Unavailable.
  absl::StatusOr<RedisReplyPtr> Read(std::optional<absl::Duration> first_wait = std::nullopt);
  // Append + Read, for one command.
  absl::StatusOr<RedisReplyPtr> Call(absl::Span<const absl::string_view> argv);

  bool broken() const { return broken_; }
  // Whether it broke because the server went silent past a timeout, rather than closing
  // or resetting the stream, or a protocol error.
  bool timed_out() const;
  // Bytes read from the server since the connection opened (AUTH's reply included).
  uint64_t bytes_received() const { return bytes_received_; }
  const RedisEndpoint& endpoint() const { return endpoint_; }

 private:
  RedisConnection(RedisEndpoint endpoint, std::unique_ptr<RedisSocket> socket,
                  absl::Duration io_timeout);
  // Marks the connection broken; the first failure's reason is kept and repeated.
  absl::Status Broken(absl::string_view what, absl::string_view why);

  const RedisEndpoint endpoint_;
  const std::unique_ptr<RedisSocket> socket_;
  const absl::Duration io_timeout_;
  redisReader* const reader_;
  // Commands appended and not yet sent (a failed send breaks the connection, so there
  // is never a part of it to resume).
  std::string out_;
  // Bytes read from the socket and not yet fed to reader_: in_[in_begin_, in_end_).
  // Read feeds the reader in growing slices (see Read) rather than all at once.
  std::unique_ptr<char[]> in_;
  size_t in_begin_ = 0;
  size_t in_end_ = 0;
  bool broken_ = false;
  bool timed_out_ = false;  // The failure that broke it was a timeout.
  std::string broken_why_;
  uint64_t bytes_received_ = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_REDIS_CONNECTION_H_
