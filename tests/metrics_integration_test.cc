// Metrics end to end: a real kvtierd's /metrics and /healthz, `promtool check metrics`
// on a scrape of a busy daemon, and a real Prometheus server scraping it and answering
// queries with the values the traffic implies.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::HttpGet;
using testing::SeriesValue;
using testing::KeyOf;
using testing::PatternBytes;

// The value of the series whose line starts with `series` (name and labels, exactly as
// exposed), or -1.

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("kvtier-metrics");
    auto d = testing::DaemonProcess::Start(dir_ + "/data", {"--ram-capacity=64MiB"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    ASSERT_GT(daemon_->metrics_port(), 0);
    auto c = KvTierClient::Connect(daemon_->target());
    ASSERT_TRUE(c.ok());
    client_ = *std::move(c);
  }

  // 3 puts of 1 MiB, a Get of 2 present keys and 1 absent, a Lookup of 4 keys (3 hit),
  // and one failing Lookup on an unknown namespace.
  void DriveTraffic() {
    auto reg = client_->RegisterLayout(testing::LayoutOfMiB(1));
    ASSERT_TRUE(reg.ok());
    ns_ = reg->namespace_id;
    for (uint64_t i = 0; i < 3; ++i) {
      const std::string data = PatternBytes(i, 1 << 20);
      ChunkToPut c{KeyOf(i), data, 256};
      ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
    }
    auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1), KeyOf(9)});
    ASSERT_TRUE(got.ok());
    auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(9)});
    ASSERT_TRUE(l.ok());
    auto bad = client_->Lookup(0x42, std::vector<ChunkKey>{KeyOf(0)});
    ASSERT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  }

  std::string dir_;
  std::optional<testing::DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(MetricsTest, ExposesWhatTheTrafficDid) {
  DriveTraffic();
  auto r = HttpGet(daemon_->metrics_port(), "/metrics");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status, 200);
  const std::string& m = r->body;
  EXPECT_EQ(SeriesValue(m, "kvtier_up"), 1);
  EXPECT_EQ(SeriesValue(m, "kvtier_rpc_requests_total{code=\"OK\",method=\"Put\"}"), 3) << m;
  EXPECT_EQ(SeriesValue(m, "kvtier_rpc_requests_total{code=\"NOT_FOUND\",method=\"Lookup\"}"), 1);
  EXPECT_EQ(SeriesValue(m, "kvtier_rpc_requests_total{code=\"OK\",method=\"Lookup\"}"), 1);
  EXPECT_EQ(SeriesValue(m, "kvtier_rpc_latency_seconds_count{method=\"Put\"}"), 3);
  EXPECT_EQ(SeriesValue(m, "kvtier_lookup_keys_total"), 4);
  EXPECT_EQ(SeriesValue(m, "kvtier_lookup_hits_total"), 3);
  EXPECT_EQ(SeriesValue(m, "kvtier_tier_chunks{tier=\"ram\"}"), 3);
  EXPECT_EQ(SeriesValue(m, "kvtier_tier_bytes_in_total{tier=\"ram\"}"), 3 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_tier_bytes_out_total{tier=\"ram\"}"), 2 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_tier_hits_total{tier=\"ram\"}"), 2);
  EXPECT_EQ(SeriesValue(m, "kvtier_tier_capacity_bytes{tier=\"ram\"}"), 64 << 20);
  // The memory envelope (DaemonConfig::MemoryBesidePool): the pool and what is bounded
  // beside it, for this daemon's options (write-back: the SSD tier's buffers too).
  EXPECT_EQ(SeriesValue(m, "kvtier_memory_bound_bytes{part=\"pool\"}"), 64 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_memory_bound_bytes{part=\"put_buffer\"}"), 64 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_memory_bound_bytes{part=\"ssd_stream_buffer\"}"),
            2 * (64 << 20));
  EXPECT_EQ(SeriesValue(m, "kvtier_memory_bound_bytes{part=\"ssd_memtables\"}"), 32 << 20);
  EXPECT_GT(SeriesValue(m, "kvtier_memory_bound_bytes{part=\"ssd_io_buffers\"}"), 0);
  EXPECT_EQ(SeriesValue(m, "kvtier_memory_bound_bytes{part=\"malloc_pad\"}"), 32 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_checksum_failures_total{source=\"ssd\"}"), 0);
  EXPECT_EQ(SeriesValue(m, "kvtier_rpc_inflight_streams{method=\"Get\"}"), 0);
  EXPECT_GE(SeriesValue(m, "kvtier_writeback_queue_depth"), 0);
  EXPECT_GE(SeriesValue(m, "kvtier_writeback_dirty_bytes"), 0);
  // writeback_max_dirty 0: half of the 64 MiB pool.
  EXPECT_EQ(SeriesValue(m, "kvtier_writeback_max_dirty_bytes"), 32 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_writeback_backlog_waits_total"), 0);
  // No per-key labels: nothing exposes a key or a namespace id.
  EXPECT_EQ(m.find(KeyOf(0).ToHex()), std::string::npos);

  auto h = HttpGet(daemon_->metrics_port(), "/healthz");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(h->body, "ok\n");
}

// Write-through, so the SSD figures are settled when the puts return.
TEST(SsdMetricsTest, PayloadFilesAreAccountedFor) {
  const std::string dir = testing::MakeTempDir("kvtier-metrics-ssd");
  auto d = testing::DaemonProcess::Start(dir + "/data",
                                         {"--ram-capacity=64MiB", "--write-mode=write-through"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = KvTierClient::Connect(d->target());
  ASSERT_TRUE(c.ok());
  auto reg = (*c)->RegisterLayout(testing::LayoutOfMiB(1));
  ASSERT_TRUE(reg.ok());
  for (uint64_t i = 0; i < 3; ++i) {
    const std::string data = PatternBytes(i, 1 << 20);
    ChunkToPut chunk{KeyOf(i), data, 256};
    ASSERT_TRUE((*c)->Put(reg->namespace_id, {&chunk, 1}).ok());
  }
  ASSERT_TRUE((*c)->Delete(reg->namespace_id, std::vector<ChunkKey>{KeyOf(1)}).ok());
  auto r = HttpGet(d->metrics_port(), "/metrics");
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string& m = r->body;
  EXPECT_EQ(SeriesValue(m, "kvtier_ssd_payload_bytes"), 2 << 20) << m;
  EXPECT_EQ(SeriesValue(m, "kvtier_ssd_written_bytes_total"), 3 << 20);
  // The deleted chunk's bytes are dead but still in their (active) file.
  EXPECT_EQ(SeriesValue(m, "kvtier_ssd_disk_bytes"), 3 << 20);
  EXPECT_EQ(SeriesValue(m, "kvtier_ssd_gc_bytes_total"), 0);
  EXPECT_EQ(SeriesValue(m, "kvtier_ssd_lost_at_start_total"), 0);
  EXPECT_EQ(SeriesValue(m, "kvtier_ssd_index_repairs_total"), 0);
}

// Chunks smaller than a pool slot: Stats, the CLI's source, and the metrics tell the
// payload held apart from the slots it takes.
TEST(TierBytesTest, PayloadAndSlotBytesAreReportedApart) {
  const std::string dir = testing::MakeTempDir("kvtier-payload");
  auto d = testing::DaemonProcess::Start(
      dir + "/data", {"--ram-capacity=64MiB", "--ram-slot-size=1MiB", "--write-mode=write-through"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = KvTierClient::Connect(d->target());
  ASSERT_TRUE(c.ok());
  LayoutSpec small = testing::LayoutOfMiB(1);
  small.tokens_per_chunk = 16;  // 64 KiB chunks.
  auto reg = (*c)->RegisterLayout(small);
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_EQ(reg->chunk_bytes, 64u << 10);
  for (uint64_t i = 0; i < 4; ++i) {
    const std::string data = PatternBytes(i, 64 << 10);
    ChunkToPut chunk{KeyOf(i), data, 16};
    ASSERT_TRUE((*c)->Put(reg->namespace_id, {&chunk, 1}).ok());
  }
  auto stats = (*c)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->tiers_size(), 2);
  EXPECT_EQ(stats->tiers(0).payload_bytes(), 4u * (64 << 10));  // RAM
  EXPECT_EQ(stats->tiers(0).used_bytes(), 4u << 20);             // four whole slots
  EXPECT_EQ(stats->tiers(1).payload_bytes(), 4u * (64 << 10));  // SSD
  EXPECT_EQ(stats->tiers(1).used_bytes(), 4u * (64 << 10));     // 4 KiB multiples already
  auto r = HttpGet(d->metrics_port(), "/metrics");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(SeriesValue(r->body, "kvtier_tier_payload_bytes{tier=\"ram\"}"), 4 * (64 << 10))
      << r->body;
  EXPECT_EQ(SeriesValue(r->body, "kvtier_tier_used_bytes{tier=\"ram\"}"), 4 << 20);
}

// ram_prefault (the daemon's default; test daemons turn it off): the pool is faulted in
// after start-up, Stats and the metric say how far, and the daemon serves meanwhile.
TEST(RamPrefaultTest, PoolIsFaultedInAndReported) {
  const std::string dir = testing::MakeTempDir("kvtier-prefault");
  auto d = testing::DaemonProcess::Start(
      dir + "/data", {"--ram-capacity=64MiB", "--write-mode=ram-only", "--ram-prefault=true"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = KvTierClient::Connect(d->target());
  ASSERT_TRUE(c.ok());
  uint64_t prefaulted = 0;
  const bool done = testing::Eventually([&] {
    auto stats = (*c)->Stats();
    if (!stats.ok() || stats->tiers(0).tier() != v1::TIER_RAM) return false;
    prefaulted = stats->tiers(0).prefaulted_bytes();
    return prefaulted == (64u << 20);
  });
  EXPECT_TRUE(done);
  EXPECT_EQ(prefaulted, 64u << 20);
  auto r = HttpGet(d->metrics_port(), "/metrics");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(SeriesValue(r->body, "kvtier_ram_prefaulted_bytes"), 64 << 20);
  // Off (as test daemons run): nothing is faulted in ahead.
  auto off = testing::DaemonProcess::Start(dir + "/off", {"--ram-capacity=64MiB"});
  ASSERT_TRUE(off.ok()) << off.status();
  auto m = HttpGet(off->metrics_port(), "/metrics");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(SeriesValue(m->body, "kvtier_ram_prefaulted_bytes"), 0);
}

// A Get of a layer range counts what it sends as read out of RAM, not whole chunks (a
// streamed SSD read counted its ranges already; RAM counted 4x here).
TEST_F(MetricsTest, ALayerRangeGetCountsTheBytesItSends) {
  auto reg = client_->RegisterLayout(testing::LayoutOfMiB(4));  // 4 layers of 1 MiB.
  ASSERT_TRUE(reg.ok()) << reg.status();
  for (uint64_t i = 0; i < 2; ++i) {
    const std::string data = PatternBytes(i, 4 << 20);
    ChunkToPut c{KeyOf(i), data, 256};
    ASSERT_TRUE(client_->Put(reg->namespace_id, {&c, 1}).ok());
  }
  auto out = [&] {
    auto r = HttpGet(daemon_->metrics_port(), "/metrics");
    EXPECT_TRUE(r.ok());
    return r.ok() ? SeriesValue(r->body, "kvtier_tier_bytes_out_total{tier=\"ram\"}") : -1;
  };
  const double before = out();
  auto got = client_->Get(reg->namespace_id, std::vector<ChunkKey>{KeyOf(0), KeyOf(1)},
                          LayerRange{1, 2});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ((*got)[0].data.size(), 1u << 20);
  EXPECT_EQ(out() - before, 2 << 20);
  ASSERT_TRUE(client_->Get(reg->namespace_id, std::vector<ChunkKey>{KeyOf(0)}).ok());
  EXPECT_EQ(out() - before, 6 << 20);  // A whole chunk counts whole.
}

// The endpoint answers its two paths exactly, to GET and HEAD (a load balancer's
// health check may use HEAD), and refuses other methods with 405.
TEST_F(MetricsTest, HttpMethodsAndPaths) {
  const int port = daemon_->metrics_port();
  for (const char* path : {"/healthz", "/metrics"}) {
    auto head = testing::HttpRequest(port, "HEAD", path);
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ(head->status, 200) << path;
    EXPECT_EQ(head->body, "") << path;
    EXPECT_NE(head->headers.find("Content-Length: "), std::string::npos) << head->headers;
    for (const char* method : {"POST", "PUT", "DELETE"}) {
      auto refused = testing::HttpRequest(port, method, path);
      ASSERT_TRUE(refused.ok()) << refused.status();
      EXPECT_EQ(refused->status, 405) << method << " " << path;
      EXPECT_NE(refused->headers.find("Allow: GET, HEAD"), std::string::npos) << refused->headers;
    }
  }
  for (const char* path : {"/healthzzz", "/metrics.bak", "/metrics/sub", "/"}) {
    auto got = testing::HttpGet(port, path);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->status, 404) << path;
  }
}

// Clients that connect to the HTTP port and send half a request hold one of its
// threads each until the request timeout. Two of them took /healthz and /metrics down
// for 30 s at a time (two threads, civetweb's default timeout). Four now leave threads
// to answer at once; the 15 s bound only tells a hang from an answer.
TEST_F(MetricsTest, IdleHttpClientsDoNotStarveHealthz) {
  const int port = daemon_->metrics_port();
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    const std::string partial = "GET /metrics HTTP/1.1\r\n";
    ASSERT_EQ(write(fd, partial.data(), partial.size()), static_cast<ssize_t>(partial.size()));
    idle.push_back(fd);
  }
  for (const char* path : {"/healthz", "/metrics"}) {
    auto got = testing::HttpRequest(port, "GET", path, absl::Seconds(15));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->status, 200) << path;
  }
  for (int fd : idle) close(fd);
}

TEST_F(MetricsTest, PromtoolFindsNoProblemsInABusyScrape) {
  if (access("/usr/bin/promtool", X_OK) != 0) GTEST_FAIL() << "promtool missing (package prometheus)";
  DriveTraffic();
  auto r = HttpGet(daemon_->metrics_port(), "/metrics");
  ASSERT_TRUE(r.ok());
  const std::string file = dir_ + "/scrape.txt";
  std::ofstream(file) << r->body;
  auto check = testing::RunCommand({"/bin/sh", "-c", "/usr/bin/promtool check metrics < " + file});
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_EQ(check.output, "") << check.output;
}

TEST_F(MetricsTest, RealPrometheusScrapesTheDaemon) {
  if (access("/usr/bin/prometheus", X_OK) != 0) GTEST_FAIL() << "prometheus missing";
  DriveTraffic();
  const int web_port = testing::FreePort();
  const std::string cfg = dir_ + "/prometheus.yml";
  std::ofstream(cfg) << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                     << "scrape_configs:\n  - job_name: kvtier\n    static_configs:\n"
                     << "      - targets: ['127.0.0.1:" << daemon_->metrics_port() << "']\n";
  const std::string log = dir_ + "/prometheus.log";
  pid_t pid = fork();
  if (pid == 0) {
    freopen(log.c_str(), "w", stderr);
    execl("/usr/bin/prometheus", "prometheus", ("--config.file=" + cfg).c_str(),
          ("--storage.tsdb.path=" + dir_ + "/tsdb").c_str(),
          ("--web.listen-address=127.0.0.1:" + std::to_string(web_port)).c_str(),
          (char*)nullptr);
    _exit(127);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
  } reap{pid};

  // Poll the query API until the scraped value shows up (scrapes run every second).
  auto query = [&](const std::string& promql) -> double {
    std::string path = "/api/v1/query?query=";
    for (char c : promql) {
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
        path += c;
      } else {
        char hex[4];
        std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned char>(c));
        path += hex;
      }
    }
    auto r = HttpGet(web_port, path);
    if (!r.ok() || r->status != 200) return -1;
    // {"status":"success","data":{"resultType":"vector","result":[{"metric":{...},"value":[t,"3"]}]}}
    std::smatch m;
    static const std::regex kValue(R"re("value":\[[0-9.]+,"([0-9.eE+-]+)"\])re");
    if (!std::regex_search(r->body, m, kValue)) return -1;
    double v;
    return absl::SimpleAtod(m[1].str(), &v) ? v : -1;
  };
  double puts = -1;
  for (int i = 0; i < 300 && puts < 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    puts = query("kvtier_rpc_requests_total{job=\"kvtier\",method=\"Put\",code=\"OK\"}");
  }
  ASSERT_EQ(puts, 3) << "Prometheus never scraped kvtierd; its log: " << [&] {
    std::ifstream in(log);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  EXPECT_EQ(query("up{job=\"kvtier\"}"), 1);
  EXPECT_EQ(query("kvtier_lookup_hits_total / kvtier_lookup_keys_total"), 0.75);
  EXPECT_EQ(query("kvtier_tier_bytes_in_total{tier=\"ram\"}"), 3 << 20);
  EXPECT_EQ(query("kvtier_tier_chunks{tier=\"ram\"}"), 3);
  EXPECT_EQ(query("sum(kvtier_rpc_requests_total{code!=\"OK\"})"), 1);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// Without a GPU (turned off, or a device that is not there) the daemon says so once at
// start-up, exports it, and serves from RAM and SSD. (A GPU host runs the `gpu` tests.)
TEST(GpuMetricsTest, NoGpuIsSaidOnceExportedAndServes) {
  for (const char* flag : {"--gpu=off", "--gpu=99"}) {
    const std::string dir = testing::MakeTempDir("kvtier-nogpu");
    auto d = testing::DaemonProcess::Start(dir + "/data", {"--ram-capacity=64MiB", flag});
    ASSERT_TRUE(d.ok()) << d.status();
    auto c = KvTierClient::Connect(d->target());
    ASSERT_TRUE(c.ok());
    auto reg = (*c)->RegisterLayout(testing::LayoutOfMiB(1));
    ASSERT_TRUE(reg.ok());
    const std::string data = PatternBytes(1, 1 << 20);
    ChunkToPut chunk{KeyOf(1), data, 256};
    ASSERT_TRUE((*c)->Put(reg->namespace_id, {&chunk, 1}).ok());
    auto r = HttpGet(d->metrics_port(), "/metrics");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(SeriesValue(r->body, "kvtier_gpu_available"), 0) << flag;
    EXPECT_EQ(r->body.find("tier=\"gpu\""), std::string::npos) << flag;
    const std::string log = d->ReadLog();
    size_t lines = 0;
    for (size_t at = log.find("GPU staging tier: off"); at != std::string::npos;
         at = log.find("GPU staging tier: off", at + 1)) {
      ++lines;
    }
    EXPECT_EQ(lines, 1u) << log;
    if (std::string(flag) == "--gpu=99") {
      // Asked for by number and missing: a warning, not a start-up failure.
      EXPECT_NE(log.find("WARN"), std::string::npos) << log;
      EXPECT_NE(log.find("gpu=99 was asked for"), std::string::npos) << log;
    }
  }
}

}  // namespace
}  // namespace kvtier
