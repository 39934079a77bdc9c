// RedisClusterProcess: a real Redis Cluster on loopback for tests and benchmarks: N
// masters with R replicas each (redis-server processes in temp directories, joined by
// `redis-cli --cluster create`), with hooks to kill and restart nodes and to wait until
// the cluster has healed. With a tls_dir the nodes speak only TLS (clients, cluster bus
// and replication), and everything the harness does goes over TLS with a client
// certificate.
//
// Thread-safety: not thread-safe; owned by one test or benchmark.
#ifndef KVTIER_TESTS_SUPPORT_REDIS_CLUSTER_PROCESS_H_
#define KVTIER_TESTS_SUPPORT_REDIS_CLUSTER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/redis/redis_connection.h"
#include "storage/redis/redis_tls_context.h"

namespace kvtier::testing {

struct RedisClusterSpec {
  int masters = 3;
  int replicas_per_master = 1;
  std::string password;  // requirepass and masterauth; empty for none.
  // Extra redis-server arguments for every node ("--maxmemory", "4mb", ...).
  std::vector<std::string> extra_args;
  // TLS: a directory made by tests/tls/make_test_certs.sh (MakeRedisTestCerts). The
  // nodes serve server.{pem,key} on their TLS port only (--port 0), trust ca.pem, and
  // use TLS between themselves; the harness's own connections and redis-cli present
  // client-a.{pem,key}. Empty: plaintext.
  std::string tls_dir;
  // With tls_dir: whether nodes require a client certificate (--tls-auth-clients).
  bool tls_auth_clients = true;
};

// Makes throwaway certificates (tests/tls/make_test_certs.sh) in a new temporary
// directory and returns it, for RedisClusterSpec::tls_dir. Errors: Unavailable.
absl::StatusOr<std::string> MakeRedisTestCerts();

class RedisClusterProcess {
 public:
  // Whether redis-server and redis-cli are installed (tests skip without them only
  // outside the project's test command, which installs them).
  static bool Available();
  // Starts the nodes, creates the cluster and waits until it is healthy (up to 60 s).
  // Errors: Unavailable.
  static absl::StatusOr<std::unique_ptr<RedisClusterProcess>> Start(RedisClusterSpec spec);
  ~RedisClusterProcess();  // SIGKILLs every node.

  int size() const { return static_cast<int>(nodes_.size()); }
  RedisEndpoint endpoint(int node) const;
  // Every node as "127.0.0.1:port", comma-separated (a --remote-seeds value).
  std::string SeedList() const;
  std::vector<RedisEndpoint> Seeds() const;
  // What a client needs to reach the nodes (RedisClusterOptions::tls): ca.pem and the
  // client-a certificate with a tls_dir; not enabled without one.
  RedisTls ClientTls() const;

  // SIGKILL (the node's process is gone at once) and SIGSTOP/SIGCONT (it hangs).
  void Kill(int node);
  void Pause(int node);
  void Resume(int node);
  // Starts a killed node again on its port and directory (it rejoins as it was).
  absl::Status Restart(int node);
  // Starts one more node and joins it to the cluster as a master serving no slots
  // (`redis-cli --cluster add-node`); returns its index once every node knows it and
  // the cluster is healthy.
  // Errors: Unavailable, DeadlineExceeded.
  absl::StatusOr<int> AddMaster();
  // Hands `slot`, which must hold no keys, to master `to` the way a resharding does
  // (IMPORTING/MIGRATING, then SETSLOT NODE on the new owner first, then on every other
  // master), then waits until the cluster is healthy. Errors: Unavailable,
  // FailedPrecondition (a node refused), DeadlineExceeded.
  absl::Status MoveEmptySlot(int slot, int to);
  bool alive(int node) const { return nodes_[node].pid > 0; }

  // Waits (up to 60 s) until every live node says cluster_state:ok with all slots
  // served by live masters. Errors: DeadlineExceeded.
  absl::Status WaitHealthy();
  // The node now master for `slot`. Errors: NotFound, Unavailable.
  absl::StatusOr<int> MasterOf(int slot);
  // A command on one node, through a direct connection. Errors: Unavailable.
  absl::StatusOr<RedisReplyPtr> Call(int node, const std::vector<std::string>& argv);
  // FLUSHALL on every live master.
  absl::Status FlushAll();
  // Waits (up to 60 s) until a replica of master `node` has acknowledged its writes so
  // far (WAIT 1, a second at a time: one long WAIT raced the connection's 5 s read
  // timeout on a busy machine). Errors: DeadlineExceeded, Unavailable.
  absl::Status WaitReplicated(int node);

 private:
  struct Node {
    int port = 0;
    std::string dir;
    pid_t pid = -1;
  };
  explicit RedisClusterProcess(RedisClusterSpec spec) : spec_(std::move(spec)) {}
  // Aborted: the server did not start (its port taken, say), or what answers on its
  // port is not it.
  absl::Status Launch(int node);
  // Launch on a newly picked port pair, picking again (a few times) when it is Aborted.
  absl::Status LaunchOnAFreePort(int node);
  int NodeOnPort(int port) const;
  // redis-cli's flags for reaching the nodes (TLS and password).
  std::vector<std::string> CliFlags() const;

  RedisClusterSpec spec_;
  std::shared_ptr<RedisTlsContext> tls_;  // From ClientTls(); null for plaintext.
  std::vector<Node> nodes_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_REDIS_CLUSTER_PROCESS_H_
