// Resident-memory benchmark: starts a real kvtierd with a given RAM pool, puts
// `factor` times that many bytes of chunks through it, samples its resident set size
// every 10 ms, and reports the peak against the pool size. The foundation's target:
// peak RSS <= ram_capacity * 1.15 under a put load of four times the capacity.
//
// usage: rss_bench [--ram-mib=1024] [--factor=4] [--chunk-mib=32] [--clients=4]
//                  [--mode=write-back|write-through|ram-only]
#include <atomic>
#include <filesystem>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/kvtier_client.h"
#include "bench/bench_flags.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace {

using kvtier::testing::DaemonProcess;

using kvtier::bench::Flag;
using kvtier::bench::StrFlag;

}  // namespace

int main(int argc, char** argv) {
  kvtier::bench::InitFlags(argc, argv);
  const uint64_t ram_mib = Flag("ram-mib", 1024);
  const uint64_t factor = Flag("factor", 4);
  const uint64_t chunk_mib = Flag("chunk-mib", 32);
  const uint64_t clients = Flag("clients", 4);
  const std::string mode = StrFlag("mode", "write-back");
  const uint64_t total_chunks = ram_mib * factor / chunk_mib;

  const std::string dir = kvtier::testing::MakeTempDir("rss-bench");
  auto daemon = DaemonProcess::Start(
      dir, {absl::StrCat("--ram-capacity=", ram_mib, "MiB"), "--write-mode=" + mode,
            absl::StrCat("--ssd-capacity=", 2 * ram_mib * factor, "MiB"), StrFlag("extra", "--log-level=info")});
  if (!daemon.ok()) {
    std::fprintf(stderr, "start: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  const uint64_t idle_rss = daemon->ResidentBytes().value_or(0);
  auto client = kvtier::KvTierClient::Connect(daemon->target());
  auto reg = (*client)->RegisterLayout(kvtier::testing::LayoutOfMiB(chunk_mib));
  if (!reg.ok()) {
    std::fprintf(stderr, "register: %s\n", reg.status().ToString().c_str());
    return 1;
  }

  std::atomic<bool> done{false};
  std::atomic<uint64_t> peak_sampled{0};
  std::thread sampler([&] {
    while (!done.load()) {
      const uint64_t rss = daemon->ResidentBytes().value_or(0);
      uint64_t prev = peak_sampled.load();
      while (rss > prev && !peak_sampled.compare_exchange_weak(prev, rss)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });

  std::atomic<uint64_t> next{0}, failures{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (uint64_t w = 0; w < clients; ++w) {
    workers.emplace_back([&] {
      kvtier::ClientOptions o;
      o.rpc_deadline = absl::Minutes(10);
      auto c = kvtier::KvTierClient::Connect(daemon->target(), o);
      // One payload per worker, re-keyed: the daemon's memory is what is measured, and
      // generating 4x RAM of distinct bytes would only measure this process.
      const std::string data = kvtier::testing::PatternBytes(w + 1, chunk_mib << 20);
      for (uint64_t i; (i = next.fetch_add(1)) < total_chunks;) {
        kvtier::ChunkToPut chunk{kvtier::testing::KeyOf(i), data, 256};
        if (!(*c)->Put(reg->namespace_id, {&chunk, 1}).ok()) failures++;
      }
    });
  }
  for (auto& t : workers) t.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  done = true;
  sampler.join();
  const uint64_t hwm = daemon->PeakResidentBytes().value_or(0);
  auto stats = (*client)->Stats();
  client->reset();
  auto code = daemon->Terminate(120);

  const double cap = static_cast<double>(ram_mib << 20);
  std::printf("| mode | RAM pool | put load | chunk | clients | idle RSS | peak RSS (VmHWM) | peak / pool | put GB/s | failed puts |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %lu MiB | %lu MiB (%lux) | %lu MiB | %lu | %.0f MiB | %.0f MiB | %.3f | %.2f | %lu |\n",
              mode.c_str(), ram_mib, ram_mib * factor, factor, chunk_mib, clients,
              idle_rss / 1048576.0, hwm / 1048576.0, hwm / cap,
              (total_chunks * (chunk_mib << 20)) / secs / 1e9, failures.load());
  if (stats.ok()) {
    std::printf("\nRAM evictions %lu, demotions %lu, SSD chunks %lu, exit code %d\n",
                stats->tiers(0).evictions(), stats->demotions(),
                stats->tiers_size() > 1 ? stats->tiers(1).chunks() : 0, code.value_or(-1));
  }
  const bool pass = hwm <= cap * 1.15 && failures.load() == 0;
  std::printf("target peak <= 1.15 x pool: %s\n", pass ? "MET" : "NOT MET");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return pass ? 0 : 3;
}
