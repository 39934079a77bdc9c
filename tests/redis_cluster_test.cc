// RedisCluster against a real Redis Cluster on loopback (three masters, three
// replicas): routing and pipelining over every master, MOVED after a slot moved, ASK
// mid-migration, a killed master and the failover, a hung node and the I/O timeout, and
// AUTH. Then a TLS-only cluster (mutual TLS, certificates from
// tests/tls/make_test_certs.sh): pipelining through TLS, and each way a client is
// refused (no client certificate, another CA, a wrong server name, plaintext), plus the
// TLS options' validation.
#include "storage/redis/redis_cluster.h"

#include <hiredis/hiredis.h>
#include <sys/stat.h>

#include <set>
#include <string>
#include <vector>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "storage/redis/redis_tls_context.h"
#include "tests/support/daemon_process.h"
#include "tests/support/redis_cluster_process.h"

namespace kvtier {
namespace {

using testing::MakeRedisTestCerts;
using testing::RedisClusterProcess;
using testing::RedisClusterSpec;

// SETs every key to its value in one pipelined batch, then GETs them all back in
// another, expecting OK and each value (compared as bytes: some are megabytes).
void SetThenGet(RedisCluster& client, const std::vector<std::string>& keys,
                const std::vector<std::string>& values) {
  std::vector<RedisCommand> sets, gets;
  for (size_t i = 0; i < keys.size(); ++i) {
    sets.push_back({{"SET", keys[i], values[i]}, keys[i]});
    gets.push_back({{"GET", keys[i]}, keys[i]});
  }
  for (auto& r : client.Execute(sets)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ReplyString(**r), "OK");
  }
  auto got = client.Execute(gets);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_TRUE(ReplyString(**got[i]) == values[i]) << keys[i];
  }
}

// Closes every client connection of every live node but the one asking, the way a
// server's `timeout` closes idle clients: a pooled connection's next command meets EOF.
void CloseClientConnections(RedisClusterProcess& cluster) {
  for (int i = 0; i < cluster.size(); ++i) {
    if (!cluster.alive(i)) continue;
    auto r = cluster.Call(i, {"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ((*r)->type, REDIS_REPLY_INTEGER) << ReplyString(**r);
  }
}

// Idle pooled connections the servers closed: every call that meets one sends its
// commands again on a new connection, once, instead of failing (a pipeline, one
// command on a node, a topology read).
void ClosedIdleConnectionsAreReplaced(RedisClusterProcess& cluster, RedisCluster& client,
                                      absl::string_view prefix) {
  std::vector<std::string> keys, values;
  for (int i = 0; i < 100; ++i) {
    keys.push_back(absl::StrCat(prefix, i));
    values.push_back(std::string(100 + i, static_cast<char>('a' + i % 26)));
  }
  ASSERT_NO_FATAL_FAILURE(SetThenGet(client, keys, values));  // Every master's pool.
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections(cluster));
  ASSERT_NO_FATAL_FAILURE(SetThenGet(client, keys, values));
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections(cluster));
  for (int slot : {0, 8000, 16383}) {
    auto m = cluster.MasterOf(slot);
    ASSERT_TRUE(m.ok());
    auto pong = client.CallOn(cluster.endpoint(*m), {"PING"});
    ASSERT_TRUE(pong.ok()) << pong.status();
    EXPECT_EQ(ReplyString(**pong), "PONG");
  }
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections(cluster));
  EXPECT_TRUE(client.Refresh().ok());
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections(cluster));
  EXPECT_TRUE(client.PingMasters().ok());
  const RedisClusterStats s = client.stats();
  EXPECT_EQ(s.io_failures, 0u);
  EXPECT_EQ(s.refresh_node_failures, 0u);
}

// What makes a pooled connection's commands go again: a server that closed it is told
// from a silent one (a hung node is not asked twice, each time waiting out the
// timeout), and no byte came back. `tls` null: plaintext.
void ClosedIsToldFromSilent(RedisClusterProcess& cluster, const RedisTlsContext* tls) {
  auto closed = RedisConnection::Connect(cluster.endpoint(0), {}, absl::Seconds(1),
                                         absl::Seconds(5), tls);
  ASSERT_TRUE(closed.ok()) << closed.status();
  ASSERT_TRUE((*closed)->Call({"PING"}).ok());
  const uint64_t received = (*closed)->bytes_received();
  EXPECT_GT(received, 0u);
  EXPECT_FALSE((*closed)->timed_out());
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections(cluster));
  EXPECT_FALSE((*closed)->Call({"PING"}).ok());
  EXPECT_TRUE((*closed)->broken());
  EXPECT_FALSE((*closed)->timed_out());
  EXPECT_EQ((*closed)->bytes_received(), received);

  auto silent = RedisConnection::Connect(cluster.endpoint(0), {}, absl::Seconds(1),
                                         absl::Milliseconds(200), tls);
  ASSERT_TRUE(silent.ok()) << silent.status();
  cluster.Pause(0);
  auto r = (*silent)->Call({"PING"});
  cluster.Resume(0);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE((*silent)->broken());
  EXPECT_TRUE((*silent)->timed_out());
}

class RedisClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!RedisClusterProcess::Available()) GTEST_SKIP() << "redis-server not installed";
    auto c = RedisClusterProcess::Start(Spec());
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }
  virtual RedisClusterSpec Spec() { return {}; }

  std::unique_ptr<RedisCluster> Client(absl::Duration io_timeout = absl::Seconds(2),
                                       std::string password = "") {
    RedisClusterOptions o;
    o.seeds = {cluster_->endpoint(0)};  // One seed: the rest is discovered.
    o.io_timeout = io_timeout;
    o.auth.password = std::move(password);
    o.min_refresh_interval = absl::ZeroDuration();
    auto c = RedisCluster::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }

  std::string NodeId(int node) {
    auto r = cluster_->Call(node, {"CLUSTER", "MYID"});
    EXPECT_TRUE(r.ok()) << r.status();
    return std::string(ReplyString(**r));
  }

  // Another master than `node`.
  int OtherMaster(int node) {
    for (int slot : {0, 8000, 16383}) {
      auto m = cluster_->MasterOf(slot);
      if (m.ok() && *m != node) return *m;
    }
    return -1;
  }

  std::unique_ptr<RedisClusterProcess> cluster_;
};

TEST_F(RedisClusterTest, PipelinesOverEveryMaster) {
  auto client = Client();
  EXPECT_EQ(client->stats().masters, 3u);
  EXPECT_EQ(client->stats().slots_covered, 16384u);
  std::vector<std::string> keys, values;
  for (int i = 0; i < 300; ++i) {
    keys.push_back(absl::StrCat("key-", i));
    values.push_back(std::string(1000 + i, static_cast<char>('a' + i % 26)));
  }
  ASSERT_NO_FATAL_FAILURE(SetThenGet(*client, keys, values));
  // The keys really are on all three masters, each holding its own share.
  std::set<int> masters;
  for (const std::string& k : keys) {
    auto m = cluster_->MasterOf(RedisHashSlot(k));
    ASSERT_TRUE(m.ok());
    masters.insert(*m);
  }
  EXPECT_EQ(masters.size(), 3u);
  EXPECT_EQ(client->stats().moved, 0u);
}

TEST_F(RedisClusterTest, AConnectionTheServerClosedWhileIdleIsReplaced) {
  auto client = Client();
  ClosedIdleConnectionsAreReplaced(*cluster_, *client, "idle-key-");
}

TEST_F(RedisClusterTest, AConnectionTellsAServerThatClosedItFromASilentOne) {
  ClosedIsToldFromSilent(*cluster_, nullptr);
}

TEST_F(RedisClusterTest, FollowsMovedAfterASlotMoves) {
  auto client = Client();
  const std::string key = "moving-key";
  const int slot = RedisHashSlot(key);
  auto src = cluster_->MasterOf(slot);
  ASSERT_TRUE(src.ok());
  const int dst = OtherMaster(*src);
  ASSERT_GE(dst, 0);
  // Move the (empty) slot; the client's map still says `src`.
  const std::string dst_id = NodeId(dst);
  for (int node : {*src, dst}) {
    auto r = cluster_->Call(node, {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", dst_id});
    ASSERT_TRUE(r.ok() && !IsErrorReply(**r)) << (r.ok() ? ReplyString(**r) : r.status().message());
  }
  auto set = client->ExecuteOne({{"SET", key, "v1"}, key});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(ReplyString(**set), "OK");
  EXPECT_GE(client->stats().moved, 1u);
  // It landed on the new owner, and the client now goes there directly.
  auto direct = cluster_->Call(dst, {"GET", key});
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(ReplyString(**direct), "v1");
  const uint64_t moved = client->stats().moved;
  auto get = client->ExecuteOne({{"GET", key}, key});
  ASSERT_TRUE(get.ok());
  EXPECT_EQ(ReplyString(**get), "v1");
  EXPECT_EQ(client->stats().moved, moved);
}

TEST_F(RedisClusterTest, FollowsAskDuringAMigration) {
  auto client = Client();
  const std::string migrated = "{mig}one", staying = "{mig}two";
  const int slot = RedisHashSlot(migrated);
  ASSERT_EQ(slot, RedisHashSlot(staying));
  auto src = cluster_->MasterOf(slot);
  ASSERT_TRUE(src.ok());
  const int dst = OtherMaster(*src);
  ASSERT_GE(dst, 0);
  ASSERT_TRUE(client->ExecuteOne({{"SET", migrated, "moved-value"}, migrated}).ok());
  ASSERT_TRUE(client->ExecuteOne({{"SET", staying, "staying-value"}, staying}).ok());
  // Half-way through a migration: one key on each side.
  const std::string s = std::to_string(slot);
  ASSERT_TRUE(cluster_->Call(dst, {"CLUSTER", "SETSLOT", s, "IMPORTING", NodeId(*src)}).ok());
  ASSERT_TRUE(cluster_->Call(*src, {"CLUSTER", "SETSLOT", s, "MIGRATING", NodeId(dst)}).ok());
  auto m = cluster_->Call(*src, {"MIGRATE", "127.0.0.1", std::to_string(cluster_->endpoint(dst).port),
                                 migrated, "0", "5000"});
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(ReplyString(**m), "OK");

  std::vector<RedisCommand> gets = {{{"GET", migrated}, migrated}, {{"GET", staying}, staying}};
  auto got = client->Execute(gets);
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  EXPECT_EQ(ReplyString(**got[0]), "moved-value");
  EXPECT_EQ(ReplyString(**got[1]), "staying-value");
  EXPECT_GE(client->stats().ask, 1u);
  EXPECT_EQ(client->stats().moved, 0u);  // ASK does not change the map.
}

TEST_F(RedisClusterTest, ReachesTheNewMasterAfterAFailover) {
  auto client = Client(absl::Milliseconds(500));
  std::vector<std::string> keys, values;
  for (int i = 0; i < 100; ++i) {
    keys.push_back(absl::StrCat("fo-", i));
    values.push_back("value-" + keys.back());
  }
  std::vector<RedisCommand> sets, gets;
  for (size_t i = 0; i < keys.size(); ++i) {
    sets.push_back({{"SET", keys[i], values[i]}, keys[i]});
    gets.push_back({{"GET", keys[i]}, keys[i]});
  }
  for (auto& r : client->Execute(sets)) ASSERT_TRUE(r.ok()) << r.status();
  // Replication is asynchronous: make sure the replicas have the keys before the kill.
  for (int i = 0; i < cluster_->size(); ++i) {
    auto role = cluster_->Call(i, {"ROLE"});
    ASSERT_TRUE(role.ok());
    if (ReplyString(*(*role)->element[0]) == "master") {
      const absl::Status replicated = cluster_->WaitReplicated(i);
      ASSERT_TRUE(replicated.ok()) << replicated;
    }
  }
  auto victim = cluster_->MasterOf(RedisHashSlot(keys[0]));
  ASSERT_TRUE(victim.ok());
  cluster_->Kill(*victim);
  // Commands for the dead master fail (Unavailable), never hang or answer wrongly.
  auto during = client->ExecuteOne(gets[0]);
  if (during.ok()) {
    // The failover may already be complete, and the refresh found the new master.
    EXPECT_EQ(ReplyString(**during), "value-" + keys[0]);
  } else {
    EXPECT_EQ(during.status().code(), absl::StatusCode::kUnavailable);
  }
  ASSERT_TRUE(cluster_->WaitHealthy().ok());  // A replica took over.
  // Within a few refreshes the client follows the new topology; every key is there.
  std::string last;
  ASSERT_TRUE(testing::Eventually([&] {
    auto r = client->ExecuteOne(gets[0]);
    last = r.ok() ? std::string(ReplyString(**r)) : r.status().ToString();
    return r.ok() && ReplyString(**r) == "value-" + keys[0];
  })) << last << " refreshes " << client->stats().refreshes << " failed "
      << client->stats().refresh_failures;
  auto got = client->Execute(gets);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << keys[i] << ": " << got[i].status();
    EXPECT_EQ(ReplyString(**got[i]), "value-" + keys[i]);
  }
  EXPECT_GE(client->stats().io_failures, 1u);
  // The old master comes back as a replica of its successor.
  ASSERT_TRUE(cluster_->Restart(*victim).ok());
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  auto role = cluster_->Call(*victim, {"ROLE"});
  ASSERT_TRUE(role.ok());
  EXPECT_EQ(ReplyString(*(*role)->element[0]), "slave");
}

TEST_F(RedisClusterTest, AHungNodeTimesOutInsteadOfBlocking) {
  auto client = Client(absl::Milliseconds(200));
  const std::string key = "hung-key";
  ASSERT_TRUE(client->ExecuteOne({{"SET", key, "x"}, key}).ok());
  auto master = cluster_->MasterOf(RedisHashSlot(key));
  ASSERT_TRUE(master.ok());
  cluster_->Pause(*master);
  auto r = client->ExecuteOne({{"GET", key}, key});
  cluster_->Resume(*master);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  // The connection that timed out is not reused (its reply would answer the next
  // command): after the node resumes, a fresh one gives the right answer.
  ASSERT_TRUE(testing::Eventually([&] {
    auto again = client->ExecuteOne({{"GET", key}, key});
    return again.ok() && ReplyString(**again) == "x";
  }));
}

// The nodes that just failed a batch are not asked for the topology right after it:
// with every master hung, a batch waited out the timeout once per master for its
// replies, then once per master again in the refresh, on the caller's thread (12 s at a
// 2 s timeout with three masters).
TEST_F(RedisClusterTest, ARefreshAfterFailuresDoesNotAskTheNodesThatFailed) {
  auto client = Client(absl::Milliseconds(200));
  std::vector<std::string> keys;  // One on each master.
  std::set<int> masters;
  for (int i = 0; keys.size() < 3 && i < 10000; ++i) {
    std::string k = absl::StrCat("refresh-", i);
    auto m = cluster_->MasterOf(RedisHashSlot(k));
    ASSERT_TRUE(m.ok());
    if (masters.insert(*m).second) keys.push_back(std::move(k));
  }
  ASSERT_EQ(keys.size(), 3u);
  std::vector<RedisCommand> gets;
  for (const std::string& k : keys) {
    ASSERT_TRUE(client->ExecuteOne({{"SET", k, "x"}, k}).ok());
    gets.push_back({{"GET", k}, k});
  }
  const uint64_t refresh_failures = client->stats().refresh_failures;
  for (int m : masters) cluster_->Pause(m);
  auto replies = client->Execute(gets);
  for (int m : masters) cluster_->Resume(m);
  for (const auto& r : replies) EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client->stats().refresh_node_failures, 0u) << "a node that had just failed was asked";
  EXPECT_EQ(client->stats().refresh_failures, refresh_failures + 1);  // It was attempted.
  // Once they answer again, the map comes back and the keys read.
  ASSERT_TRUE(testing::Eventually([&] {
    auto again = client->ExecuteOne(gets[0]);
    return again.ok() && ReplyString(**again) == "x";
  }));
}

// A node the client learned (here through MOVED) that then leaves the slot map keeps no
// pool once a refresh succeeds, and a later refresh does not ask it. Pools were never
// removed: in Kubernetes each pod back under a new address left one behind, its idle
// connections holding their sockets and read buffers for good, and a refresh during an
// outage tried every departed node in turn (a connect timeout each) after the masters.
class RedisClusterNoReplicasTest : public RedisClusterTest {
 protected:
  // AddMaster's node has no replica, which the harness counts unhealthy beside masters
  // that have one.
  RedisClusterSpec Spec() override {
    RedisClusterSpec s;
    s.replicas_per_master = 0;
    return s;
  }
};

TEST_F(RedisClusterNoReplicasTest, ANodeThatLeftTheMapKeepsNoPoolAndIsNotAskedAgain) {
  auto client = Client(absl::Milliseconds(200));
  auto role = cluster_->Call(0, {"ROLE"});
  ASSERT_TRUE(role.ok());
  ASSERT_EQ(ReplyString(*(*role)->element[0]), "master");  // The seed: always pooled.
  auto added = cluster_->AddMaster();
  ASSERT_TRUE(added.ok()) << added.status();
  const int joined = *added;
  const RedisEndpoint departing = cluster_->endpoint(joined);
  const std::string key = "departing-key";
  const int slot = RedisHashSlot(key);
  auto owner = cluster_->MasterOf(slot);
  ASSERT_TRUE(owner.ok());
  ASSERT_TRUE(cluster_->MoveEmptySlot(slot, joined).ok());
  // The client's map still says `owner`: MOVED sends the GET to the new node.
  auto get = client->ExecuteOne({{"GET", key}, key});
  ASSERT_TRUE(get.ok()) << get.status();
  EXPECT_EQ((*get)->type, REDIS_REPLY_NIL);
  EXPECT_EQ(client->stats().moved, 1u);
  EXPECT_EQ(client->OpenConnections(departing), 1);
  EXPECT_EQ(client->stats().nodes, 4u);

  // The slot goes back; the new node serves none and leaves the map.
  ASSERT_TRUE(cluster_->MoveEmptySlot(slot, *owner).ok());
  ASSERT_TRUE(client->Refresh().ok());
  EXPECT_EQ(client->stats().masters, 3u);
  EXPECT_EQ(client->OpenConnections(departing), 0);
  EXPECT_EQ(client->stats().nodes, 3u);  // The masters; the seed is one.

  // The node goes for good, then every master hangs: a refresh asks the three masters
  // (each failing at the timeout) and nothing else.
  cluster_->Kill(joined);
  std::set<int> masters;
  for (int s : {0, 8000, 16383}) {
    auto m = cluster_->MasterOf(s);
    ASSERT_TRUE(m.ok());
    masters.insert(*m);
  }
  ASSERT_EQ(masters.size(), 3u);
  const uint64_t node_failures = client->stats().refresh_node_failures;
  for (int m : masters) cluster_->Pause(m);
  const absl::Status refreshed = client->Refresh();
  for (int m : masters) cluster_->Resume(m);
  EXPECT_EQ(refreshed.code(), absl::StatusCode::kUnavailable) << refreshed;
  EXPECT_EQ(client->stats().refresh_node_failures - node_failures, 3u)
      << "a node that left the map was asked";
  EXPECT_EQ(client->OpenConnections(departing), 0);
}

// Nodes read after a hung one get less than the whole timeout for their first bytes
// (they had it already, while the hung one was waited on). Their answers are there by
// then: each master hung in turn, the others' 4 MiB replies still read whole.
TEST_F(RedisClusterTest, NodesReadAfterAHungOneStillAnswer) {
  auto client = Client(absl::Milliseconds(300));
  std::vector<std::string> keys;
  std::vector<int> master_of;
  std::set<int> masters;
  for (int i = 0; keys.size() < 3 && i < 10000; ++i) {
    std::string k = absl::StrCat("after-hung-", i);
    auto m = cluster_->MasterOf(RedisHashSlot(k));
    ASSERT_TRUE(m.ok());
    if (masters.insert(*m).second) {
      keys.push_back(std::move(k));
      master_of.push_back(*m);
    }
  }
  ASSERT_EQ(keys.size(), 3u);
  std::vector<std::string> values;
  std::vector<RedisCommand> gets;
  for (size_t i = 0; i < keys.size(); ++i) {
    values.push_back(std::string(4 << 20, static_cast<char>('a' + i)));
    ASSERT_TRUE(client->ExecuteOne({{"SET", keys[i], values[i]}, keys[i]}).ok());
    gets.push_back({{"GET", keys[i]}, keys[i]});
  }
  for (size_t hung = 0; hung < keys.size(); ++hung) {
    cluster_->Pause(master_of[hung]);
    auto replies = client->Execute(gets);
    cluster_->Resume(master_of[hung]);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i == hung) {
        EXPECT_EQ(replies[i].status().code(), absl::StatusCode::kUnavailable) << hung;
      } else {
        ASSERT_TRUE(replies[i].ok()) << "hung " << hung << ", key " << i << ": "
                                     << replies[i].status();
        EXPECT_TRUE(ReplyString(**replies[i]) == values[i]) << hung << " " << i;
      }
    }
    // The map is back before the next round.
    ASSERT_TRUE(testing::Eventually([&] { return client->ExecuteOne(gets[hung]).ok(); }));
  }
}

// A node whose connections are all in use by this daemon's other calls is busy, not
// failed: ResourceExhausted. It was Unavailable, which the remote tier counts as the
// cluster failing: under load it degraded itself, dropping writes and missing reads.
TEST_F(RedisClusterTest, AllConnectionsBusyIsResourceExhaustedNotAFailedNode) {
  RedisNodePoolOptions o;
  o.max_connections = 1;
  o.wait = absl::ZeroDuration();
  RedisNodePool pool(cluster_->endpoint(0), o);
  auto held = pool.Acquire();
  ASSERT_TRUE(held.ok()) << held.status();
  auto busy = pool.Acquire();
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kResourceExhausted) << busy.status();
  EXPECT_EQ(pool.connect_failures(), 0u);
  pool.Release(*std::move(held));
  auto again = pool.Acquire();
  ASSERT_TRUE(again.ok()) << again.status();
  pool.Release(*std::move(again));
}

class RedisClusterAuthTest : public RedisClusterTest {
 protected:
  RedisClusterSpec Spec() override {
    RedisClusterSpec s;
    s.password = "s3cret";
    return s;
  }
};

TEST_F(RedisClusterAuthTest, SendsAuthAndReportsARefusal) {
  auto good = Client(absl::Seconds(2), "s3cret");
  EXPECT_EQ(good->stats().slots_covered, 16384u);
  auto set = good->ExecuteOne({{"SET", "k", "v"}, "k"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(ReplyString(**set), "OK");

  auto bad = Client(absl::Seconds(2), "wrong");
  EXPECT_EQ(bad->stats().slots_covered, 0u);
  auto refused = bad->ExecuteOne({{"GET", "k"}, "k"});
  EXPECT_FALSE(refused.ok());
  EXPECT_GE(bad->stats().refresh_failures, 1u);

  auto none = Client(absl::Seconds(2), "");
  EXPECT_EQ(none->stats().slots_covered, 0u);  // NOAUTH to CLUSTER SLOTS.
}

// A TLS-only cluster (--port 0), three masters, requiring client certificates; shared
// by the tests below, which only read and write keys.
class RedisClusterTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!RedisClusterProcess::Available()) return;
    auto certs = MakeRedisTestCerts();
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = new std::string(*certs);
    RedisClusterSpec spec;
    spec.replicas_per_master = 0;
    spec.tls_dir = *certs_;
    spec.tls_auth_clients = true;
    auto c = RedisClusterProcess::Start(spec);
    ASSERT_TRUE(c.ok()) << c.status();
    shared_ = c->release();
  }
  static void TearDownTestSuite() {
    delete shared_;
    shared_ = nullptr;
    delete certs_;
    certs_ = nullptr;
  }
  void SetUp() override {
    if (!RedisClusterProcess::Available()) GTEST_SKIP() << "redis-server not installed";
    ASSERT_NE(shared_, nullptr);
    cluster_ = shared_;
  }

  std::unique_ptr<RedisCluster> Client(const RedisTls& tls,
                                       absl::Duration io_timeout = absl::Seconds(2)) {
    RedisClusterOptions o;
    o.seeds = {cluster_->endpoint(0)};
    o.tls = tls;
    o.io_timeout = io_timeout;
    o.min_refresh_interval = absl::ZeroDuration();
    auto c = RedisCluster::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  // A client refused by every node: no topology, and the reason a refresh gives.
  absl::Status Refused(const RedisTls& tls) {
    auto client = Client(tls);
    if (client == nullptr) return absl::InternalError("no client");
    EXPECT_EQ(client->stats().slots_covered, 0u);
    auto get = client->ExecuteOne({{"GET", "k"}, "k"});
    EXPECT_FALSE(get.ok());
    EXPECT_EQ(get.status().code(), absl::StatusCode::kUnavailable);
    return client->Refresh();
  }
  static std::string Cert(const std::string& name) { return *certs_ + "/" + name; }

  static std::string* certs_;
  static RedisClusterProcess* shared_;
  RedisClusterProcess* cluster_ = nullptr;
};
std::string* RedisClusterTlsTest::certs_ = nullptr;
RedisClusterProcess* RedisClusterTlsTest::shared_ = nullptr;

TEST_F(RedisClusterTlsTest, PipelinesOverEveryMasterThroughMutualTls) {
  auto client = Client(cluster_->ClientTls());
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->stats().masters, 3u);
  EXPECT_EQ(client->stats().slots_covered, 16384u);
  // Small values and a few over a megabyte: replies span many TLS records and reads.
  std::vector<std::string> keys, values;
  for (int i = 0; i < 300; ++i) {
    keys.push_back(absl::StrCat("tls-key-", i));
    const size_t size = i % 50 == 7 ? (1 << 20) + 4096 + i : 1000 + i;
    values.push_back(std::string(size, static_cast<char>('a' + i % 26)));
  }
  ASSERT_NO_FATAL_FAILURE(SetThenGet(*client, keys, values));
  std::set<int> masters;
  for (const std::string& k : keys) {
    auto m = cluster_->MasterOf(RedisHashSlot(k));
    ASSERT_TRUE(m.ok());
    masters.insert(*m);
  }
  EXPECT_EQ(masters.size(), 3u);
  EXPECT_EQ(client->stats().moved, 0u);
  EXPECT_EQ(client->stats().io_failures, 0u);
}

TEST_F(RedisClusterTlsTest, AConnectionTheServerClosedWhileIdleIsReplaced) {
  auto client = Client(cluster_->ClientTls());
  ASSERT_NE(client, nullptr);
  ClosedIdleConnectionsAreReplaced(*cluster_, *client, "tls-idle-key-");
}

TEST_F(RedisClusterTlsTest, AConnectionTellsAServerThatClosedItFromASilentOne) {
  auto tls = RedisTlsContext::Create(cluster_->ClientTls());
  ASSERT_TRUE(tls.ok()) << tls.status();
  ClosedIsToldFromSilent(*cluster_, tls->get());
}

TEST_F(RedisClusterTlsTest, AClientWithoutACertificateIsRefused) {
  RedisTls tls = cluster_->ClientTls();
  tls.cert_file.clear();
  tls.key_file.clear();
  const absl::Status s = Refused(tls);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "TLS")) << s;
}

TEST_F(RedisClusterTlsTest, AServerSignedByAnotherCaFailsVerification) {
  RedisTls tls = cluster_->ClientTls();
  tls.ca_file = Cert("ca2.pem");  // A CA of its own, which did not sign server.pem.
  const absl::Status s = Refused(tls);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "TLS handshake failed: certificate verify failed"))
      << s;
}

TEST_F(RedisClusterTlsTest, AServerNameThatDoesNotMatchFailsVerification) {
  RedisTls tls = cluster_->ClientTls();
  tls.server_name = "redis.example";  // server.pem names localhost and 127.0.0.1.
  const absl::Status s = Refused(tls);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "certificate verify failed")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "mismatch")) << s;

  // A name the certificate does carry is verified instead of the address.
  tls.server_name = "localhost";
  auto client = Client(tls);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->stats().slots_covered, 16384u);
  auto set = client->ExecuteOne({{"SET", "named", "v"}, "named"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(ReplyString(**set), "OK");
}

TEST_F(RedisClusterTlsTest, APlaintextClientFailsInsteadOfHanging) {
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = Refused(RedisTls{});  // TLS off.
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // A direct connection too: its first command fails, bounded by the I/O timeout.
  auto conn = RedisConnection::Connect(cluster_->endpoint(1), {}, absl::Seconds(1),
                                       absl::Milliseconds(500));
  if (conn.ok()) {
    auto ping = (*conn)->Call({"PING"});
    ASSERT_FALSE(ping.ok());
    EXPECT_EQ(ping.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE((*conn)->broken());
  } else {
    EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  }
  // Did not hang: far less than this even if every wait ran to its timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

TEST(RedisClusterOptionsTest, ValidatesTheTlsFields) {
  RedisClusterOptions o;
  o.seeds = {{"127.0.0.1", 7000}};
  ASSERT_TRUE(o.Validate().ok());
  auto fails_naming = [&](const std::string& field) {
    const absl::Status s = o.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(absl::StrContains(s.message(), field)) << s;
  };
  o.tls.ca_file = "/etc/ca.pem";  // Without tls.enabled.
  fails_naming("tls.ca_file");
  o.tls.ca_file.clear();
  o.tls.server_name = "redis.example";
  fails_naming("tls.server_name");
  o.tls.enabled = true;
  EXPECT_TRUE(o.Validate().ok());
  o.tls.cert_file = "/etc/client.pem";  // Without its key.
  fails_naming("tls.key_file");
  o.tls.cert_file.clear();
  o.tls.key_file = "/etc/client.key";  // Without its certificate.
  fails_naming("tls.cert_file");
  o.tls.cert_file = "/etc/client.pem";
  EXPECT_TRUE(o.Validate().ok());  // Files are read by Create, not Validate.

  // Create reads them, and names the one it cannot use.
  o.tls.ca_file = "/nonexistent/redis-ca.pem";
  auto c = RedisCluster::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "ca_file: '/nonexistent/redis-ca.pem'"))
      << c.status();
}

// Why RedisTlsContext::Create refuses `tls` ("" when it does not).
std::string Refusal(const RedisTls& tls) {
  auto c = RedisTlsContext::Create(tls);
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  return std::string(c.status().message());
}

TEST(RedisTlsContextTest, NamesTheFileItCannotUse) {
  auto certs = MakeRedisTestCerts();
  ASSERT_TRUE(certs.ok()) << certs.status();
  const std::string dir = *certs;
  RedisTls tls;
  EXPECT_NE(Refusal(tls), "");  // Not enabled.
  tls.enabled = true;
  tls.ca_file = dir + "/ca.pem";
  auto server_only = RedisTlsContext::Create(tls);
  ASSERT_TRUE(server_only.ok()) << server_only.status();
  EXPECT_FALSE((*server_only)->has_client_cert());
  tls.cert_file = dir + "/client-a.pem";
  tls.key_file = dir + "/client-a.key";
  auto mutual = RedisTlsContext::Create(tls);
  ASSERT_TRUE(mutual.ok()) << mutual.status();
  EXPECT_TRUE((*mutual)->has_client_cert());

  const std::string garbage = dir + "/garbage.pem";
  std::ofstream(garbage) << "not a certificate\n";
  struct Case {
    std::string RedisTls::*field;
    std::string path;
    std::string want_prefix;
  };
  const Case cases[] = {
      {&RedisTls::ca_file, dir + "/nope.pem", "ca_file: '" + dir + "/nope.pem': cannot read"},
      {&RedisTls::ca_file, garbage, "ca_file: '" + garbage + "': "},
      {&RedisTls::cert_file, garbage, "cert_file: '" + garbage + "': "},
      {&RedisTls::key_file, garbage, "key_file: '" + garbage + "': "},
      // Another certificate's key.
      {&RedisTls::key_file, dir + "/server.key", "key_file: '" + dir + "/server.key': "},
      {&RedisTls::key_file, "", "key_file: missing"},
      // Opening a FIFO blocked until something wrote to it.
      {&RedisTls::key_file, dir + "/fifo", "key_file: '" + dir + "/fifo': is not a regular file"},
  };
  std::filesystem::remove(dir + "/fifo");
  ASSERT_EQ(mkfifo((dir + "/fifo").c_str(), 0600), 0);
  for (const Case& c : cases) {
    RedisTls bad = tls;
    bad.*c.field = c.path;
    const std::string why = Refusal(bad);
    EXPECT_TRUE(absl::StartsWith(why, c.want_prefix)) << why << "\nwanted " << c.want_prefix;
  }
}

}  // namespace
}  // namespace kvtier
