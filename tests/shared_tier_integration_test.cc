// Three kvtierd sharing a real Redis Cluster (three masters, three replicas, on
// loopback), each with its own data directory: a chunk put on one is looked up and
// read on the others; a master killed mid-run fails over without a wrong byte; every
// process restarts and the shared chunks are still there; with the whole cluster down
// each daemon goes on serving from its own tiers.
#include <hiredis/hiredis.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"
#include "tests/support/redis_cluster_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;
using testing::RedisClusterProcess;

constexpr int kDaemons = 3;
constexpr size_t kChunk = 1 << 20;

class SharedTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!RedisClusterProcess::Available()) GTEST_SKIP() << "redis-server not installed";
    auto c = RedisClusterProcess::Start({});
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
    for (int i = 0; i < kDaemons; ++i) dirs_.push_back(MakeTempDir("shared-tier"));
    daemons_.resize(kDaemons);
    clients_.resize(kDaemons);
    for (int i = 0; i < kDaemons; ++i) ASSERT_NO_FATAL_FAILURE(Start(i));
  }

  void Start(int i) {
    auto d = DaemonProcess::Start(dirs_[i], {"--remote-seeds=" + cluster_->SeedList(),
                                             "--remote-timeout=500ms", "--ram-capacity=64MiB",
                                             "--remote-segment-size=256KiB"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemons_[i].emplace(*std::move(d));
    auto c = KvTierClient::Connect(daemons_[i]->target());
    ASSERT_TRUE(c.ok()) << c.status();
    clients_[i] = *std::move(c);
    auto r = clients_[i]->RegisterLayout(LayoutOfMiB(1));
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->namespace_id;
  }
  void Stop(int i) {
    clients_[i].reset();
    auto code = daemons_[i]->Terminate();
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << daemons_[i]->ReadLog();
    daemons_[i].reset();
  }

  void Put(int daemon, uint64_t first, uint64_t count) {
    for (uint64_t i = first; i < first + count; ++i) {
      const std::string data = PatternBytes(i, kChunk);
      ChunkToPut c{KeyOf(i), data, 256};
      auto r = clients_[daemon]->Put(ns_, {&c, 1});
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
  double Metric(int daemon, const std::string& series) {
    auto r = testing::HttpGet(daemons_[daemon]->metrics_port(), "/metrics");
    if (!r.ok()) return -1;
    return testing::SeriesValue(r->body, series);
  }
  // Waits until `daemon` has no shared-tier write queued or running.
  bool RemoteWritesSettle(int daemon) {
    return testing::Eventually(
        [&] { return Metric(daemon, "kvtier_remote_pending_bytes") == 0; });
  }
  static std::vector<ChunkKey> Keys(uint64_t first, uint64_t count) {
    std::vector<ChunkKey> keys;
    for (uint64_t i = first; i < first + count; ++i) keys.push_back(KeyOf(i));
    return keys;
  }
  // Every master has its writes on a replica (replication is asynchronous).
  void WaitForReplicas() {
    for (int i = 0; i < cluster_->size(); ++i) {
      if (!cluster_->alive(i)) continue;
      auto role = cluster_->Call(i, {"ROLE"});
      ASSERT_TRUE(role.ok());
      if (ReplyString(*(*role)->element[0]) != "master") continue;
      const absl::Status replicated = cluster_->WaitReplicated(i);
      ASSERT_TRUE(replicated.ok()) << replicated;
    }
  }

  std::unique_ptr<RedisClusterProcess> cluster_;
  std::vector<std::string> dirs_;
  std::vector<std::optional<DaemonProcess>> daemons_;
  std::vector<std::unique_ptr<KvTierClient>> clients_;
  uint64_t ns_ = 0;
};

TEST_F(SharedTierTest, AChunkPutOnOneDaemonIsReadOnTheOthers) {
  Put(0, 0, 4);
  ASSERT_TRUE(RemoteWritesSettle(0));
  EXPECT_EQ(Metric(0, "kvtier_remote_writes_total{result=\"stored\"}"), 4);
  for (int d : {1, 2}) {
    auto l = clients_[d]->Lookup(ns_, Keys(0, 5));
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->prefix_hits, 4u);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(l->tiers[i], v1::TIER_REMOTE) << d << " " << i;
    EXPECT_EQ(l->tiers[4], v1::TIER_UNSPECIFIED);
    auto got = clients_[d]->Get(ns_, Keys(0, 4));
    ASSERT_TRUE(got.ok()) << got.status();
    for (uint64_t i = 0; i < 4; ++i) {
      ASSERT_TRUE((*got)[i].found) << d << " " << i;
      EXPECT_TRUE((*got)[i].data == PatternBytes(i, kChunk)) << d << " " << i;
      EXPECT_TRUE((*got)[i].crc_verified);
      EXPECT_EQ((*got)[i].tier, v1::TIER_REMOTE);
    }
    // Kept locally by the promotion rules: now a RAM hit.
    auto again = clients_[d]->Lookup(ns_, Keys(0, 4));
    ASSERT_TRUE(again.ok());
    for (int i = 0; i < 4; ++i) EXPECT_EQ(again->tiers[i], v1::TIER_RAM);
    EXPECT_EQ(Metric(d, "kvtier_remote_reads_total{result=\"hit\"}"), 4);
    EXPECT_EQ(Metric(d, "kvtier_remote_degraded"), 0);
    EXPECT_EQ(Metric(d, "kvtier_remote_masters"), 3);
  }
}

TEST_F(SharedTierTest, AMasterKilledMidRunFailsOverAndEverythingRestarts) {
  Put(0, 0, 8);
  ASSERT_TRUE(RemoteWritesSettle(0));
  ASSERT_EQ(Metric(0, "kvtier_remote_writes_total{result=\"stored\"}"), 8);
  ASSERT_NO_FATAL_FAILURE(WaitForReplicas());
  auto victim = cluster_->MasterOf(0);
  ASSERT_TRUE(victim.ok());
  cluster_->Kill(*victim);
  // Puts go on while the cluster fails over; none fails because of it.
  Put(1, 100, 8);
  ASSERT_TRUE(RemoteWritesSettle(1));
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  // Whatever daemon 2 finds is byte-identical; what was replicated before the kill is
  // all there after the failover.
  ASSERT_TRUE(testing::Eventually([&] {
    auto got = clients_[2]->Get(ns_, Keys(0, 8));
    if (!got.ok()) return false;
    for (uint64_t i = 0; i < 8; ++i) {
      if (!(*got)[i].found) return false;
    }
    return true;
  }));
  auto got = clients_[2]->Get(ns_, Keys(0, 8));
  ASSERT_TRUE(got.ok());
  for (uint64_t i = 0; i < 8; ++i) EXPECT_TRUE((*got)[i].data == PatternBytes(i, kChunk)) << i;
  auto during = clients_[2]->Get(ns_, Keys(100, 8));
  ASSERT_TRUE(during.ok());
  for (uint64_t i = 0; i < 8; ++i) {
    if ((*during)[i].found) {
      EXPECT_TRUE((*during)[i].data == PatternBytes(100 + i, kChunk)) << i;
    }
  }
  // After the failover, sharing works as before: daemon 1 may still be backing off
  // (up to 10 s between probes) from the failures it saw during it; its next probe
  // finds the new master.
  uint64_t next = 200;
  ASSERT_TRUE(testing::Eventually([&] {
    const std::string data = PatternBytes(next, kChunk);
    ChunkToPut c{KeyOf(next++), data, 256};
    if (!clients_[1]->Put(ns_, {&c, 1}).ok() || !RemoteWritesSettle(1)) return false;
    return Metric(1, "kvtier_remote_degraded") == 0;
  }));
  const uint64_t last = next - 1;  // The probe that succeeded wrote it.

  // Restart everything: the killed node rejoins, every daemon restarts on its data.
  ASSERT_TRUE(cluster_->Restart(*victim).ok());
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  for (int d = 0; d < kDaemons; ++d) ASSERT_NO_FATAL_FAILURE(Stop(d));
  for (int d = 0; d < kDaemons; ++d) ASSERT_NO_FATAL_FAILURE(Start(d));
  // Daemon 1 never held chunks 0-7 on its own SSD (it read them only now): they come
  // from the shared tier.
  auto after = clients_[1]->Get(ns_, Keys(0, 8));
  ASSERT_TRUE(after.ok());
  for (uint64_t i = 0; i < 8; ++i) {
    ASSERT_TRUE((*after)[i].found) << i;
    EXPECT_TRUE((*after)[i].data == PatternBytes(i, kChunk)) << i;
    EXPECT_EQ((*after)[i].tier, v1::TIER_REMOTE);
  }
  auto late = clients_[0]->Get(ns_, Keys(last, 1));
  ASSERT_TRUE(late.ok());
  ASSERT_TRUE((*late)[0].found);
  EXPECT_TRUE((*late)[0].data == PatternBytes(last, kChunk));
  EXPECT_EQ((*late)[0].tier, v1::TIER_REMOTE);
}

TEST_F(SharedTierTest, WithTheClusterDownEachDaemonServesLocally) {
  Put(0, 0, 2);
  ASSERT_TRUE(RemoteWritesSettle(0));
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);
  Put(0, 10, 4);  // Puts succeed; their shared-tier writes fail and mark it degraded.
  ASSERT_TRUE(RemoteWritesSettle(0));
  EXPECT_EQ(Metric(0, "kvtier_remote_degraded"), 1);
  EXPECT_GE(Metric(0, "kvtier_remote_degradations_total"), 1);
  auto got = clients_[0]->Get(ns_, Keys(10, 4));
  ASSERT_TRUE(got.ok());
  for (uint64_t i = 0; i < 4; ++i) {
    ASSERT_TRUE((*got)[i].found);
    EXPECT_TRUE((*got)[i].data == PatternBytes(10 + i, kChunk));
  }
  // Another daemon: a miss (the client computes the chunk), not an error.
  auto miss = clients_[1]->Get(ns_, Keys(0, 2));
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_FALSE((*miss)[0].found);
  EXPECT_FALSE((*miss)[1].found);
  auto l = clients_[1]->Lookup(ns_, Keys(0, 2));
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->prefix_hits, 0u);
  auto health = testing::HttpGet(daemons_[1]->metrics_port(), "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
}

}  // namespace
}  // namespace kvtier
