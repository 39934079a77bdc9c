#include "storage/redis/redis_connection.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

timeval TimevalOf(absl::Duration d) {
  const int64_t us = std::max<int64_t>(1000, absl::ToInt64Microseconds(d));
  return timeval{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
}

}  // namespace

std::string RedisEndpoint::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<RedisEndpoint> RedisEndpoint::Parse(absl::string_view text) {
  const size_t colon = text.rfind(':');
  RedisEndpoint e;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(text.substr(colon + 1), &e.port) || e.port <= 0 || e.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis endpoint \"", text, "\": want host:port"));
  }
  absl::string_view host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  e.host = std::string(host);
  return e;
}

void RedisReplyDeleter::operator()(redisReply* reply) const { freeReplyObject(reply); }

bool IsErrorReply(const redisReply& reply) { return reply.type == REDIS_REPLY_ERROR; }
bool IsNilReply(const redisReply& reply) { return reply.type == REDIS_REPLY_NIL; }

absl::string_view ReplyString(const redisReply& reply) {
  switch (reply.type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
      return absl::string_view(reply.str, reply.len);
    default:
      return {};
  }
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::Connect(
    const RedisEndpoint& endpoint, const RedisAuth& auth, absl::Duration connect_timeout,
    absl::Duration io_timeout) {
  redisContext* c =
      redisConnectWithTimeout(endpoint.host.c_str(), endpoint.port, TimevalOf(connect_timeout));
  if (c == nullptr) {
    return absl::UnavailableError(absl::StrCat("redis ", endpoint.ToString(), ": out of memory"));
  }
  if (c->err != 0) {
    std::string why = c->errstr;
    redisFree(c);
    return absl::UnavailableError(
        absl::StrCat("redis ", endpoint.ToString(), ": cannot connect: ", why));
  }
  std::unique_ptr<RedisConnection> conn(new RedisConnection(endpoint, c));
  if (redisSetTimeout(c, TimevalOf(io_timeout)) != REDIS_OK) {
    return absl::UnavailableError(
        absl::StrCat("redis ", endpoint.ToString(), ": cannot set timeouts: ", c->errstr));
  }
  redisEnableKeepAlive(c);
  if (!auth.password.empty()) {
    absl::StatusOr<RedisReplyPtr> reply =
        auth.user.empty() ? conn->Call({"AUTH", auth.password})
                          : conn->Call({"AUTH", auth.user, auth.password});
    if (!reply.ok()) return reply.status();
    if (IsErrorReply(**reply)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "redis ", endpoint.ToString(), ": AUTH refused: ", ReplyString(**reply)));
    }
  }
  return conn;
}

RedisConnection::RedisConnection(RedisEndpoint endpoint, redisContext* context)
    : endpoint_(std::move(endpoint)), context_(context) {}

RedisConnection::~RedisConnection() { redisFree(context_); }

absl::Status RedisConnection::Broken(absl::string_view what) {
  broken_ = true;
  return absl::UnavailableError(absl::StrCat("redis ", endpoint_.ToString(), ": ", what, ": ",
                                             context_->err != 0 ? context_->errstr : "broken"));
}

void RedisConnection::Append(absl::Span<const absl::string_view> argv) {
  std::vector<const char*> args;
  std::vector<size_t> lens;
  args.reserve(argv.size());
  lens.reserve(argv.size());
  for (absl::string_view a : argv) {
    args.push_back(a.data());
    lens.push_back(a.size());
  }
  if (redisAppendCommandArgv(context_, static_cast<int>(args.size()), args.data(),
                             lens.data()) != REDIS_OK) {
    broken_ = true;  // Out of memory formatting it: the stream no longer matches.
  }
}

absl::Status RedisConnection::Flush() {
  if (broken_) return Broken("write");
  int done = 0;
  while (!done) {
    if (redisBufferWrite(context_, &done) != REDIS_OK) return Broken("write");
  }
  return absl::OkStatus();
}

absl::StatusOr<RedisReplyPtr> RedisConnection::Read() {
  if (broken_) return Broken("read");
  void* reply = nullptr;
  if (redisGetReply(context_, &reply) != REDIS_OK || reply == nullptr) return Broken("read");
  return RedisReplyPtr(static_cast<redisReply*>(reply));
}

absl::StatusOr<RedisReplyPtr> RedisConnection::Call(absl::Span<const absl::string_view> argv) {
  Append(argv);
  return Read();
}

}  // namespace kvtier
