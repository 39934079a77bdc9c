// RedisConnection: one blocking connection to one Redis server, over hiredis. hiredis
// formats commands and parses RESP; this class adds timeouts, AUTH, pipelining (append
// many commands, send them in one write, read the replies in order) and errors as
// absl::Status. Once a read or write fails the connection is broken for good: its reply
// stream can no longer be matched to the commands sent, so its owner drops it.
//
// Thread-safety: not thread-safe; one user at a time (RedisCluster pools them).
#ifndef KVTIER_STORAGE_REDIS_REDIS_CONNECTION_H_
#define KVTIER_STORAGE_REDIS_REDIS_CONNECTION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

struct redisContext;
struct redisReply;

namespace kvtier {

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
  // Connects within `connect_timeout`, then sends AUTH if `auth` has a password. Every
  // later read or write fails after `io_timeout` without progress. Returns: Ok,
  // Unavailable (cannot connect, or timed out), PermissionDenied (AUTH refused).
  static absl::StatusOr<std::unique_ptr<RedisConnection>> Connect(
      const RedisEndpoint& endpoint, const RedisAuth& auth, absl::Duration connect_timeout,
      absl::Duration io_timeout);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Queues one command; nothing is sent until Flush or Read. The arguments are copied.
  void Append(absl::Span<const absl::string_view> argv);
  // Sends everything queued. Returns: Ok, Unavailable (broken).
  absl::Status Flush();
  // The next reply, in the order the commands were appended (sending what is queued
  // first). An error reply is a reply, not a failed status. Returns: Ok, Unavailable.
  absl::StatusOr<RedisReplyPtr> Read();
  // Append + Read, for one command.
  absl::StatusOr<RedisReplyPtr> Call(absl::Span<const absl::string_view> argv);

  bool broken() const { return broken_; }
  const RedisEndpoint& endpoint() const { return endpoint_; }

 private:
  RedisConnection(RedisEndpoint endpoint, redisContext* context);
  absl::Status Broken(absl::string_view what);

  const RedisEndpoint endpoint_;
  redisContext* const context_;
  bool broken_ = false;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_REDIS_CONNECTION_H_
