// RedisNodePool: the connections to one cluster node, at most `max_connections` open at
// once. A caller takes one for a pipeline and gives it back; a broken one is closed and
// its place freed. A caller that finds all of them taken waits, up to `wait`.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_REDIS_REDIS_NODE_POOL_H_
#define KVTIER_STORAGE_REDIS_REDIS_NODE_POOL_H_

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/redis/redis_connection.h"
#include "storage/redis/redis_tls_context.h"

namespace kvtier {

struct RedisNodePoolOptions {
  RedisAuth auth;
  // TLS for every connection, shared with the cluster's other pools; null: plaintext.
  std::shared_ptr<const RedisTlsContext> tls;
  absl::Duration connect_timeout = absl::Milliseconds(500);
  absl::Duration io_timeout = absl::Seconds(2);
  int max_connections = 4;
  // How long Acquire waits for a connection another caller holds.
  absl::Duration wait = absl::Seconds(2);
};

class RedisNodePool {
 public:
  RedisNodePool(RedisEndpoint endpoint, RedisNodePoolOptions options);
  RedisNodePool(const RedisNodePool&) = delete;
  RedisNodePool& operator=(const RedisNodePool&) = delete;

  // An idle connection, or a new one while fewer than max_connections are open.
  // `reused` (may be null): set to whether it is an idle one, which the server may have
  // closed since (its `timeout`, a restart, CLIENT KILL) without this pool knowing.
  // Returns: Ok, Unavailable (cannot connect), ResourceExhausted (all taken for `wait`),
  // PermissionDenied.
  absl::StatusOr<std::unique_ptr<RedisConnection>> Acquire(bool* reused = nullptr);
  // Gives a connection back (closing it if broken).
  void Release(std::unique_ptr<RedisConnection> conn);
  // Closes the idle connections (after the node failed: the next caller reconnects).
  void DropIdle();

  const RedisEndpoint& endpoint() const { return endpoint_; }
  int open() const;
  uint64_t connect_failures() const;

 private:
  const RedisEndpoint endpoint_;
  const RedisNodePoolOptions options_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<RedisConnection>> idle_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;  // Idle plus taken plus being connected.
  uint64_t connect_failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_REDIS_NODE_POOL_H_
