// RedisCluster: a Redis Cluster client that owns its protocol: slot routing from
// CLUSTER SLOTS, MOVED (the slot moved for good: the map is updated and the topology
// refreshed) and ASK (the key is mid-migration: this one command goes to the importing
// node after ASKING), TRYAGAIN/CLUSTERDOWN/LOADING retried with backoff, a bounded pool
// of connections per node, timeouts on every read and write, and pipelining: a batch of
// commands is grouped by node, each group sent in one write to its node before any
// reply is read, so a batch spread over the masters uses all of them at once.
// hiredis does the RESP encoding and parsing (RedisConnection). With options.tls every
// connection is TLS (mutual TLS with a client certificate), through one OpenSSL
// context built in Create; a cluster with tls-cluster on reports its TLS ports in
// CLUSTER SLOTS, so routing is the same.
//
// Reads and writes go to masters. Replicas take over through the cluster's own
// failover; a refresh after an I/O error finds the new master.
//
// The client keeps a pool only for the masters of its slot map, the seeds, and nodes a
// redirection or CallOn named since the last refresh. A successful refresh drops the
// pools of every other node (a master removed, a pod come back under a new address), so
// their connections close, and a refresh asks only the map's masters and the seeds: a
// node that left is never waited on again.
//
// A pooled connection the server closed while it sat idle (its `timeout`, a proxy's
// idle close, a restart, CLIENT KILL) fails at once, before any reply: its commands are
// sent again, once, on a new connection, and the pool's other idle connections are
// dropped. That is no failure of the node. (A timeout is: a silent node is not asked
// twice.)
//
// Thread-safety: thread-safe. Execute runs its I/O without the client's lock.
#ifndef KVTIER_STORAGE_REDIS_REDIS_CLUSTER_H_
#define KVTIER_STORAGE_REDIS_REDIS_CLUSTER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/redis/hash_slot.h"
#include "storage/redis/redis_connection.h"
#include "storage/redis/redis_node_pool.h"

namespace kvtier {

struct RedisClusterOptions {
  std::vector<RedisEndpoint> seeds;  // Any nodes of the cluster; at least one.
  RedisAuth auth;
  // TLS to every node (see RedisTls); off by default. Its files are read once, in
  // Create.
  RedisTls tls;
  absl::Duration connect_timeout = absl::Milliseconds(500);
  absl::Duration io_timeout = absl::Seconds(2);
  int connections_per_node = 4;
  // Redirections (MOVED, ASK) and retries (TRYAGAIN, CLUSTERDOWN, LOADING) one command
  // may take before it fails Unavailable.
  int max_redirects = 5;
  // Topology refreshes closer together than this are skipped (a burst of MOVED replies
  // or failures refreshes once).
  absl::Duration min_refresh_interval = absl::Milliseconds(100);
  // First wait before retrying TRYAGAIN and the like; doubles per retry.
  absl::Duration retry_backoff = absl::Milliseconds(5);
  std::function<absl::Time()> now = [] { return absl::Now(); };

  absl::Status Validate() const;
};

struct RedisClusterStats {
  uint64_t moved = 0;               // MOVED replies followed.
  uint64_t ask = 0;                 // ASK replies followed.
  uint64_t retried = 0;             // TRYAGAIN, CLUSTERDOWN, LOADING, MASTERDOWN.
  uint64_t refreshes = 0;           // Topologies read.
  uint64_t refresh_failures = 0;    // Refreshes that reached no node.
  uint64_t refresh_node_failures = 0;  // Nodes a refresh asked that did not answer.
  uint64_t io_failures = 0;         // Commands failed by a broken or unreachable node.
  uint64_t masters = 0;             // Nodes serving slots in the current map.
  uint64_t slots_covered = 0;       // Slots with a known master.
  // Nodes the client keeps a connection pool for: the map's masters, the seeds, and
  // nodes a redirection or CallOn named since the last refresh.
  uint64_t nodes = 0;
};

// One command and the key it is routed by. Views, not copies: what they point at must
// outlive the Execute call.
struct RedisCommand {
  std::vector<absl::string_view> argv;
  absl::string_view key;
};

class RedisCluster {
 public:
  // Loads the TLS files (when options.tls.enabled), then tries a first topology read; a
  // cluster not reachable yet is not an error (commands fail Unavailable until a
  // refresh reaches it). Returns: Ok, InvalidArgument (bad options; a TLS file that
  // cannot be read or used, named in the message).
  static absl::StatusOr<std::unique_ptr<RedisCluster>> Create(RedisClusterOptions options);
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // Runs `commands`, pipelined per node, following redirections. One result per
  // command, in order: its reply (an error reply other than a redirection is a reply),
  // or Unavailable when its node could not be reached, timed out, or it ran out of
  // redirections.
  std::vector<absl::StatusOr<RedisReplyPtr>> Execute(absl::Span<const RedisCommand> commands);
  absl::StatusOr<RedisReplyPtr> ExecuteOne(const RedisCommand& command);

  // Reads the slot map from the first node that answers (known masters, then seeds).
  // Returns: Ok, Unavailable.
  absl::Status Refresh();
  // The masters serving slots, from a slot map read afresh (Refresh), for commands that
  // must reach every master and are not routed by key (SCAN): the cached map misses a
  // master that joined, or took slots, since it was read. Returns: Ok, Unavailable (no
  // node answered).
  absl::StatusOr<std::vector<RedisEndpoint>> Masters();
  // One command on one node, over its pool: not routed by key, no redirection followed.
  // An error reply is a reply. Returns: Ok, Unavailable.
  absl::StatusOr<RedisReplyPtr> CallOn(const RedisEndpoint& node,
                                       absl::Span<const absl::string_view> argv);
  // Whether every node the slot map routes to answers: PING to each master of the
  // cached map (read afresh first when it leaves slots without a master), in turn,
  // stopping at the first that fails (which refreshes the map, as a failed command
  // does, so a failover is seen by the next call). A health probe: one node answering
  // says nothing of the others. Returns: Ok, Unavailable (a slot with no master, or a
  // master that did not answer PONG: named).
  absl::Status PingMasters();

  RedisClusterStats stats() const;
  // Connections open (idle or in use) in the client's pool for `node`; 0 when it keeps
  // no pool for it (a node that left the slot map).
  int OpenConnections(const RedisEndpoint& node) const;

 private:
  RedisCluster(RedisClusterOptions options, std::shared_ptr<const RedisTlsContext> tls);
  using PoolPtr = std::shared_ptr<RedisNodePool>;
  PoolPtr PoolFor(const RedisEndpoint& endpoint) ABSL_LOCKS_EXCLUDED(mu_);
  PoolPtr PoolForLocked(const RedisEndpoint& endpoint) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PoolPtr PoolForSlot(int slot) ABSL_LOCKS_EXCLUDED(mu_);
  void SetSlot(int slot, const RedisEndpoint& endpoint) ABSL_LOCKS_EXCLUDED(mu_);
  // Refresh, unless one ran within min_refresh_interval. `failed`: nodes that just
  // failed to answer, which the refresh does not ask (each would cost a full timeout
  // again, on the caller's thread).
  void MaybeRefresh(absl::Span<RedisNodePool* const> failed = {});
  absl::Status RefreshExcept(absl::Span<RedisNodePool* const> failed);
  // Reads the slot map from `pool`'s node; on success installs it and drops the pools
  // of nodes neither in it nor seeds.
  absl::Status RefreshFrom(RedisNodePool* pool);
  // One command on `pool`'s node (sent again on a new connection when the idle one
  // taken had been closed by the server), counting a failure as an I/O failure.
  // Returns: Ok, Unavailable, ResourceExhausted (every connection busy: not counted).
  absl::StatusOr<RedisReplyPtr> CallPool(RedisNodePool* pool,
                                         absl::Span<const absl::string_view> argv);

  const RedisClusterOptions options_;
  RedisNodePoolOptions pool_options_;
  const absl::flat_hash_set<std::string> seed_names_;  // Seeds' ToString(): kept pooled.
  mutable absl::Mutex mu_;
  // The pools, by endpoint (ToString). Shared: a caller holds its own reference while it
  // uses one (Execute, CallOn, PingMasters, a refresh), so a pool dropped here when its
  // node leaves the map lives until the last such caller lets go, then closes its
  // connections.
  absl::flat_hash_map<std::string, PoolPtr> by_endpoint_ ABSL_GUARDED_BY(mu_);
  std::array<PoolPtr, kRedisClusterSlots> slots_ ABSL_GUARDED_BY(mu_){};
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::atomic<bool> refreshing_{false};  // MaybeRefresh runs one at a time.

  std::atomic<uint64_t> moved_{0};
  std::atomic<uint64_t> ask_{0};
  std::atomic<uint64_t> retried_{0};
  std::atomic<uint64_t> refreshes_{0};
  std::atomic<uint64_t> refresh_failures_{0};
  std::atomic<uint64_t> refresh_node_failures_{0};
  std::atomic<uint64_t> io_failures_{0};
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_REDIS_CLUSTER_H_
