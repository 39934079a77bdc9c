// RedisCluster against a real Redis Cluster on loopback (three masters, three
// replicas): routing and pipelining over every master, MOVED after a slot moved, ASK
// mid-migration, a killed master and the failover, a hung node and the I/O timeout, and
// AUTH.
#include "storage/redis/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"
#include "tests/support/redis_cluster_process.h"

namespace kvtier {
namespace {

using testing::RedisClusterProcess;
using testing::RedisClusterSpec;

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
  std::vector<RedisCommand> sets, gets;
  for (size_t i = 0; i < keys.size(); ++i) {
    sets.push_back({{"SET", keys[i], values[i]}, keys[i]});
    gets.push_back({{"GET", keys[i]}, keys[i]});
  }
  for (auto& r : client->Execute(sets)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ReplyString(**r), "OK");
  }
  auto got = client->Execute(gets);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_EQ(ReplyString(**got[i]), values[i]) << keys[i];
  }
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
      auto w = cluster_->Call(i, {"WAIT", "1", "5000"});
      ASSERT_TRUE(w.ok());
      ASSERT_EQ((*w)->integer, 1);
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

}  // namespace
}  // namespace kvtier
