// overload_bench: issue 13's overload target against a real kvtierd. Clients that stall
// mid-chunk (each holds its place until client_idle_timeout reaps it), then many put
// streams at once whose chunks total several times the RAM pool, while a prober times
// health checks and Lookups. A refused put backs off from the daemon's retry hint,
// exponentially with jitter as refusals repeat, and tries the same chunk again. It reports:
//   - the daemon's peak RSS against its pool;
//   - health and Lookup latency (p50, p99, max) under that load;
//   - every put's final status. Each must be OK or RESOURCE_EXHAUSTED; the stalled
//     clients' must be CANCELLED (reaped after client_idle_timeout) or
//     RESOURCE_EXHAUSTED;
//   - with --oversized=N, N more clients that send Put frames of --oversized-mib each
//     (far past the frame limit) over and over while the load runs: each must be
//     refused (RESOURCE_EXHAUSTED or INVALID_ARGUMENT), and the peak RSS shows whether
//     the daemon bounded what gRPC buffered for them (grpc_memory).
//
//   overload_bench [--ram-mib=2048] [--streams=256] [--stalled=32] [--chunk-mib=2]
//                  [--times-pool=10] [--idle-timeout-s=3] [--oversized=0]
//                  [--oversized-mib=256] [--header-wait=2] [--data-dir=DIR]
//                  [--daemon-args=a,b] [--label=NAME] [--json=FILE]
//
// Exits 1 if a put got any other status, or if a probe failed.
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_flags.h"
#include "bench/json_line.h"
#include "client/kvtier_client.h"
#include "health.grpc.pb.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace {

using kvtier::KvTierClient;
using kvtier::bench::Flag;
using kvtier::bench::StrFlag;
using kvtier::testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// Final statuses by code name, across threads.
class StatusTally {
 public:
  void Add(grpc::StatusCode code, const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[code];
    if (example_.count(code) == 0) example_[code] = message;
  }
  std::map<grpc::StatusCode, uint64_t> counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }
  std::string example(grpc::StatusCode code) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = example_.find(code);
    return it == example_.end() ? "" : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<grpc::StatusCode, uint64_t> counts_;
  std::map<grpc::StatusCode, std::string> example_;
};

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    default: return "OTHER";
  }
}

// The retry hint the daemon attaches to RESOURCE_EXHAUSTED, in ms (0 if none).
int RetryAfterMs(const grpc::ClientContext& ctx) {
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
    if (k == "kvtier-retry-after-ms") return std::atoi(std::string(v.data(), v.size()).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (kvtier::bench::HelpRequested(argc, argv)) {
    std::printf(
        "usage: overload_bench [--ram-mib=2048] [--streams=256] [--stalled=32] "
        "[--chunk-mib=2] [--times-pool=10] [--idle-timeout-s=3] [--oversized=0] "
        "[--oversized-mib=256] [--header-wait=2] [--data-dir=DIR] [--daemon-args=a,b] "
        "[--label=NAME] [--json=FILE]\n");
    return 0;
  }
  kvtier::bench::InitFlags(argc, argv);
  const uint64_t ram_mib = Flag("ram-mib", 2048);
  const int streams = static_cast<int>(Flag("streams", 256));
  const int stalled = static_cast<int>(Flag("stalled", 32));
  const int oversized = static_cast<int>(Flag("oversized", 0));
  const uint64_t oversized_mib = Flag("oversized-mib", 256);
  const uint32_t chunk_mib = static_cast<uint32_t>(Flag("chunk-mib", 2));
  // When a put stream sends its frames: --header-wait=1 after the daemon's headers,
  // 0 at once (a Put waiting in line fills its stream window), 2 as the C++ client does
  // by default: at once only after this thread's last Put was told kvtier-put-places:
  // free (an A/B of the client's choice). Each thread keeps its own answer, as a worker
  // with its own KvTierClient would; threads sharing one client share one answer, so
  // one "free" lets all their next Puts skip the wait (bounded all the same by the line,
  // max_put_waiters x stream_window, in kvtier_memory_bound_bytes).
  const int header_wait = static_cast<int>(Flag("header-wait", 2));
  const uint64_t total_bytes = Flag("times-pool", 10) * (ram_mib << 20);
  const std::string dir = StrFlag("data-dir", kvtier::testing::MakeTempDir("kvtierd-overload"));
  std::vector<std::string> args = {absl::StrCat("--ram-capacity=", ram_mib, "MiB"),
                                   "--write-mode=ram-only", "--ram-prefault=true",
                                   absl::StrCat("--client-idle-timeout=", Flag("idle-timeout-s", 3), "s")};
  for (absl::string_view a : absl::StrSplit(StrFlag("daemon-args", ""), ',', absl::SkipEmpty())) {
    args.emplace_back(a);
  }
  auto daemon = DaemonProcess::Start(dir, args);
  if (!daemon.ok()) {
    std::fprintf(stderr, "start kvtierd: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  auto admin = KvTierClient::Connect(daemon->target());
  if (!admin.ok()) return 1;
  auto ns = (*admin)->RegisterLayout(kvtier::testing::LayoutOfMiB(chunk_mib));
  if (!ns.ok()) {
    std::fprintf(stderr, "register: %s\n", ns.status().ToString().c_str());
    return 1;
  }
  // The pool is prefaulted in the background: wait for it, so that idle RSS includes it.
  for (int i = 0; i < 600 && daemon->ResidentBytes().value_or(0) < (ram_mib << 20); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const uint64_t rss_idle = daemon->ResidentBytes().value_or(0);

  // Every chunk carries the same bytes (the daemon does not care); keys differ.
  const uint64_t chunk_bytes = uint64_t{chunk_mib} << 20;
  const std::string data = kvtier::testing::PatternBytes(7, chunk_bytes);
  const uint32_t crc = kvtier::crc32c::Value(data);
  const uint64_t frame_bytes = std::min<uint64_t>(chunk_bytes, 1 << 20);
  const uint64_t chunks_total = total_bytes / chunk_bytes;

  // Channels: a handful of connections, as a fleet of workers would have.
  constexpr int kChannels = 8;
  std::vector<std::unique_ptr<kvtier::v1::KvCache::Stub>> stubs;
  for (int i = 0; i < kChannels; ++i) {
    grpc::ChannelArguments ca;
    ca.SetInt("kvtier.channel", i);  // Distinct args: a connection each.
    ca.SetMaxSendMessageSize(64 << 20);
    stubs.push_back(kvtier::v1::KvCache::NewStub(
        grpc::CreateCustomChannel(daemon->target(), grpc::InsecureChannelCredentials(), ca)));
  }
  auto frame = [&](uint64_t key, uint64_t off) {
    kvtier::v1::PutFrame f;
    f.set_namespace_id(ns->namespace_id);
    f.set_key(kvtier::testing::KeyOf(key).ToByteString());
    f.set_offset(off);
    f.set_data(data.substr(off, std::min(frame_bytes, chunk_bytes - off)));
    if (off + frame_bytes >= chunk_bytes) f.set_crc32c(crc);
    f.set_token_count(16);
    return f;
  };

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> next_chunk{0}, stored_bytes{0};
  StatusTally puts, stalls;
  std::vector<std::thread> threads, stallers;
  // Stallers holding a place or waiting in line for one (past max_put_buffer).
  auto stalls_in = [&] {
    auto r = kvtier::testing::HttpGet(daemon->metrics_port(), "/metrics");
    return r.ok() ? kvtier::testing::SeriesValue(r->body, "kvtier_put_streams_open") +
                        kvtier::testing::SeriesValue(r->body, "kvtier_put_streams_waiting")
                  : -1;
  };
  // The stallers go first (below), so that they hold their places, or the head of the
  // line, when the flood comes.
  const auto start = Clock::now();
  // Stalled clients: half a chunk, then silence until the daemon reaps them.
  for (int t = 0; t < stalled; ++t) {
    stallers.emplace_back([&, t] {
      grpc::ClientContext ctx;
      kvtier::v1::PutResponse resp;
      auto w = stubs[t % kChannels]->Put(&ctx, &resp);
      w->Write(frame((1ull << 40) + t, 0));
      grpc::Status s = w->Finish();  // Returns when the daemon ends the call.
      stalls.Add(s.error_code(), s.error_message());
    });
  }
  for (int i = 0; i < 2000 && stalls_in() < static_cast<double>(stalled); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int t = 0; t < streams; ++t) {
    threads.emplace_back([&, t] {
      // The load runs at the lowest priority: on a shared 2-core box it would otherwise
      // starve the daemon and the prober, which on a fleet run on other machines.
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
      auto* stub = stubs[t % kChannels].get();
      std::mt19937 rng(static_cast<uint32_t>(t));
      bool places_free = false;  // This thread's last Put was told "free".
      for (uint64_t k; (k = next_chunk.fetch_add(1)) < chunks_total;) {
        for (int attempt = 0; attempt < 1000; ++attempt) {
          grpc::ClientContext ctx;
          kvtier::v1::PutResponse resp;
          auto w = stub->Put(&ctx, &resp);
          // Headers first, unless the daemon said places were free: a refused stream
          // then costs no payload bytes (as the C++ client does it).
          if (header_wait == 1 || (header_wait == 2 && !places_free)) {
            w->WaitForInitialMetadata();
          }
          for (uint64_t off = 0; off < chunk_bytes; off += frame_bytes) {
            if (!w->Write(frame(k, off))) break;
          }
          w->WritesDone();
          grpc::Status s = w->Finish();
          auto places = ctx.GetServerTrailingMetadata().find("kvtier-put-places");
          places_free = places != ctx.GetServerTrailingMetadata().end() &&
                        places->second == "free";
          puts.Add(s.error_code(), s.error_message());
          if (s.ok()) stored_bytes += chunk_bytes * resp.chunks_stored();
          if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
          // Back off from the daemon's hint, exponentially with jitter as refusals
          // repeat (at most 1 s), then the same chunk again.
          const double base = std::max(RetryAfterMs(ctx), 1) * double(1 << std::min(attempt, 5));
          std::uniform_real_distribution<double> jitter(0.5, 1.5);
          std::this_thread::sleep_for(std::chrono::microseconds(
              static_cast<int64_t>(std::min(base, 1000.0) * jitter(rng) * 1000)));
        }
      }
    });
  }
  // Oversized senders: one frame of oversized_mib, again and again, each on its own
  // connection (with no client-side send limit) until the load is done.
  StatusTally oversize;
  std::vector<std::thread> oversizers;
  std::atomic<bool> load_done{false};
  if (oversized > 0) {
    auto big = std::make_shared<const kvtier::v1::PutFrame>([&] {
      kvtier::v1::PutFrame f = frame(1ull << 41, 0);
      f.set_data(std::string(oversized_mib << 20, 'o'));
      return f;
    }());
    for (int t = 0; t < oversized; ++t) {
      oversizers.emplace_back([&, big] {
        grpc::ChannelArguments args;
        args.SetMaxSendMessageSize(-1);
        auto channel = grpc::CreateCustomChannel(daemon->target(),
                                                 grpc::InsecureChannelCredentials(), args);
        auto stub = kvtier::v1::KvCache::NewStub(channel);
        while (!load_done.load()) {
          grpc::ClientContext ctx;
          kvtier::v1::PutResponse resp;
          auto w = stub->Put(&ctx, &resp);
          w->Write(*big);
          w->WritesDone();
          grpc::Status s = w->Finish();
          oversize.Add(s.error_code(), s.error_message());
        }
      });
    }
  }
  // Probes: health and a 16-key Lookup, each every 10 ms, on their own connection.
  std::vector<double> health_ms, lookup_ms;
  StatusTally probes;
  std::thread prober([&] {
    auto channel = grpc::CreateChannel(daemon->target(), grpc::InsecureChannelCredentials());
    auto health = grpc::health::v1::Health::NewStub(channel);
    auto kv = kvtier::v1::KvCache::NewStub(channel);
    kvtier::v1::LookupRequest lr;
    lr.set_namespace_id(ns->namespace_id);
    for (int i = 0; i < 16; ++i) lr.add_keys(kvtier::testing::KeyOf(i * 7).ToByteString());
    while (!stop.load()) {
      {
        grpc::ClientContext ctx;
        grpc::health::v1::HealthCheckRequest req;
        grpc::health::v1::HealthCheckResponse resp;
        const auto t0 = Clock::now();
        grpc::Status s = health->Check(&ctx, req, &resp);
        health_ms.push_back(Ms(Clock::now() - t0));
        probes.Add(s.error_code(), "health: " + s.error_message());
      }
      {
        grpc::ClientContext ctx;
        kvtier::v1::LookupResponse resp;
        const auto t0 = Clock::now();
        grpc::Status s = kv->Lookup(&ctx, lr, &resp);
        lookup_ms.push_back(Ms(Clock::now() - t0));
        probes.Add(s.error_code(), "lookup: " + s.error_message());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  // Peak RSS, sampled (VmHWM too, at the end).
  uint64_t rss_peak = 0;
  std::thread sampler([&] {
    while (!stop.load()) {
      rss_peak = std::max<uint64_t>(rss_peak, daemon->ResidentBytes().value_or(0));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  for (std::thread& t : threads) t.join();
  load_done = true;
  for (std::thread& t : oversizers) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  // The stallers' last round ends when the daemon reaps it.
  stop = true;
  for (std::thread& t : stallers) t.join();
  prober.join();
  sampler.join();
  rss_peak = std::max<uint64_t>(rss_peak, daemon->PeakResidentBytes().value_or(0));

  const auto pc = puts.counts(), sc = stalls.counts(), prc = probes.counts();
  uint64_t bad_puts = 0, bad = 0;
  for (const auto& [code, n] : pc) {
    if (code != grpc::StatusCode::OK && code != grpc::StatusCode::RESOURCE_EXHAUSTED) bad_puts += n;
  }
  bad = bad_puts;
  for (const auto& [code, n] : sc) {
    if (code != grpc::StatusCode::CANCELLED && code != grpc::StatusCode::RESOURCE_EXHAUSTED) bad += n;
  }
  const auto oc = oversize.counts();
  uint64_t oversized_sent = 0;
  for (const auto& [code, n] : oc) {
    oversized_sent += n;
    // Refused (gRPC's size check, or no place for the stream), or cancelled: a frame that
    // big takes its stream past put_place_idle while others wait, and the daemon reclaims
    // its place.
    if (code != grpc::StatusCode::RESOURCE_EXHAUSTED &&
        code != grpc::StatusCode::INVALID_ARGUMENT && code != grpc::StatusCode::CANCELLED) {
      bad += n;
    }
  }
  uint64_t probe_errors = 0;
  for (const auto& [code, n] : prc) {
    if (code != grpc::StatusCode::OK) probe_errors += n;
  }
  auto count = [](const std::map<grpc::StatusCode, uint64_t>& m, grpc::StatusCode c) {
    auto it = m.find(c);
    return it == m.end() ? uint64_t{0} : it->second;
  };
  const double pool = static_cast<double>(ram_mib << 20);
  std::printf("overload: pool %llu MiB, %d put streams x %llu chunks of %u MiB (%.1f x pool) "
              "+ %d stalled clients + %d sending %llu MiB frames, %.1f s\n",
              static_cast<unsigned long long>(ram_mib), streams,
              static_cast<unsigned long long>(chunks_total), chunk_mib, total_bytes / pool,
              stalled, oversized, static_cast<unsigned long long>(oversized_mib), secs);
  std::printf("| measure | value |\n|---|---|\n");
  std::printf("| daemon RSS idle (pool prefaulted) | %.0f MiB |\n", rss_idle / 1048576.0);
  std::printf("| daemon peak RSS | %.0f MiB (%.3f x pool) |\n", rss_peak / 1048576.0,
              rss_peak / pool);
  std::printf("| puts OK / RESOURCE_EXHAUSTED / other | %llu / %llu / %llu |\n",
              static_cast<unsigned long long>(count(pc, grpc::StatusCode::OK)),
              static_cast<unsigned long long>(count(pc, grpc::StatusCode::RESOURCE_EXHAUSTED)),
              static_cast<unsigned long long>(bad_puts));
  std::printf("| stored | %.2f GiB (%.1f GB/s) |\n", stored_bytes / 1073741824.0,
              stored_bytes / secs / 1e9);
  std::printf("| stalled rounds CANCELLED / RESOURCE_EXHAUSTED | %llu / %llu |\n",
              static_cast<unsigned long long>(count(sc, grpc::StatusCode::CANCELLED)),
              static_cast<unsigned long long>(count(sc, grpc::StatusCode::RESOURCE_EXHAUSTED)));
  std::printf("| oversized frames sent / RESOURCE_EXHAUSTED / INVALID_ARGUMENT / CANCELLED | "
              "%llu / %llu / %llu / %llu |\n",
              static_cast<unsigned long long>(oversized_sent),
              static_cast<unsigned long long>(count(oc, grpc::StatusCode::RESOURCE_EXHAUSTED)),
              static_cast<unsigned long long>(count(oc, grpc::StatusCode::INVALID_ARGUMENT)),
              static_cast<unsigned long long>(count(oc, grpc::StatusCode::CANCELLED)));
  std::printf("| health p50 / p99 / max | %.2f / %.2f / %.2f ms (%zu probes) |\n",
              Percentile(health_ms, 0.5), Percentile(health_ms, 0.99),
              Percentile(health_ms, 1.0), health_ms.size());
  std::printf("| Lookup p50 / p99 / max | %.2f / %.2f / %.2f ms |\n", Percentile(lookup_ms, 0.5),
              Percentile(lookup_ms, 0.99), Percentile(lookup_ms, 1.0));
  std::printf("| unexpected statuses | %llu (probe errors %llu) |\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(probe_errors));
  for (const auto* m : {&pc, &sc, &prc, &oc}) {
    for (const auto& [code, n] : *m) {
      const StatusTally& t = m == &pc ? puts : m == &sc ? stalls : m == &prc ? probes : oversize;
      if (code != grpc::StatusCode::OK) {
        std::printf("  %s x%llu, e.g. %s\n", CodeName(code), static_cast<unsigned long long>(n),
                    t.example(code).c_str());
      }
    }
  }
  kvtier::bench::JsonLine()
      .S("kind", "overload").S("label", StrFlag("label", "")).N("pool_mib", ram_mib).N("streams", streams)
      .N("stalled", stalled).N("chunk_mib", chunk_mib).N("times_pool", total_bytes / pool)
      .N("secs", secs).N("rss_idle_mib", rss_idle / 1048576.0)
      .N("rss_peak_mib", rss_peak / 1048576.0)
      .N("puts_ok", count(pc, grpc::StatusCode::OK))
      .N("puts_refused", count(pc, grpc::StatusCode::RESOURCE_EXHAUSTED))
      .N("stalls_reaped", count(sc, grpc::StatusCode::CANCELLED))
      .N("stalls_refused", count(sc, grpc::StatusCode::RESOURCE_EXHAUSTED))
      .N("oversized", oversized).N("oversized_mib", oversized_mib)
      .N("oversized_sent", oversized_sent)
      .N("oversized_cancelled", count(oc, grpc::StatusCode::CANCELLED))
      .N("unexpected", bad).N("probe_errors", probe_errors)
      .N("stored_gib", stored_bytes / 1073741824.0)
      .N("health_p50_ms", Percentile(health_ms, 0.5))
      .N("health_p99_ms", Percentile(health_ms, 0.99))
      .N("health_max_ms", Percentile(health_ms, 1.0))
      .N("lookup_p50_ms", Percentile(lookup_ms, 0.5))
      .N("lookup_p99_ms", Percentile(lookup_ms, 0.99))
      .N("lookup_max_ms", Percentile(lookup_ms, 1.0))
      .Emit();
  return bad == 0 && probe_errors == 0 ? 0 : 1;
}
