#include "tests/support/redis_cluster_process.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tests/support/daemon_process.h"

namespace kvtier::testing {
namespace {

constexpr const char* kServer = "/usr/bin/redis-server";
constexpr const char* kCli = "/usr/bin/redis-cli";

bool PortBindable(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  return ok;
}

// A port p with p and p + 10000 (the cluster bus) free.
int FreeClusterPort() {
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int p = FreePort();
    if (p > 0 && p + 10000 < 65536 && PortBindable(p + 10000)) return p;
    // Ephemeral ports are high: try a lower one derived from it.
    const int low = 20000 + (p % 30000);
    if (PortBindable(low) && PortBindable(low + 10000)) return low;
  }
  return -1;
}

template <typename Pred>
bool WaitFor(Pred pred, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

}  // namespace

absl::StatusOr<std::string> MakeRedisTestCerts() {
  const std::string dir = MakeTempDir("redis-certs");
  CommandResult made = RunCommand({"/bin/bash", KVTIER_CERT_SCRIPT, dir});
  if (made.exit_code != 0) {
    return absl::UnavailableError(absl::StrCat(KVTIER_CERT_SCRIPT, ": ", made.output));
  }
  return dir;
}

bool RedisClusterProcess::Available() {
  return access(kServer, X_OK) == 0 && access(kCli, X_OK) == 0;
}

absl::StatusOr<std::unique_ptr<RedisClusterProcess>> RedisClusterProcess::Start(
    RedisClusterSpec spec) {
  if (!Available()) return absl::UnavailableError("redis-server/redis-cli not installed");
  std::unique_ptr<RedisClusterProcess> c(new RedisClusterProcess(std::move(spec)));
  if (!c->spec_.tls_dir.empty()) {
    auto tls = RedisTlsContext::Create(c->ClientTls());
    if (!tls.ok()) return absl::UnavailableError(absl::StrCat("tls_dir: ", tls.status().message()));
    c->tls_ = *std::move(tls);
  }
  const int n = c->spec_.masters * (1 + c->spec_.replicas_per_master);
  for (int i = 0; i < n; ++i) {
    c->nodes_.emplace_back();
    if (absl::Status s = c->LaunchOnAFreePort(i); !s.ok()) return s;
  }
  std::vector<std::string> create = {kCli};
  const std::vector<std::string> flags = c->CliFlags();
  create.insert(create.end(), flags.begin(), flags.end());
  create.insert(create.end(), {"--cluster", "create"});
  for (const Node& node : c->nodes_) create.push_back(absl::StrCat("127.0.0.1:", node.port));
  create.insert(create.end(), {"--cluster-replicas",
                               std::to_string(c->spec_.replicas_per_master), "--cluster-yes"});
  CommandResult created = RunCommand(create);
  if (created.exit_code != 0) {
    return absl::UnavailableError(absl::StrCat("redis-cli --cluster create: ", created.output));
  }
  if (absl::Status s = c->WaitHealthy(); !s.ok()) return s;
  return c;
}

std::vector<std::string> RedisClusterProcess::CliFlags() const {
  std::vector<std::string> flags;
  if (!spec_.password.empty()) flags.insert(flags.end(), {"-a", spec_.password, "--no-auth-warning"});
  if (tls_ != nullptr) {
    const RedisTls tls = ClientTls();
    flags.insert(flags.end(), {"--tls", "--cacert", tls.ca_file, "--cert", tls.cert_file,
                               "--key", tls.key_file});
  }
  return flags;
}

RedisTls RedisClusterProcess::ClientTls() const {
  RedisTls tls;
  if (spec_.tls_dir.empty()) return tls;
  tls.enabled = true;
  tls.ca_file = spec_.tls_dir + "/ca.pem";
  tls.cert_file = spec_.tls_dir + "/client-a.pem";
  tls.key_file = spec_.tls_dir + "/client-a.key";
  return tls;
}

absl::Status RedisClusterProcess::Launch(int i) {
  Node& node = nodes_[i];
  std::vector<std::string> args = {kServer};
  if (spec_.tls_dir.empty()) {
    args.insert(args.end(), {"--port", std::to_string(node.port)});
  } else {
    // TLS only: no plaintext port. With tls-cluster the node announces its TLS port
    // (CLUSTER SLOTS, MOVED) and its bus is that port + 10000, over TLS too; the
    // server certificate doubles as the client certificate towards other nodes.
    const std::string& d = spec_.tls_dir;
    args.insert(args.end(), {"--port", "0",
                             "--tls-port", std::to_string(node.port),
                             "--tls-cluster", "yes",
                             "--tls-replication", "yes",
                             "--tls-cert-file", d + "/server.pem",
                             "--tls-key-file", d + "/server.key",
                             "--tls-ca-cert-file", d + "/ca.pem",
                             "--tls-auth-clients", spec_.tls_auth_clients ? "yes" : "no"});
  }
  args.insert(args.end(), {"--bind", "127.0.0.1",
                           "--dir", node.dir,
                           "--cluster-enabled", "yes",
                           "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "1000",
                           // A replica takes over however long it was cut off.
                           "--cluster-replica-validity-factor", "0",
                           "--save", "",
                           "--appendonly", "no",
                           "--protected-mode", "no",
                           "--daemonize", "no",
                           "--logfile", node.dir + "/redis.log"});
  if (!spec_.password.empty()) {
    args.insert(args.end(), {"--requirepass", spec_.password, "--masterauth", spec_.password});
  }
  args.insert(args.end(), spec_.extra_args.begin(), spec_.extra_args.end());
  const pid_t parent = getpid();
  const bool from_main_thread = static_cast<pid_t>(syscall(SYS_gettid)) == parent;
  const pid_t pid = fork();
  if (pid < 0) return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    if (from_main_thread) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
    }
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDIN_FILENO);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  node.pid = pid;
  // Up when the server on its port says it is this process: the port was free when it
  // was picked, but another test's server may have taken it since (then this one
  // exits, failing to bind, and what answers there is the other).
  bool exited = false;
  const std::string ours = absl::StrCat("process_id:", pid, "\r\n");
  const bool up = WaitFor([&] {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      return true;
    }
    auto info = Call(i, {"INFO", "server"});
    return info.ok() && absl::StrContains(ReplyString(**info), ours);
  }, 30);
  if (!up || exited) {
    if (!exited) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    node.pid = -1;
    return absl::AbortedError(absl::StrCat("redis-server on port ", node.port,
                                           " did not start; see ", node.dir, "/redis.log"));
  }
  return absl::OkStatus();
}

RedisClusterProcess::~RedisClusterProcess() {
  for (int i = 0; i < size(); ++i) Kill(i);
}

RedisEndpoint RedisClusterProcess::endpoint(int node) const {
  return RedisEndpoint{"127.0.0.1", nodes_[node].port};
}

std::vector<RedisEndpoint> RedisClusterProcess::Seeds() const {
  std::vector<RedisEndpoint> out;
  for (int i = 0; i < size(); ++i) out.push_back(endpoint(i));
  return out;
}

std::string RedisClusterProcess::SeedList() const {
  std::vector<std::string> parts;
  for (const Node& n : nodes_) parts.push_back(absl::StrCat("127.0.0.1:", n.port));
  return absl::StrJoin(parts, ",");
}

void RedisClusterProcess::Kill(int i) {
  Node& node = nodes_[i];
  if (node.pid <= 0) return;
  kill(node.pid, SIGCONT);
  kill(node.pid, SIGKILL);
  waitpid(node.pid, nullptr, 0);
  node.pid = -1;
}

void RedisClusterProcess::Pause(int i) {
  if (nodes_[i].pid > 0) kill(nodes_[i].pid, SIGSTOP);
}

void RedisClusterProcess::Resume(int i) {
  if (nodes_[i].pid > 0) kill(nodes_[i].pid, SIGCONT);
}

absl::Status RedisClusterProcess::Restart(int i) {
  if (nodes_[i].pid > 0) return absl::FailedPreconditionError("node still running");
  return Launch(i);
}

absl::Status RedisClusterProcess::LaunchOnAFreePort(int i) {
  absl::Status s;
  // A port found free can be taken by another test before the server binds it: then
  // another port.
  for (int attempt = 0; attempt < 5; ++attempt) {
    nodes_[i].port = FreeClusterPort();
    if (nodes_[i].port < 0) return absl::UnavailableError("no free port pair for a redis node");
    nodes_[i].dir = MakeTempDir("redis-node");
    s = Launch(i);
    if (!absl::IsAborted(s)) return s;
  }
  return s;
}

absl::StatusOr<int> RedisClusterProcess::AddMaster() {
  nodes_.emplace_back();
  const int added = size() - 1;
  if (absl::Status s = LaunchOnAFreePort(added); !s.ok()) return s;
  int existing = -1;
  for (int i = 0; i < added && existing < 0; ++i) existing = alive(i) ? i : -1;
  if (existing < 0) return absl::UnavailableError("no live node to join");
  std::vector<std::string> add = {kCli};
  const std::vector<std::string> flags = CliFlags();
  add.insert(add.end(), flags.begin(), flags.end());
  add.insert(add.end(), {"--cluster", "add-node", absl::StrCat("127.0.0.1:", nodes_[added].port),
                         absl::StrCat("127.0.0.1:", nodes_[existing].port)});
  CommandResult r = RunCommand(add);
  if (r.exit_code != 0) {
    return absl::UnavailableError(absl::StrCat("redis-cli --cluster add-node: ", r.output));
  }
  auto id = Call(added, {"CLUSTER", "MYID"});
  if (!id.ok()) return id.status();
  const std::string added_id(ReplyString(**id));
  // The join spreads by gossip: SETSLOT NODE on a node that has not heard of it fails.
  const bool known = WaitFor([&] {
    for (int i = 0; i < added; ++i) {
      if (!alive(i)) continue;
      auto nodes = Call(i, {"CLUSTER", "NODES"});
      if (!nodes.ok() || !absl::StrContains(ReplyString(**nodes), added_id)) return false;
    }
    return true;
  }, 60);
  if (!known) return absl::DeadlineExceededError("the added node was not known to all in 60 s");
  if (absl::Status s = WaitHealthy(); !s.ok()) return s;
  return added;
}

absl::Status RedisClusterProcess::MoveEmptySlot(int slot, int to) {
  auto from = MasterOf(slot);
  if (!from.ok()) return from.status();
  auto id_of = [&](int node) -> absl::StatusOr<std::string> {
    auto r = Call(node, {"CLUSTER", "MYID"});
    if (!r.ok()) return r.status();
    return std::string(ReplyString(**r));
  };
  auto from_id = id_of(*from);
  auto to_id = id_of(to);
  if (!from_id.ok()) return from_id.status();
  if (!to_id.ok()) return to_id.status();
  const std::string s = std::to_string(slot);
  auto run = [&](int node, const std::vector<std::string>& argv) -> absl::Status {
    auto r = Call(node, argv);
    if (!r.ok()) return r.status();
    if (IsErrorReply(**r)) {
      return absl::FailedPreconditionError(
          absl::StrCat("node ", node, ": ", absl::StrJoin(argv, " "), ": ", ReplyString(**r)));
    }
    return absl::OkStatus();
  };
  if (absl::Status st = run(to, {"CLUSTER", "SETSLOT", s, "IMPORTING", *from_id}); !st.ok()) return st;
  if (absl::Status st = run(*from, {"CLUSTER", "SETSLOT", s, "MIGRATING", *to_id}); !st.ok()) return st;
  // The new owner first: it bumps its config epoch, so gossip cannot undo the move.
  if (absl::Status st = run(to, {"CLUSTER", "SETSLOT", s, "NODE", *to_id}); !st.ok()) return st;
  for (int i = 0; i < size(); ++i) {
    if (i == to || !alive(i)) continue;
    auto role = Call(i, {"ROLE"});
    if (!role.ok()) return role.status();
    if (ReplyString(*(*role)->element[0]) != "master") continue;
    if (absl::Status st = run(i, {"CLUSTER", "SETSLOT", s, "NODE", *to_id}); !st.ok()) return st;
  }
  // Until every node has seen the new owner's claim, some answer CLUSTERDOWN.
  return WaitHealthy();
}

absl::StatusOr<RedisReplyPtr> RedisClusterProcess::Call(int i,
                                                        const std::vector<std::string>& argv) {
  RedisAuth auth;
  auth.password = spec_.password;
  auto conn = RedisConnection::Connect(endpoint(i), auth, absl::Seconds(1), absl::Seconds(5),
                                       tls_.get());
  if (!conn.ok()) return conn.status();
  std::vector<absl::string_view> views(argv.begin(), argv.end());
  return (*conn)->Call(views);
}

absl::Status RedisClusterProcess::WaitReplicated(int node) {
  for (int attempt = 0; attempt < 60; ++attempt) {
    auto w = Call(node, {"WAIT", "1", "1000"});
    if (!w.ok()) return w.status();
    if ((*w)->type == REDIS_REPLY_INTEGER && (*w)->integer >= 1) return absl::OkStatus();
  }
  return absl::DeadlineExceededError(
      absl::StrCat("node ", node, ": no replica acknowledged its writes in 60 s"));
}

int RedisClusterProcess::NodeOnPort(int port) const {
  for (int i = 0; i < size(); ++i) {
    if (nodes_[i].port == port) return i;
  }
  return -1;
}

absl::StatusOr<int> RedisClusterProcess::MasterOf(int slot) {
  for (int i = 0; i < size(); ++i) {
    if (!alive(i)) continue;
    auto reply = Call(i, {"CLUSTER", "SLOTS"});
    if (!reply.ok() || (*reply)->type != REDIS_REPLY_ARRAY) continue;
    for (size_t k = 0; k < (*reply)->elements; ++k) {
      const redisReply* e = (*reply)->element[k];
      if (e->element[0]->integer <= slot && slot <= e->element[1]->integer) {
        return NodeOnPort(static_cast<int>(e->element[2]->element[1]->integer));
      }
    }
    return absl::NotFoundError(absl::StrCat("slot ", slot, " has no master"));
  }
  return absl::UnavailableError("no live node answered");
}

absl::Status RedisClusterProcess::WaitHealthy() {
  const bool ok = WaitFor([&] {
    for (int i = 0; i < size(); ++i) {
      if (!alive(i)) continue;
      auto info = Call(i, {"CLUSTER", "INFO"});
      if (!info.ok()) return false;
      const absl::string_view text = ReplyString(**info);
      if (!absl::StrContains(text, "cluster_state:ok") ||
          !absl::StrContains(text, "cluster_slots_fail:0") ||
          !absl::StrContains(text, "cluster_slots_pfail:0")) {
        return false;
      }
    }
    // Every slot's master is alive, and replicas are attached (a failover needs one).
    for (int slot : {0, 8000, 16383}) {
      auto m = MasterOf(slot);
      if (!m.ok() || *m < 0 || !alive(*m)) return false;
    }
    if (spec_.replicas_per_master > 0) {
      for (int i = 0; i < size(); ++i) {
        if (!alive(i)) continue;
        auto repl = Call(i, {"INFO", "replication"});
        if (!repl.ok()) return false;
        const absl::string_view text = ReplyString(**repl);
        if (absl::StrContains(text, "role:master") &&
            absl::StrContains(text, "connected_slaves:0")) {
          // A master with no replica: fine only if no live node could be its replica.
          int live = 0;
          for (int k = 0; k < size(); ++k) live += alive(k) ? 1 : 0;
          if (live == size()) return false;
        }
      }
    }
    return true;
  }, 60);
  if (!ok) return absl::DeadlineExceededError("redis cluster did not become healthy in 60 s");
  return absl::OkStatus();
}

absl::Status RedisClusterProcess::FlushAll() {
  for (int i = 0; i < size(); ++i) {
    if (!alive(i)) continue;
    auto role = Call(i, {"ROLE"});
    if (!role.ok()) return role.status();
    if ((*role)->type == REDIS_REPLY_ARRAY && (*role)->elements > 0 &&
        ReplyString(*(*role)->element[0]) == "master") {
      auto r = Call(i, {"FLUSHALL"});
      if (!r.ok()) return r.status();
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier::testing
