// kvtier throughput/latency benchmark: starts its own kvtierd(s) and measures
//   --section=grid    put and get throughput (GB/s) and per-chunk latency (p50, p99) for
//                     chunk sizes x concurrent clients, from the RAM tier (--tier=ram:
//                     write-mode ram-only, pool holding the working set) or from the SSD
//                     tier (--tier=ssd: write-through, a RAM pool smaller than the working
//                     set, read cyclically so every read misses RAM; the reply's tier field
//                     is counted to prove it);
//   --section=lookup  Lookup latency of 256 present keys (thousands of samples);
//   --section=trace   a replay of the Mooncake trace (each hash id one chunk; per request
//                     Lookup, Get the hits, Put the misses) with a RAM pool smaller than
//                     the unique set (write-back), arrival times compressed;
//   --section=memcpy  single-thread memcpy bandwidth of 1 GiB buffers (median of runs).
// --skip-puts=1 leaves out the put cells (RAM tier: the gets still read a hot set), for
// profiling the get path alone.
// Every result is appended as one JSON object per line to --json=FILE (bench/report.py
// and bench/plot.py read them) and printed as a markdown line on stdout.
//
// Clients: each concurrent client is a thread with its own KvTierClient. Each gets a
// distinct max_message_bytes (64 MiB + i) so that gRPC's global subchannel pool does not
// fold all of them onto one TCP connection (--conn=shared keeps the default sharing).
// Put payloads are one shared read-only buffer per chunk size (re-keyed); gets go through
// GetStream with a callback that only counts bytes, so the benchmark's own memory stays
// small even at 128 MiB x 64 clients. The client still CRC-checks every chunk.
// --plane=shm instead moves every chunk through the same-host data plane (kvtierd with
// --shm-socket=auto; Put from and GetInto one AllocateShared buffer per client, set up
// before the clock starts; the daemon checks the CRC32C in its copy), so SSD cells
// measure the tier without loopback TCP in the way. --frame-kib and --window-kib set the
// clients' max_frame_bytes and receive_window_bytes (transport experiments);
// --malloc-pad-mib their malloc_top_pad_bytes (0: the process's allocator untouched),
// --malloc-arena-max their malloc_arena_max (default 2, as a process running many
// client threads should; 0: glibc's 8 arenas per core; the cap comes with the pad, so
// --malloc-pad-mib=0 leaves the arenas uncapped too).
// Clients connect (--preconnect=1) before a cell's clock starts, and in get cells each
// gets one chunk of the cell's size first (--warm=1, see Grid), so cells measure warm
// connections; redis_bench does the same for its connections.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/bench_flags.h"
#include "bench/json_line.h"
#include "bench/proc_stat.h"
#include "bench/trace.h"
#include "client/kvtier_client.h"
#include "client/shared_buffer.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace {

using kvtier::KvTierClient;
using kvtier::testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

using kvtier::bench::DFlag;
using kvtier::bench::Flag;
using kvtier::bench::JsonLine;
using kvtier::bench::ListFlag;
using kvtier::bench::Pct;
using kvtier::bench::ProcessCpuSeconds;
using kvtier::bench::StrFlag;

double Secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}


// --plane=shm: clients move chunks through the same-host data plane (Put from and
// GetInto a buffer from AllocateShared, one per client, set up before a cell's clock
// starts) instead of the gRPC stream.
bool SharedPlane() { return StrFlag("plane", "grpc") == "shm"; }

// Each client's shared buffer in a --plane=shm cell, holding the cell's payload. Filled
// before the cell's threads start and cleared after they join; read-only in between.
std::map<const KvTierClient*, std::shared_ptr<kvtier::SharedBuffer>> g_shared;

std::unique_ptr<KvTierClient> MakeClient(const std::string& target, int i) {
  kvtier::ClientOptions o;
  o.rpc_deadline = absl::Minutes(10);
  // Connected before a cell's clock starts, as redis_bench's clients are: a cell measures
  // transfers over warm connections, as an inference worker's would be.
  if (Flag("preconnect", 1) != 0) o.connect_timeout = absl::Seconds(30);
  if (StrFlag("conn", "per-client") != "shared") o.max_message_bytes = (64 << 20) + i;
  // --tls-dir: certificates from tests/tls/make_test_certs.sh (the daemon gets the
  // server's, the client trusts the CA); --token: a bearer token (with --tenants-file).
  if (const std::string tls = StrFlag("tls-dir", ""); !tls.empty()) {
    o.tls_ca_file = tls + "/ca.pem";
    o.tls_server_name = "localhost";
  }
  o.bearer_token = StrFlag("token", "");
  if (const int kib = Flag("frame-kib", 0); kib > 0) o.max_frame_bytes = uint32_t(kib) << 10;
  if (const int kib = Flag("window-kib", -1); kib >= 0) o.receive_window_bytes = kib << 10;
  // --h2-frame-kib: the largest HTTP/2 DATA frame the daemon may send (0: gRPC's 16 KiB);
  // the daemon's own is --daemon-args=--http2-max-frame=N.
  if (const int kib = Flag("h2-frame-kib", -1); kib >= 0) o.http2_max_frame_bytes = kib << 10;
  if (const int mib = Flag("malloc-pad-mib", -1); mib >= 0) {
    o.malloc_top_pad_bytes = uint64_t(mib) << 20;
  }
  o.malloc_arena_max = uint32_t(Flag("malloc-arena-max", 2));
  if (SharedPlane()) o.data_plane = kvtier::ClientOptions::DataPlane::kSharedMemory;
  // --put-header-wait=always: every Put waits for the daemon's headers (the client's
  // default, adaptive, skips the wait while the daemon says its Put places are free).
  if (StrFlag("put-header-wait", "adaptive") == "always") {
    o.put_header_wait = kvtier::ClientOptions::PutHeaderWait::kAlways;
  }
  auto c = KvTierClient::Connect(target, o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(c);
}

// Bytes the daemon has caused to be written to the storage device (write_bytes in
// /proc/<pid>/io: page-cache writeback and O_DIRECT writes alike); 0 if unreadable.
uint64_t DeviceWriteBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/io");
  std::string key;
  uint64_t value = 0;
  while (in >> key >> value) {
    if (key == "write_bytes:") return value;
  }
  return 0;
}

// Peak RSS of the daemon, sampled every 20 ms while alive.
class RssSampler {
 public:
  explicit RssSampler(const DaemonProcess* d) : d_(d), t_([this] {
    while (!stop_.load()) {
      peak_ = std::max<uint64_t>(peak_, d_->ResidentBytes().value_or(0));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }) {}
  uint64_t Stop() {
    stop_ = true;
    if (t_.joinable()) t_.join();
    return std::max<uint64_t>(peak_, d_->PeakResidentBytes().value_or(0));
  }
  ~RssSampler() { Stop(); }

 private:
  const DaemonProcess* d_;
  std::atomic<bool> stop_{false};
  uint64_t peak_ = 0;
  std::thread t_;
};

struct Cell {
  std::string tier, op;
  uint64_t chunk_bytes = 0, clients = 0, ops = 0, bytes = 0;
  double secs = 0;
  std::vector<double> lat_ms;
  std::atomic<uint64_t> from_ram{0}, from_ssd{0}, errors{0}, retries{0}, absent{0};
  // Put cells: bytes the daemon wrote to the device during the cell (0: not measured).
  uint64_t device_write_bytes = 0;
  // CPU seconds (user + system) over the cell's clock: the daemon's (when daemon_pid is
  // set) and this process's, i.e. the clients'. What a byte costs when both ends share
  // the machine's cores.
  pid_t daemon_pid = 0;
  double daemon_cpu_s = 0, client_cpu_s = 0;
};

// `runs`: every round's GB/s when the cell is the median of several (--rounds).
void EmitCell(Cell& c, const std::vector<double>& runs = {}) {
  const double gbps = c.bytes / c.secs / 1e9;
  JsonLine line;
  line.S("kind", "cell").S("tier", c.tier).S("op", c.op)
      .N("chunk_mib", c.chunk_bytes / 1048576.0).N("clients", c.clients).N("ops", c.ops)
      .N("bytes", c.bytes).N("secs", c.secs).N("gbps", gbps)
      .N("p50_ms", Pct(c.lat_ms, 0.5)).N("p90_ms", Pct(c.lat_ms, 0.9))
      .N("p99_ms", Pct(c.lat_ms, 0.99)).N("max_ms", Pct(c.lat_ms, 1.0))
      .N("from_ram", c.from_ram).N("from_ssd", c.from_ssd).N("absent", c.absent)
      .N("errors", c.errors).N("retries", c.retries)
      .N("device_write_bytes", c.device_write_bytes)
      .N("write_amp", c.bytes ? double(c.device_write_bytes) / c.bytes : 0.0)
      .N("daemon_cpu_s", c.daemon_cpu_s).N("client_cpu_s", c.client_cpu_s);
  if (!runs.empty()) line.V("gbps_rounds", runs);
  line.Emit();
  std::printf("| %s | %s | %.0f MiB | %lu | %lu | %.2f GiB | %.2f s | %.3f | %.2f | %.2f | %lu/%lu | %lu |\n",
              c.tier.c_str(), c.op.c_str(), c.chunk_bytes / 1048576.0, c.clients, c.ops,
              c.bytes / 1073741824.0, c.secs, gbps, Pct(c.lat_ms, 0.5), Pct(c.lat_ms, 0.99),
              c.from_ram.load(), c.from_ssd.load(), c.errors.load());
  std::fflush(stdout);
}

// A cell measured in several rounds: emits the round of median throughput (the lower of
// the two middle ones for an even count), with every round's GB/s beside it.
void EmitMedian(std::vector<std::unique_ptr<Cell>>& rounds) {
  if (rounds.empty()) return;
  std::vector<double> runs;
  for (const auto& c : rounds) runs.push_back(c->bytes / c->secs / 1e9);
  std::vector<Cell*> sorted;
  for (auto& c : rounds) sorted.push_back(c.get());
  std::sort(sorted.begin(), sorted.end(), [](const Cell* a, const Cell* b) {
    return a->bytes / a->secs < b->bytes / b->secs;
  });
  EmitCell(*sorted[(sorted.size() - 1) / 2], rounds.size() > 1 ? runs : std::vector<double>{});
}

// Runs `ops` operations over `clients` threads; op(client, i, cell) returns bytes moved
// or -1 on failure. Latency is per operation.
template <typename Op>
void RunCell(const std::string& target, Cell& cell, const Op& op,
             const std::function<void(KvTierClient&)>& warm = nullptr) {
  std::vector<std::unique_ptr<KvTierClient>> clients;
  for (uint64_t w = 0; w < cell.clients; ++w) clients.push_back(MakeClient(target, w));
  if (SharedPlane()) {
    const std::string payload =
        kvtier::testing::PatternBytes(cell.chunk_bytes >> 20, cell.chunk_bytes);
    for (auto& c : clients) {
      auto buf = c->AllocateShared(cell.chunk_bytes);
      if (!buf.ok()) {
        std::fprintf(stderr, "shared buffer: %s\n", buf.status().ToString().c_str());
        std::exit(1);
      }
      std::memcpy((*buf)->data(), payload.data(), payload.size());
      g_shared[c.get()] = *std::move(buf);
    }
  }
  if (warm) {
    std::vector<std::thread> ts;
    for (auto& c : clients) ts.emplace_back([&warm, &c] { warm(*c); });
    for (auto& t : ts) t.join();
  }
  std::atomic<uint64_t> next{0}, bytes{0};
  std::mutex mu;
  std::vector<std::thread> workers;
  const double daemon_cpu0 = cell.daemon_pid ? ProcessCpuSeconds(cell.daemon_pid) : 0;
  const double client_cpu0 = ProcessCpuSeconds(::getpid());
  const auto start = Clock::now();
  for (uint64_t w = 0; w < cell.clients; ++w) {
    workers.emplace_back([&, w] {
      std::vector<double> lat;
      for (uint64_t i; (i = next.fetch_add(1)) < cell.ops;) {
        const auto t0 = Clock::now();
        const int64_t n = op(*clients[w], i, cell);
        lat.push_back(Secs(t0, Clock::now()) * 1e3);
        if (n < 0) {
          cell.errors++;
        } else {
          bytes += n;
        }
      }
      std::lock_guard<std::mutex> l(mu);
      cell.lat_ms.insert(cell.lat_ms.end(), lat.begin(), lat.end());
    });
  }
  for (auto& t : workers) t.join();
  cell.secs = Secs(start, Clock::now());
  cell.bytes = bytes;
  if (cell.daemon_pid) cell.daemon_cpu_s = ProcessCpuSeconds(cell.daemon_pid) - daemon_cpu0;
  cell.client_cpu_s = ProcessCpuSeconds(::getpid()) - client_cpu0;
  g_shared.clear();
}

int64_t PutOne(KvTierClient& c, uint64_t ns, const kvtier::ChunkKey& key,
               const std::string& data, Cell& cell) {
  kvtier::ChunkToPut chunk{key, data, 256};
  if (auto it = g_shared.find(&c); it != g_shared.end()) {
    chunk.data = absl::string_view(it->second->data(), data.size());
  }
  // The pool refuses a put (ResourceExhausted) while in-flight puts hold all of it; the
  // client backs off and retries, for up to two minutes.
  const auto give_up = Clock::now() + std::chrono::minutes(2);
  for (uint64_t attempt = 0;; ++attempt) {
    auto r = c.Put(ns, {&chunk, 1});
    if (r.ok()) return data.size();
    if (!absl::IsResourceExhausted(r.status()) || Clock::now() > give_up) {
      std::fprintf(stderr, "put: %s\n", r.status().ToString().c_str());
      return -1;
    }
    cell.retries++;
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + (attempt * 7 + key.hi) % 20));
  }
}

int64_t GetOne(KvTierClient& c, uint64_t ns, const kvtier::ChunkKey& key, Cell& cell) {
  if (auto it = g_shared.find(&c); it != g_shared.end()) {
    const kvtier::SharedBuffer& buf = *it->second;
    auto r = c.GetInto(ns, {&key, 1}, absl::Span<char>(buf.data(), buf.size()));
    if (!r.ok()) {
      std::fprintf(stderr, "get: %s\n", r.status().ToString().c_str());
      return -1;
    }
    if (!r->found[0]) {
      cell.absent++;
      return 0;
    }
    if (r->path != kvtier::DataPath::kSharedMemory) {
      std::fprintf(stderr, "get: came by the stream, not shared memory\n");
      return -1;
    }
    if (r->tiers[0] == kvtier::v1::TIER_SSD) cell.from_ssd++;
    if (r->tiers[0] == kvtier::v1::TIER_RAM) cell.from_ram++;
    return buf.size();
  }
  uint64_t got = 0;
  absl::Status s = c.GetStreamRaw(ns, {&key, 1}, std::nullopt,
                               [&](uint32_t, const kvtier::GetFrameHeader& f, absl::Span<const absl::string_view> d) {
                                 if (f.offset() == 0) {
                                   if (!f.found()) cell.absent++;
                                   else if (f.tier() == kvtier::v1::TIER_SSD) cell.from_ssd++;
                                   else if (f.tier() == kvtier::v1::TIER_RAM) cell.from_ram++;
                                 }
                                 for (auto p : d) got += p.size();
                                 return absl::OkStatus();
                               });
  if (!s.ok()) {
    std::fprintf(stderr, "get: %s\n", s.ToString().c_str());
    return -1;
  }
  return got;
}

// --prefault=0 measures a daemon whose pool pages are still unfaulted (its first pass over
// the pool pays a page fault per 4 KiB); the default, as the daemon's, faults them in at
// start-up, and the cells start once that is done (a long-running daemon's pool is warm).
std::vector<std::string> DaemonArgs(const std::string& mode, uint64_t ram_mib, uint64_t ssd_mib) {
  std::vector<std::string> args = {
      absl::StrCat("--ram-capacity=", ram_mib, "MiB"), "--write-mode=" + mode,
      absl::StrCat("--ssd-capacity=", ssd_mib, "MiB"), "--log-level=warn",
      Flag("prefault", 1) != 0 ? "--ram-prefault=true" : "--ram-prefault=false"};
  if (SharedPlane()) args.push_back("--shm-socket=auto");
  // --slot-kib: the pool's slot size (the daemon's default when unset).
  if (const uint64_t kib = Flag("slot-kib", 0); kib != 0) {
    args.push_back(absl::StrCat("--ram-slot-size=", kib, "KiB"));
  }
  // --writeback-threads: the daemon's background SSD writers (its default when unset).
  if (const uint64_t n = Flag("writeback-threads", 0); n != 0) {
    args.push_back(absl::StrCat("--writeback-threads=", n));
  }
  // --writeback-max-dirty-mib: the daemon's bound on the write-back backlog (its
  // default, half the pool, when unset).
  if (const uint64_t mib = Flag("writeback-max-dirty-mib", 0); mib != 0) {
    args.push_back(absl::StrCat("--writeback-max-dirty=", mib, "MiB"));
  }
  // The shared tier (bench/remote.sh): the daemon's Redis Cluster seeds; an address where
  // nothing listens measures the local tiers with the cluster down.
  if (const std::string seeds = StrFlag("remote-seeds", ""); !seeds.empty()) {
    args.push_back("--remote-seeds=" + seeds);
  }
  // Security (bench/security.sh): TLS from --tls-dir, tenants from --tenants-file.
  if (const std::string tls = StrFlag("tls-dir", ""); !tls.empty()) {
    args.push_back("--tls-cert-file=" + tls + "/server.pem");
    args.push_back("--tls-key-file=" + tls + "/server.key");
  }
  if (const std::string tenants = StrFlag("tenants-file", ""); !tenants.empty()) {
    args.push_back("--tenants-file=" + tenants);
  }
  // --daemon-args=a,b: any other daemon options, as given (an A/B of one option).
  for (absl::string_view a : absl::StrSplit(StrFlag("daemon-args", ""), ',', absl::SkipEmpty())) {
    args.emplace_back(a);
  }
  return args;
}

// Waits until the daemon's pool is faulted in (with --prefault), at most two minutes.
// Returns whether it is.
bool WaitForPrefault(KvTierClient& c) {
  if (Flag("prefault", 1) == 0) return false;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::minutes(2)) {
    auto stats = c.Stats();
    if (!stats.ok()) break;
    for (const auto& t : stats->tiers()) {
      if (t.tier() == kvtier::v1::TIER_RAM && t.prefaulted_bytes() >= t.capacity_bytes()) {
        std::fprintf(stderr, "pool prefaulted in %.1f s\n",
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                         .count());
        return true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::fprintf(stderr, "warning: the pool was not prefaulted within 2 minutes\n");
  return false;
}

// The daemon's fixed allowance beside its pool (issue 10's RSS target: peak at most the
// pool x 1.15 + an allowance that grows with neither chunk size nor client count): the
// idle process once its pool is faulted in (code, libraries, RocksDB open; its RSS less
// the pool), and the buffers its options bound beside the pool, as it exports them
// (kvtier_memory_bound_bytes, DaemonConfig::MemoryBesidePool).
struct Allowance {
  double process_mib = 0;
  double buffers_mib = 0;
  std::string parts;  // "put_buffer 64, ..." in MiB.
  bool valid = true;
};

Allowance MeasureAllowance(const DaemonProcess& daemon, uint64_t ram_mib, bool prefaulted) {
  Allowance a;
  if (!prefaulted) {
    // The idle process is RSS less the pool only once the pool is resident.
    std::fprintf(stderr, "warning: pool not prefaulted, no RSS allowance measured\n");
    a.valid = false;
    return a;
  }
  a.process_mib = std::max(0.0, daemon.ResidentBytes().value_or(0) / 1048576.0 - double(ram_mib));
  auto r = kvtier::testing::HttpGet(daemon.metrics_port(), "/metrics");
  if (!r.ok() || r->status != 200) {
    std::fprintf(stderr, "warning: no /metrics, allowance without buffers\n");
    return a;
  }
  for (absl::string_view line : absl::StrSplit(r->body, '\n')) {
    constexpr absl::string_view kPrefix = "kvtier_memory_bound_bytes{part=\"";
    if (!absl::StartsWith(line, kPrefix)) continue;
    line.remove_prefix(kPrefix.size());
    const size_t quote = line.find('"');
    const size_t space = line.rfind(' ');
    double bytes = 0;
    if (quote == absl::string_view::npos || space == absl::string_view::npos ||
        !absl::SimpleAtod(line.substr(space + 1), &bytes)) {
      continue;
    }
    const absl::string_view part = line.substr(0, quote);
    // Not the grid's: it makes no Prefill calls, whose SSD reads take whole-chunk buffers.
    if (part == "pool" || part == "prefill_ssd_reads") continue;
    a.buffers_mib += bytes / 1048576.0;
    absl::StrAppend(&a.parts, a.parts.empty() ? "" : ", ", part, " ", bytes / 1048576.0);
  }
  return a;
}

DaemonProcess StartDaemon(const std::string& dir, const std::vector<std::string>& args) {
  auto d = DaemonProcess::Start(dir, args);
  if (!d.ok()) {
    std::fprintf(stderr, "start kvtierd: %s\n", d.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(d);
}

uint64_t Register(KvTierClient& c, const kvtier::LayoutSpec& l) {
  auto r = c.RegisterLayout(l);
  if (!r.ok()) {
    std::fprintf(stderr, "register: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  return r->namespace_id;
}

void PrintCellHeader() {
  std::printf("| tier | op | chunk | clients | ops | bytes | time | GB/s | p50 ms | p99 ms | ram/ssd reads | errors |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
}

// ---- grid ----
int Grid(const std::string& dir) {
  // --label: the cells' tier label (default the tier; security.sh tells its variants apart).
  const std::string tier_name = StrFlag("tier", "ram");
  const std::string tier = StrFlag("label", tier_name);
  const auto chunks = ListFlag("chunks", "2,32,128");
  const auto client_counts = ListFlag("clients", "1,4,16,64");
  const uint64_t budget = Flag("budget-mib", tier_name == "ram" ? 2048 : 512) << 20;
  const uint64_t get_budget = Flag("get-budget-mib", budget >> 20) << 20;
  const uint64_t ram_mib = Flag("ram-mib", tier_name == "ram" ? 4096 : 256);
  const uint64_t hot_mib = Flag("hot-mib", 1024);  // RAM-tier get working set.
  // Each client does at least this many operations per cell: with one each, a cell's
  // time is set by the last of its streams to finish, and a 64-client cell of 32 MiB
  // chunks lasts about a second on this machine.
  const uint64_t min_ops = std::max<uint64_t>(1, Flag("min-ops-per-client", 1));
  // ... and moves at least this many MiB (0: no floor). Small chunks need it: a 64-client
  // cell of 2 MiB chunks with the grid's 1.5 GiB budget gives each client 12 gets and
  // lasts a second, and its start (64 threads) and its tail (the last streams finishing
  // alone) set its rate: RAM get, 2 MiB, 64 clients, 1.67 GB/s with 12 gets per client
  // against 2.28 with 48, on this machine; SSD get 0.49 against 1.04 with 2 and 16.
  const uint64_t min_bytes = Flag("min-mib-per-client", 0) << 20;
  auto cell_ops_for = [&](uint64_t clients, uint64_t cell_budget, uint64_t cb) {
    const uint64_t per_client = std::max(min_ops, (min_bytes + cb - 1) / cb);
    return std::max(clients * per_client, cell_budget / cb);
  };
  // --equal-cells=1: every client count of an operation and chunk size moves as much as
  // the largest (the 64-client cell, where the floor above sets it). Without it, a RAM
  // put cell of 64 clients put 6 GiB into a 4 GiB pool and paid for evicting 2 GiB
  // while the 4-client cell put 1.5 GiB, and the two were compared as if alike (equal
  // 6 GiB cells that both evict: 1.78 GB/s at 4 clients, 1.89 at 64).
  const bool equal_cells = Flag("equal-cells", 0) != 0;
  auto cell_ops = [&](uint64_t clients, uint64_t cell_budget, uint64_t cb) {
    if (!equal_cells) return cell_ops_for(clients, cell_budget, cb);
    uint64_t most = 0;
    for (uint64_t n : client_counts) most = std::max(most, cell_ops_for(n, cell_budget, cb));
    return most;
  };
  // --rounds=N measures every cell N times, the client counts interleaved (round 1 of
  // each, then round 2, ...), and reports each cell's median round: one run of a
  // sub-second cell moved by +-0.15 on this shared 2-vCPU machine, and the peak over
  // client counts, a maximum of such runs, was biased upwards.
  const uint64_t rounds = std::max<uint64_t>(1, Flag("rounds", 1));
  // --mode: the daemon's write mode (ram-only for the RAM tier and write-through for the
  // SSD tier unless given; write-back measures puts drained by the background writers).
  const std::string mode = StrFlag("mode", tier_name == "ram" ? "ram-only" : "write-through");
  auto daemon = StartDaemon(dir, DaemonArgs(mode, ram_mib, Flag("ssd-mib", 65536)));
  RssSampler rss(&daemon);
  auto admin = MakeClient(daemon.target(), 100000);
  const bool prefaulted = WaitForPrefault(*admin);
  const Allowance allowance = MeasureAllowance(daemon, ram_mib, prefaulted);
  PrintCellHeader();
  uint64_t key_base = 0;
  for (uint64_t cmib : chunks) {
    const uint64_t cb = cmib << 20;
    const uint64_t ns = Register(*admin, kvtier::testing::LayoutOfMiB(cmib));
    const std::string payload = kvtier::testing::PatternBytes(cmib, cb);
    std::vector<kvtier::ChunkKey> written;
    // Before a cell's clock starts, each client moves one chunk of the cell's size (a put
    // cell puts it, a get cell gets it, pinned in RAM in a namespace of its own), so that
    // the cell measures warm connections, as a long-running worker's are. The receiving
    // end of a fresh connection grows its buffers while its first chunk arrives, and on
    // this VM a first touch of a page is dear: a 64-client cell's first 32 MiB per
    // connection cost the daemon about 3.5 CPU-seconds per GB against 0.4-0.6 warm. Measured on this machine, 32 MiB, 64 clients, cold against warm: RAM put
    // 1.10-1.21 against 2.04-2.28 GB/s, RAM get 0.7-1.2 against 2.1-2.3, SSD
    // write-through put 0.50-0.57 against 0.61-0.72 (4 clients 0.61-0.70 against
    // 0.84-0.97).
    const bool warm_up = Flag("warm", 1) != 0;
    const uint64_t warm_ns = Register(*admin, kvtier::testing::LayoutOfMiB(cmib));
    const kvtier::ChunkKey warm_key = kvtier::testing::KeyOf(~0ull);
    // Each warm-up must find the chunk: a connection that is not warmed makes a 64-client
    // get cell about half as fast, and no cell may quietly measure that instead.
    auto warm = [&]() -> std::function<void(KvTierClient&)> {
      if (!warm_up) return nullptr;
      return [&](KvTierClient& c) {
        Cell got;
        if (GetOne(c, warm_ns, warm_key, got) <= 0 || got.absent != 0) {
          std::fprintf(stderr, "warm-up chunk: get did not find it\n");
          std::exit(1);
        }
      };
    };
    std::map<uint64_t, std::vector<std::unique_ptr<Cell>>> measured;
    for (uint64_t round = 0; round < rounds; ++round)
    for (uint64_t clients : client_counts) {
      if (Flag("skip-puts", 0) != 0) break;  // Profiling the get path only.
      Cell& cell = *measured[clients].emplace_back(std::make_unique<Cell>());
      cell.tier = tier, cell.op = "put", cell.chunk_bytes = cb, cell.clients = clients;
      cell.ops = cell_ops(clients, budget, cb);
      cell.daemon_pid = daemon.pid();
      const uint64_t base = key_base;
      key_base += cell.ops;
      const uint64_t device_before = DeviceWriteBytes(daemon.pid());
      // The first warm-up stores the chunk; the others are idempotent puts, whose frames
      // the daemon still receives (and drops).
      std::function<void(KvTierClient&)> warm_put;
      if (warm_up) {
        warm_put = [&](KvTierClient& c) {
          Cell ignored;
          if (PutOne(c, warm_ns, warm_key, payload, ignored) < 0) {
            std::fprintf(stderr, "warm-up chunk: put failed\n");
            std::exit(1);
          }
        };
      }
      RunCell(daemon.target(), cell, [&](KvTierClient& c, uint64_t i, Cell& cl) {
        return PutOne(c, ns, kvtier::testing::KeyOf(base + i), payload, cl);
      }, warm_put);
      // Write-through: every acknowledged byte is on the device by now. (Page-cache
      // writeback still pending is missed; the SSD tier writes payloads with O_DIRECT.)
      cell.device_write_bytes = DeviceWriteBytes(daemon.pid()) - device_before;
      for (uint64_t i = 0; i < cell.ops; ++i) written.push_back(kvtier::testing::KeyOf(base + i));
    }
    for (uint64_t clients : client_counts) EmitMedian(measured[clients]);
    measured.clear();
    // Working set of the gets.
    std::vector<kvtier::ChunkKey> ws;
    if (Flag("skip-gets", 0) != 0) {
    } else if (tier_name == "ram") {
      // A hot set that fits the pool, put afresh (so it is the most recently used).
      const uint64_t n = std::max<uint64_t>(1, std::min(hot_mib << 20, (ram_mib << 20) / 2) / cb);
      Cell warm;
      warm.chunk_bytes = cb, warm.clients = 4, warm.ops = n;
      const uint64_t base = key_base;
      key_base += n;
      RunCell(daemon.target(), warm, [&](KvTierClient& c, uint64_t i, Cell& cl) {
        return PutOne(c, ns, kvtier::testing::KeyOf(base + i), payload, cl);
      });
      for (uint64_t i = 0; i < n; ++i) ws.push_back(kvtier::testing::KeyOf(base + i));
    } else {
      ws = written;  // Everything put above: far more than the RAM pool.
    }
    // The warm-up chunk is put and pinned only now, after the put cells and the hot set:
    // put before them, the RAM tier's put cells evicted it once they overflowed the pool,
    // and every get cell after them ran on cold connections (64 clients, 32 MiB: 1.0-1.2
    // GB/s against 2.1-2.3 warm).
    if (warm_up && Flag("skip-gets", 0) == 0) {
      Cell ignored;
      if (PutOne(*admin, warm_ns, warm_key, payload, ignored) < 0) {
        std::fprintf(stderr, "warm-up chunk: put failed\n");
        return 1;
      }
      auto pinned = admin->Pin(warm_ns, {&warm_key, 1}, 0);
      if (!pinned.ok() || pinned->pinned != 1) {
        std::fprintf(stderr, "warm-up chunk: pin failed: %s\n",
                     pinned.ok() ? "not pinned" : pinned.status().ToString().c_str());
        return 1;
      }
    }
    uint64_t cursor = 0;  // SSD: each cell continues the cycle where the last one stopped.
    for (uint64_t round = 0; round < rounds; ++round)
    for (uint64_t clients : client_counts) {
      if (Flag("skip-gets", 0) != 0) break;  // Profiling the put path only.
      Cell& cell = *measured[clients].emplace_back(std::make_unique<Cell>());
      cell.tier = tier, cell.op = "get", cell.chunk_bytes = cb, cell.clients = clients;
      cell.ops = cell_ops(clients, get_budget, cb);
      cell.daemon_pid = daemon.pid();
      if (tier_name == "ssd") cell.ops = std::min<uint64_t>(std::max(cell.ops, clients), ws.size());
      const uint64_t start = tier_name == "ssd" ? cursor : 0;
      RunCell(daemon.target(), cell, [&](KvTierClient& c, uint64_t i, Cell& cl) {
        return GetOne(c, ns, ws[(start + i) % ws.size()], cl);
      }, warm());
      cursor = start + cell.ops;
    }
    for (uint64_t clients : client_counts) EmitMedian(measured[clients]);
    if (warm_up) {
      admin->Unpin(warm_ns, {&warm_key, 1}).IgnoreError();
      admin->Delete(warm_ns, {&warm_key, 1}).IgnoreError();
    }
    // Each chunk size starts on an empty store: the SSD tier's data directory then holds
    // one size's chunks at most (the grid's 128 MiB cells write 42 GiB), and no size
    // pays for evicting the last one's.
    std::vector<kvtier::ChunkKey> stored = std::move(written);
    if (tier_name == "ram") stored.insert(stored.end(), ws.begin(), ws.end());
    for (size_t at = 0; at < stored.size(); at += 4096) {
      const size_t n = std::min<size_t>(4096, stored.size() - at);
      auto deleted = admin->Delete(ns, absl::MakeConstSpan(stored).subspan(at, n));
      if (!deleted.ok()) {
        std::fprintf(stderr, "deleting the %lu MiB chunks: %s\n", cmib,
                     deleted.status().ToString().c_str());
        return 1;
      }
    }
  }
  const uint64_t peak = rss.Stop();
  const double bound_mib = 1.15 * double(ram_mib) + allowance.process_mib + allowance.buffers_mib;
  JsonLine line;
  line.S("kind", "rss").S("tier", tier).N("pool_mib", ram_mib)
      .N("peak_rss_mib", peak / 1048576.0).N("ratio", peak / double(ram_mib << 20));
  if (allowance.valid) {
    line.N("process_mib", allowance.process_mib).N("buffers_mib", allowance.buffers_mib)
        .S("buffers", allowance.parts).N("bound_mib", bound_mib);
  }
  line.Emit();
  std::printf("\n%s daemon: pool %lu MiB, peak RSS %.0f MiB (%.3f x pool)\n", tier.c_str(),
              ram_mib, peak / 1048576.0, peak / double(ram_mib << 20));
  if (allowance.valid) {
    std::printf("pool x 1.15 + allowance (process %.0f MiB + buffers %.0f MiB: %s) = %.0f MiB\n",
                allowance.process_mib, allowance.buffers_mib, allowance.parts.c_str(), bound_mib);
  }
  daemon.Terminate(120).IgnoreError();
  return 0;
}

// ---- lookup ----
int Lookup(const std::string& dir) {
  const uint64_t nkeys = Flag("keys", 256), samples = Flag("samples", 5000);
  auto daemon = StartDaemon(dir, DaemonArgs("ram-only", 1024, 1024));
  auto c = MakeClient(daemon.target(), 0);
  const uint64_t ns = Register(*c, kvtier::testing::LayoutOfMiB(2));
  const std::string payload = kvtier::testing::PatternBytes(7, 2 << 20);
  std::vector<kvtier::ChunkKey> keys;
  Cell dummy;
  for (uint64_t i = 0; i < nkeys; ++i) {
    keys.push_back(kvtier::testing::KeyOf(i));
    PutOne(*c, ns, keys.back(), payload, dummy);
  }
  for (uint64_t clients : ListFlag("clients", "1,4")) {
    std::vector<double> lat;
    std::mutex mu;
    std::atomic<uint64_t> next{0}, bad{0};
    std::vector<std::thread> ts;
    const auto t0 = Clock::now();
    for (uint64_t w = 0; w < clients; ++w) {
      ts.emplace_back([&, w] {
        auto cl = MakeClient(daemon.target(), w + 1);
        cl->Lookup(ns, keys).IgnoreError();  // Connect.
        std::vector<double> mine;
        while (next.fetch_add(1) < samples) {
          const auto a = Clock::now();
          auto r = cl->Lookup(ns, keys);
          mine.push_back(Secs(a, Clock::now()) * 1e3);
          if (!r.ok() || r->prefix_hits != nkeys) bad++;
        }
        std::lock_guard<std::mutex> l(mu);
        lat.insert(lat.end(), mine.begin(), mine.end());
      });
    }
    for (auto& t : ts) t.join();
    const double secs = Secs(t0, Clock::now());
    JsonLine().S("kind", "lookup").N("keys", nkeys).N("clients", clients).N("samples", lat.size())
        .N("p50_ms", Pct(lat, 0.5)).N("p99_ms", Pct(lat, 0.99)).N("p999_ms", Pct(lat, 0.999))
        .N("per_sec", lat.size() / secs).N("bad", bad).Emit();
    std::printf("lookup %lu keys, %lu clients: %zu samples, p50 %.3f ms, p99 %.3f ms, %.0f/s, %lu bad\n",
                nkeys, clients, lat.size(), Pct(lat, 0.5), Pct(lat, 0.99), lat.size() / secs, bad.load());
  }
  daemon.Terminate(60).IgnoreError();
  return 0;
}

// ---- trace ----
using kvtier::bench::LoadTrace;

int Trace(const std::string& dir) {
  const std::string path =
      StrFlag("trace", "/work/shared/data/traces/mooncake_synthetic_trace.jsonl");
  const auto reqs = LoadTrace(path, Flag("trace-requests", 1u << 30));
  if (reqs.empty()) {
    std::fprintf(stderr, "no trace at %s\n", path.c_str());
    return 1;
  }
  const uint64_t chunk_kib = Flag("trace-chunk-kib", 128);
  const uint64_t ram_mib = Flag("ram-mib", 512);
  const double compress = DFlag("compress", 100);
  const uint64_t workers = Flag("workers", 16);
  auto daemon = StartDaemon(dir, DaemonArgs(StrFlag("mode", "write-back"), ram_mib, 65536));
  RssSampler rss(&daemon);
  auto admin = MakeClient(daemon.target(), 100000);
  WaitForPrefault(*admin);
  kvtier::LayoutSpec layout = kvtier::testing::LayoutOfMiB(1, "trace-model");
  layout.tokens_per_chunk = static_cast<uint32_t>(chunk_kib / 4);  // 4 KiB per token.
  const uint64_t ns = Register(*admin, layout);
  const uint64_t cb = layout.ChunkBytes();
  const std::string payload = kvtier::testing::PatternBytes(11, cb);
  uint64_t unique = 0, refs = 0;
  {
    std::vector<uint64_t> all;
    for (auto& r : reqs) all.insert(all.end(), r.ids.begin(), r.ids.end()), refs += r.ids.size();
    std::sort(all.begin(), all.end());
    unique = std::unique(all.begin(), all.end()) - all.begin();
  }
  std::atomic<uint64_t> next{0}, hit_chunks{0}, ram_hits{0}, ssd_hits{0}, lost{0}, puts{0},
      got_bytes{0}, put_bytes{0}, errors{0}, prefix_hits{0};
  std::vector<double> lat;
  std::mutex mu;
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (uint64_t w = 0; w < workers; ++w) {
    ts.emplace_back([&, w] {
      auto c = MakeClient(daemon.target(), w);
      std::vector<double> mine;
      for (uint64_t i; (i = next.fetch_add(1)) < reqs.size();) {
        const auto due = t0 + std::chrono::microseconds(
                                  static_cast<int64_t>(reqs[i].ts_ms * 1000 / compress));
        std::this_thread::sleep_until(due);
        const auto a = Clock::now();
        std::vector<kvtier::ChunkKey> keys;
        for (uint64_t id : reqs[i].ids) keys.push_back(kvtier::testing::KeyOf(1000000000ull + id));
        auto lk = c->Lookup(ns, keys);
        if (!lk.ok()) {
          errors++;
          continue;
        }
        prefix_hits += lk->prefix_hits;
        std::vector<kvtier::ChunkKey> hits;
        std::vector<bool> have(keys.size(), false);
        std::vector<size_t> hit_idx;
        for (size_t k = 0; k < keys.size(); ++k) {
          if (lk->tiers[k] != kvtier::v1::TIER_UNSPECIFIED) hits.push_back(keys[k]), hit_idx.push_back(k);
        }
        if (!hits.empty()) {
          absl::Status s = c->GetStreamRaw(ns, hits, std::nullopt,
                                        [&](uint32_t idx, const kvtier::GetFrameHeader& f, absl::Span<const absl::string_view> d) {
                                          if (f.offset() == 0) {
                                            if (!f.found()) {
                                              lost++;
                                            } else {
                                              have[hit_idx[idx]] = true;
                                              hit_chunks++;
                                              (f.tier() == kvtier::v1::TIER_SSD ? ssd_hits : ram_hits)++;
                                            }
                                          }
                                          for (auto p : d) got_bytes += p.size();
                                          return absl::OkStatus();
                                        });
          if (!s.ok()) errors++;
        }
        std::vector<kvtier::ChunkToPut> miss;
        for (size_t k = 0; k < keys.size(); ++k) {
          if (!have[k]) miss.push_back({keys[k], payload, layout.tokens_per_chunk});
        }
        if (!miss.empty()) {
          auto r = c->Put(ns, miss);
          if (r.ok()) {
            puts += miss.size();
            put_bytes += r->bytes;
          } else {
            errors++;
          }
        }
        mine.push_back(Secs(a, Clock::now()) * 1e3);
      }
      std::lock_guard<std::mutex> l(mu);
      lat.insert(lat.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : ts) t.join();
  const double secs = Secs(t0, Clock::now());
  const uint64_t peak = rss.Stop();
  auto st = admin->Stats();
  const double hit_ratio = hit_chunks / double(refs);
  // Offline: the best any cache could do is hit every reference but the first of each id.
  const double ideal = (refs - unique) / double(refs);
  JsonLine().S("kind", "trace").S("trace", path).N("requests", reqs.size()).N("chunk_refs", refs)
      .N("unique_chunks", unique).N("chunk_kib", cb / 1024.0).N("ram_mib", ram_mib)
      .N("compress", compress).N("workers", workers).N("span_s", reqs.back().ts_ms / 1000)
      .N("secs", secs).N("hit_ratio", hit_ratio).N("ideal_hit_ratio", ideal)
      .N("prefix_hit_ratio", prefix_hits / double(refs))
      .N("ram_hits", ram_hits).N("ssd_hits", ssd_hits).N("lost", lost).N("puts", puts)
      .N("got_gb", got_bytes / 1e9).N("put_gb", put_bytes / 1e9)
      .N("gbps", (got_bytes + put_bytes) / secs / 1e9).N("req_per_s", reqs.size() / secs)
      .N("p50_ms", Pct(lat, 0.5)).N("p99_ms", Pct(lat, 0.99)).N("errors", errors)
      .N("evictions", st.ok() ? st->tiers(0).evictions() : 0)
      .N("demotions", st.ok() ? st->demotions() : 0)
      .N("peak_rss_mib", peak / 1048576.0).Emit();
  std::printf("trace: %zu requests, %lu chunk refs (%lu unique, %.0f KiB each), RAM pool %lu MiB\n"
              "hit ratio %.3f (ideal %.3f; RAM %lu, SSD %lu), %.2f GB/s, %.1f req/s, "
              "latency p50 %.1f ms p99 %.1f ms, %lu errors, %.1f s\n",
              reqs.size(), refs, unique, cb / 1024.0, ram_mib, hit_ratio, ideal, ram_hits.load(),
              ssd_hits.load(), (got_bytes + put_bytes) / secs / 1e9, reqs.size() / secs,
              Pct(lat, 0.5), Pct(lat, 0.99), errors.load(), secs);
  admin.reset();
  daemon.Terminate(300).IgnoreError();
  return 0;
}

// ---- memcpy ----
int Memcpy() {
  const size_t n = Flag("memcpy-mib", 1024) << 20;
  std::vector<char> a(n, 1), b(n, 2);
  std::vector<double> gbps;
  for (int r = 0; r < static_cast<int>(Flag("runs", 7)); ++r) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    gbps.push_back(n / Secs(t0, Clock::now()) / 1e9);
    a[r] = b[n - 1 - r];  // Keep the copies observable.
  }
  JsonLine().S("kind", "memcpy").N("mib", n >> 20).N("gbps", Pct(gbps, 0.5))
      .N("max_gbps", *std::max_element(gbps.begin(), gbps.end())).Emit();
  std::printf("memcpy %zu MiB: median %.2f GB/s\n", n >> 20, Pct(gbps, 0.5));
  return 0;
}

}  // namespace

constexpr char kUsage[] =
    "usage: kv_bench [--section=grid|lookup|trace|memcpy] [--tier=ram|ssd]\n"
    "                [--chunks=2,32,128] [--clients=1,4,16,64] [--ram-mib=N] [--ssd-mib=N]\n"
    "                [--budget-mib=N] [--get-budget-mib=N] [--hot-mib=N] [--mode=MODE]\n"
    "                [--min-ops-per-client=N] [--min-mib-per-client=N] [--equal-cells=0|1]\n"
    "                [--rounds=N]\n"
    "                [--skip-puts=1] [--skip-gets=1]\n"
    "                [--tls-dir=DIR] [--tenants-file=FILE] [--token=T] [--label=NAME]\n"
    "                [--plane=grpc|shm] [--frame-kib=N] [--window-kib=N] [--malloc-pad-mib=N]\n"
    "                [--malloc-arena-max=N] [--put-header-wait=adaptive|always] [--h2-frame-kib=N]\n"
    "                [--daemon-args=a,b] [--data-dir=DIR] [--json=FILE]\n"
    "Starts its own kvtierd and measures put/get throughput and latency; see the\n"
    "comment at the top of bench/kv_bench.cc and bench/run.sh for the sections.\n";

int main(int argc, char** argv) {
  if (kvtier::bench::HelpRequested(argc, argv)) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  kvtier::bench::InitFlags(argc, argv);
  const std::string section = StrFlag("section", "grid");
  if (section == "memcpy") return Memcpy();
  const std::string base = StrFlag("data-dir", "");
  std::string dir;
  if (base.empty()) {
    dir = kvtier::testing::MakeTempDir("kv-bench-" + section);
  } else {
    dir = base + "/kv-bench-" + section + "-" + StrFlag("tier", "x");
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    std::filesystem::create_directories(dir);
  }
  int rc = 1;
  if (section == "grid") rc = Grid(dir);
  else if (section == "lookup") rc = Lookup(dir);
  else if (section == "trace") rc = Trace(dir);
  else std::fprintf(stderr, "unknown --section=%s\n", section.c_str());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}
