#include "storage/redis/redis_connection.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "storage/redis/redis_socket.h"

namespace kvtier {
namespace {

// One read from the socket takes up to this much: replies are segments of a megabyte
// or more, pipelined 16 MiB at a time, and a syscall (or TLS record loop) per 256 KiB
// keeps the per-byte cost at a copy or two.
constexpr size_t kReadChunk = 256 << 10;
// The first slice of a Read fed to the reader. hiredis 0.14's reader moves its unread
// bytes to the front of its buffer after every reply once 1 KiB has been consumed, so
// feeding it 256 KiB of small replies (+OK, :1) at once would move that 256 KiB again
// and again. Slices start here and double while no reply is complete (a big bulk
// string gets 16, 32, 64 ... KiB), keeping both the moves and the parse calls few.
constexpr size_t kFirstFeed = 16 << 10;
// An output buffer larger than this is freed after a flush rather than kept for the
// next pipeline: a pooled idle connection should not hold a 16 MiB batch's memory.
constexpr size_t kKeepOutBytes = 1 << 20;

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
    absl::Duration io_timeout, const RedisTlsContext* tls) {
  auto socket = RedisSocket::Connect(endpoint, tls, connect_timeout);
  if (!socket.ok()) {
    return absl::UnavailableError(
        absl::StrCat("redis ", endpoint.ToString(), ": ", socket.status().message()));
  }
  std::unique_ptr<RedisConnection> conn(
      new RedisConnection(endpoint, *std::move(socket), io_timeout));
  if (conn->reader_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("redis ", endpoint.ToString(), ": out of memory"));
  }
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

// redisReaderCreate uses hiredis's default reply functions, so every reply is a
// redisReply that freeReplyObject (RedisReplyDeleter) frees.
RedisConnection::RedisConnection(RedisEndpoint endpoint, std::unique_ptr<RedisSocket> socket,
                                 absl::Duration io_timeout)
    : endpoint_(std::move(endpoint)),
      socket_(std::move(socket)),
      io_timeout_(io_timeout),
      reader_(redisReaderCreate()),
      in_(new char[kReadChunk]) {}

RedisConnection::~RedisConnection() {
  if (reader_ != nullptr) redisReaderFree(reader_);
}

absl::Status RedisConnection::Broken(absl::string_view what, absl::string_view why) {
  if (!broken_) {
    broken_ = true;
    broken_why_ = absl::StrCat(what, ": ", why);
  }
  return absl::UnavailableError(absl::StrCat("redis ", endpoint_.ToString(), ": ", broken_why_));
}

void RedisConnection::Append(absl::Span<const absl::string_view> argv) {
  if (broken_) return;
  std::vector<const char*> args;
  std::vector<size_t> lens;
  args.reserve(argv.size());
  lens.reserve(argv.size());
  for (absl::string_view a : argv) {
    args.push_back(a.data());
    lens.push_back(a.size());
  }
  char* command = nullptr;
  const int len = redisFormatCommandArgv(&command, static_cast<int>(args.size()), args.data(),
                                         lens.data());
  if (len < 0 || command == nullptr) {
    // Out of memory formatting it: the stream would no longer match the commands.
    (void)Broken("append", "out of memory formatting a command");
    return;
  }
  out_.append(command, static_cast<size_t>(len));
  redisFreeCommand(command);
}

absl::Status RedisConnection::Flush() {
  if (broken_) return Broken("write", "broken");
  if (out_.empty()) return absl::OkStatus();
  absl::Status s = socket_->WriteAll(out_, io_timeout_);
  if (!s.ok()) {
    timed_out_ = socket_->timed_out();
    return Broken("write", s.message());
  }
  if (out_.capacity() > kKeepOutBytes) {
    std::string().swap(out_);
  } else {
    out_.clear();
  }
  return absl::OkStatus();
}

absl::StatusOr<RedisReplyPtr> RedisConnection::Read(std::optional<absl::Duration> first_wait) {
  if (absl::Status s = Flush(); !s.ok()) return s;
  size_t feed = kFirstFeed;
  absl::Duration wait = std::min(first_wait.value_or(io_timeout_), io_timeout_);
  for (;;) {
    void* reply = nullptr;
    if (redisReaderGetReply(reader_, &reply) != REDIS_OK) {
      return Broken("read", absl::StrCat("protocol error: ", reader_->errstr));
    }
    if (reply != nullptr) return RedisReplyPtr(static_cast<redisReply*>(reply));
    if (in_begin_ == in_end_) {
      absl::StatusOr<size_t> n = socket_->ReadSome(in_.get(), kReadChunk, wait);
      if (!n.ok()) {
        timed_out_ = socket_->timed_out();
        return Broken("read", n.status().message());
      }
      bytes_received_ += *n;
      wait = io_timeout_;  // Once bytes flow, each wait is for progress.
      in_begin_ = 0;
      in_end_ = *n;
    }
    const size_t n = std::min(feed, in_end_ - in_begin_);
    if (redisReaderFeed(reader_, in_.get() + in_begin_, n) != REDIS_OK) {
      return Broken("read", absl::StrCat("protocol error: ", reader_->errstr));
    }
    in_begin_ += n;
    feed = std::min(feed * 2, kReadChunk);
  }
}

bool RedisConnection::timed_out() const { return broken_ && timed_out_; }

absl::StatusOr<RedisReplyPtr> RedisConnection::Call(absl::Span<const absl::string_view> argv) {
  Append(argv);
  return Read();
}

}  // namespace kvtier
