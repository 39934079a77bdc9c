#include "storage/redis/redis_node_pool.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

RedisNodePool::RedisNodePool(RedisEndpoint endpoint, RedisNodePoolOptions options)
    : endpoint_(std::move(endpoint)), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisNodePool::Acquire(bool* reused) {
  if (reused != nullptr) *reused = false;
  {
    absl::MutexLock l(&mu_);
    auto usable = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !idle_.empty() || open_ < options_.max_connections;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&usable), options_.wait)) {
      // This daemon's own connections are all in use: busy here, not a node that
      // failed (which would degrade the tier and refresh the topology).
      return absl::ResourceExhaustedError(absl::StrCat("redis ", endpoint_.ToString(), ": all ",
                                                 options_.max_connections,
                                                 " connections busy for ",
                                                 absl::FormatDuration(options_.wait)));
    }
    if (!idle_.empty()) {
      std::unique_ptr<RedisConnection> conn = std::move(idle_.back());
      idle_.pop_back();
      if (reused != nullptr) *reused = true;
      return conn;
    }
    ++open_;
  }
  auto conn = RedisConnection::Connect(endpoint_, options_.auth, options_.connect_timeout,
                                       options_.io_timeout, options_.tls.get());
  if (!conn.ok()) {
    absl::MutexLock l(&mu_);
    --open_;
    ++connect_failures_;
  }
  return conn;
}

void RedisNodePool::Release(std::unique_ptr<RedisConnection> conn) {
  absl::MutexLock l(&mu_);
  if (conn->broken()) {
    --open_;
    // Outside the lock would be nicer, but closing a socket does not block.
    conn.reset();
    return;
  }
  idle_.push_back(std::move(conn));
}

void RedisNodePool::DropIdle() {
  std::vector<std::unique_ptr<RedisConnection>> dropped;
  absl::MutexLock l(&mu_);
  open_ -= static_cast<int>(idle_.size());
  dropped.swap(idle_);
}

int RedisNodePool::open() const {
  absl::MutexLock l(&mu_);
  return open_;
}

uint64_t RedisNodePool::connect_failures() const {
  absl::MutexLock l(&mu_);
  return connect_failures_;
}

}  // namespace kvtier
