// Same-host data plane benchmark: what a co-located worker gets from kvtierd through
// registered shared memory, beside the gRPC stream and the machine's own limits, all in
// one run against one daemon (ram-only, --shm-socket=auto).
//
//   samehost_bench --chunks=2,32,128 --clients=1,4,16 --json=FILE
//
// The pool is filled once first (a long-running daemon's pool is warm). Per chunk size,
// in this order:
//   memcpy     single-thread memcpy of one chunk (median of --memcpy-runs), between two
//              cache-hot buffers (copy_hot) and from a working set as large as the
//              gets' hot set into one warm buffer (copy_ws: the memory traffic of a get);
//   tcp        one chunk sent over a loopback TCP connection between two threads and
//              read into a buffer (median): what any socket protocol is capped by;
//   put/get    through the gRPC stream (data_plane=kStream: Put from and GetInto a
//              plain buffer) and through shared memory (data_plane=kSharedMemory: Put
//              from and GetInto an AllocateShared buffer), for each client count. Gets
//              read a hot set put just before (resident in the pool); every client
//              verifies every chunk's CRC32C either way (the daemon's for shared memory).
// Then the memory check: one client registers --regions regions of one chunk each and
// gets a chunk into every one; the daemon's anonymous RSS and page tables are read from
// /proc before and after, so the cost of a region to the daemon shows as bytes.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_flags.h"
#include "bench/json_line.h"
#include "client/kvtier_client.h"
#include "client/shared_buffer.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace {

using kvtier::ChunkKey;
using kvtier::ClientOptions;
using kvtier::KvTierClient;
using kvtier::bench::Flag;
using kvtier::bench::JsonLine;
using kvtier::bench::ListFlag;
using kvtier::bench::Pct;
using kvtier::bench::StrFlag;
using kvtier::testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

double Secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

enum class Path { kGrpc, kShm };
const char* Name(Path p) { return p == Path::kGrpc ? "grpc" : "shm"; }

std::unique_ptr<KvTierClient> MakeClient(const std::string& target, Path path, int i) {
  ClientOptions o;
  o.rpc_deadline = absl::Minutes(10);
  o.connect_timeout = absl::Seconds(30);
  o.max_message_bytes = (64 << 20) + i;  // One TCP connection per client (see kv_bench).
  o.data_plane = path == Path::kShm ? ClientOptions::DataPlane::kSharedMemory
                                    : ClientOptions::DataPlane::kStream;
  o.staging_bytes = 0;  // Shared-memory cells use AllocateShared buffers only.
  auto c = KvTierClient::Connect(target, o);
  if (!c.ok()) Die("connect", c.status());
  return *std::move(c);
}

// One client's buffer for a cell: shared with the daemon (shm) or plain memory (grpc),
// filled with the chunk's bytes (puts) and touched, so no cell pays first-touch faults.
struct ClientBuffer {
  std::shared_ptr<kvtier::SharedBuffer> shared;
  std::vector<char> plain;
  char* data() { return shared ? shared->data() : plain.data(); }
};

ClientBuffer MakeBuffer(KvTierClient& c, Path path, const std::string& payload) {
  ClientBuffer b;
  if (path == Path::kShm) {
    auto s = c.AllocateShared(payload.size());
    if (!s.ok()) Die("AllocateShared", s.status());
    b.shared = *std::move(s);
  } else {
    b.plain.resize(payload.size());
  }
  std::memcpy(b.data(), payload.data(), payload.size());
  return b;
}

struct CellResult {
  double gbps = 0, p50_ms = 0, p99_ms = 0, secs = 0;
  uint64_t ops = 0, errors = 0;
};

void EmitCell(const std::string& path, const std::string& op, uint64_t chunk_bytes,
              uint64_t clients, const CellResult& r) {
  JsonLine().S("kind", "samehost").S("path", path).S("op", op)
      .N("chunk_mib", chunk_bytes / 1048576.0).N("clients", clients).N("ops", r.ops)
      .N("secs", r.secs).N("gbps", r.gbps).N("p50_ms", r.p50_ms).N("p99_ms", r.p99_ms)
      .N("errors", r.errors).Emit();
  std::printf("| %s | %s | %.0f MiB | %lu | %lu | %.2f | %.3f | %.3f | %lu |\n", path.c_str(),
              op.c_str(), chunk_bytes / 1048576.0, clients, r.ops, r.gbps, r.p50_ms, r.p99_ms,
              r.errors);
  std::fflush(stdout);
}

// `ops` operations over `clients` threads, each with its own client and buffer; op
// returns false on failure. Connections and buffers are set up before the clock starts.
CellResult RunCell(const std::string& target, Path path, uint64_t clients, uint64_t ops,
                   const std::string& payload,
                   const std::function<bool(KvTierClient&, ClientBuffer&, uint64_t)>& op) {
  std::vector<std::unique_ptr<KvTierClient>> cs;
  std::vector<ClientBuffer> bufs;
  for (uint64_t w = 0; w < clients; ++w) {
    cs.push_back(MakeClient(target, path, w));
    bufs.push_back(MakeBuffer(*cs.back(), path, payload));
    // The first transfer resolves the data path; a shared-memory client that cannot
    // get it fails here, not inside the timed loop.
    if (path == Path::kShm && cs.back()->data_path() != kvtier::DataPath::kSharedMemory) {
      Die("shared memory", absl::FailedPreconditionError(cs.back()->data_path_detail()));
    }
  }
  // One untimed operation per client first: a worker reuses its connection and its
  // registered buffer, and the first transfer into a fresh one pays the connection's
  // start and the daemon's first mapping of the buffer's pages (see MappedRegion).
  {
    std::vector<std::thread> warm;
    for (uint64_t w = 0; w < clients; ++w) {
      warm.emplace_back([&, w] { op(*cs[w], bufs[w], ops + w); });
    }
    for (auto& t : warm) t.join();
  }
  std::atomic<uint64_t> next{0}, errors{0};
  std::mutex mu;
  std::vector<double> lat;
  std::vector<std::thread> ts;
  const auto start = Clock::now();
  for (uint64_t w = 0; w < clients; ++w) {
    ts.emplace_back([&, w] {
      std::vector<double> mine;
      for (uint64_t i; (i = next.fetch_add(1)) < ops;) {
        const auto t0 = Clock::now();
        if (!op(*cs[w], bufs[w], i)) errors++;
        mine.push_back(Secs(t0, Clock::now()) * 1e3);
      }
      std::lock_guard<std::mutex> l(mu);
      lat.insert(lat.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : ts) t.join();
  CellResult r;
  r.secs = Secs(start, Clock::now());
  r.ops = ops;
  r.errors = errors;
  r.gbps = (ops - errors) * payload.size() / r.secs / 1e9;
  r.p50_ms = Pct(lat, 0.5);
  r.p99_ms = Pct(lat, 0.99);
  return r;
}

bool PutFrom(KvTierClient& c, uint64_t ns, const ChunkKey& key, const char* data, uint64_t n) {
  kvtier::ChunkToPut chunk{key, absl::string_view(data, n), 256};
  // A ram-only pool refuses a put (ResourceExhausted) only while in-flight puts hold all
  // of it: back off and retry, as kv_bench does.
  for (int attempt = 0; attempt < 2000; ++attempt) {
    auto r = c.Put(ns, {&chunk, 1});
    if (r.ok()) return true;
    if (!absl::IsResourceExhausted(r.status())) {
      std::fprintf(stderr, "put: %s\n", r.status().ToString().c_str());
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

bool GetInto(KvTierClient& c, uint64_t ns, const ChunkKey& key, char* out, uint64_t n) {
  auto r = c.GetInto(ns, {&key, 1}, absl::Span<char>(out, n));
  if (!r.ok() || !r->found[0]) {
    std::fprintf(stderr, "get: %s\n", r.ok() ? "absent" : r.status().ToString().c_str());
    return false;
  }
  return true;
}

// ---- baselines ----
// Median GB/s of single-thread memcpy of one n-byte chunk into a warm n-byte buffer,
// the source taken in turn from a `working_set`-byte array (n: the same buffer each
// time, cache-hot when it fits the cache).
double MemcpyGbps(uint64_t n, uint64_t working_set) {
  const uint64_t chunks = std::max<uint64_t>(1, working_set / n);
  std::vector<char> a(chunks * n, 1), b(n, 2);
  std::vector<double> gbps;
  const int runs = static_cast<int>(Flag("memcpy-runs", 15));
  for (int r = 0; r < runs; ++r) {
    const char* src = a.data() + (r % chunks) * n;
    const auto t0 = Clock::now();
    std::memcpy(b.data(), src, n);
    gbps.push_back(n / Secs(t0, Clock::now()) / 1e9);
    a[r] = b[n - 1 - r];  // Keep the copies observable.
  }
  return Pct(gbps, 0.5);
}

// Median GB/s of moving one n-byte message over a loopback TCP connection, read into a
// warm buffer, one sender and one receiver thread.
double LoopbackTcpGbps(uint64_t n, int runs) {
  const int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("loopback listen");
    std::exit(1);
  }
  const int cfd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(cfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    std::perror("loopback connect");
    std::exit(1);
  }
  const int sfd = accept(lfd, nullptr, nullptr);
  close(lfd);
  const std::string src = kvtier::testing::PatternBytes(3, n);
  std::vector<char> dst(n, 0);
  std::atomic<int> go{0};
  std::thread sender([&] {
    for (int r = 0; r < runs; ++r) {
      while (go.load() <= r) std::this_thread::yield();
      for (uint64_t off = 0; off < n;) {
        const ssize_t k = send(cfd, src.data() + off, n - off, 0);
        if (k <= 0) return;
        off += k;
      }
    }
  });
  std::vector<double> gbps;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = Clock::now();
    go.store(r + 1);
    for (uint64_t off = 0; off < n;) {
      const ssize_t k = recv(sfd, dst.data() + off, n - off, 0);
      if (k <= 0) break;
      off += k;
    }
    gbps.push_back(n / Secs(t0, Clock::now()) / 1e9);
  }
  sender.join();
  close(cfd);
  close(sfd);
  return Pct(gbps, 0.5);
}

// Fields of /proc/<pid>/status, in bytes.
struct ProcMemory {
  uint64_t rss_anon = 0, rss_file = 0, rss_shmem = 0, page_tables = 0;
};

ProcMemory ReadProcMemory(pid_t pid) {
  ProcMemory m;
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  uint64_t kib;
  while (f >> key) {
    uint64_t* field = key == "RssAnon:"   ? &m.rss_anon
                      : key == "RssFile:" ? &m.rss_file
                      : key == "RssShmem:" ? &m.rss_shmem
                      : key == "VmPTE:"   ? &m.page_tables
                                          : nullptr;
    if (field != nullptr && f >> kib) *field = kib << 10;
    f.ignore(1 << 20, '\n');
  }
  return m;
}

// ---- memory per region ----
int RegionMemory(const DaemonProcess& daemon, uint64_t ns, const ChunkKey& key, uint64_t cb) {
  const uint64_t n = Flag("regions", 1000);
  auto c = MakeClient(daemon.target(), Path::kShm, 0);
  const ProcMemory before = ReadProcMemory(daemon.pid());
  std::vector<std::shared_ptr<kvtier::SharedBuffer>> regions;
  for (uint64_t i = 0; i < n; ++i) {
    auto b = c->AllocateShared(cb);
    if (!b.ok()) Die(absl::StrCat("region ", i), b.status());
    if (!GetInto(*c, ns, key, (*b)->data(), cb)) return 1;
    regions.push_back(*std::move(b));
  }
  auto st = c->Stats();
  if (!st.ok()) Die("stats", st.status());
  const ProcMemory with = ReadProcMemory(daemon.pid());
  regions.clear();
  c.reset();  // Closes the region socket: the daemon forgets and unmaps them all.
  const ProcMemory after = ReadProcMemory(daemon.pid());
  auto mib = [](uint64_t b) { return b / 1048576.0; };
  auto delta = [](uint64_t a, uint64_t b) { return (static_cast<double>(a) - b) / 1048576.0; };
  JsonLine().S("kind", "samehost_regions").N("regions", n).N("region_mib", mib(cb))
      .N("daemon_regions", st->regions()).N("region_gib", st->region_bytes() / 1073741824.0)
      .N("anon_before_mib", mib(before.rss_anon)).N("anon_with_mib", mib(with.rss_anon))
      .N("anon_after_mib", mib(after.rss_anon))
      .N("anon_delta_mib", delta(with.rss_anon, before.rss_anon))
      .N("pte_delta_mib", delta(with.page_tables, before.page_tables))
      .N("shmem_with_mib", mib(with.rss_shmem)).N("shmem_after_mib", mib(after.rss_shmem))
      .Emit();
  std::printf("\n%lu regions of %.0f MiB (%.2f GiB of client memory, each written by a get): "
              "daemon anonymous RSS %+.1f MiB, page tables %+.1f MiB, shared pages mapped "
              "%.0f MiB (%.0f MiB after the client left)\n",
              n, mib(cb), st->region_bytes() / 1073741824.0,
              delta(with.rss_anon, before.rss_anon), delta(with.page_tables, before.page_tables),
              mib(with.rss_shmem), mib(after.rss_shmem));
  return 0;
}

int Run() {
  const auto chunks = ListFlag("chunks", "2,32,128");
  const auto client_counts = ListFlag("clients", "1,4,16");
  const uint64_t budget = Flag("budget-mib", 1024) << 20;
  const uint64_t min_ops = std::max<uint64_t>(1, Flag("min-ops-per-client", 3));
  // Shared-memory cells run 5-15x faster than gRPC ones: on the same budget a 128 MiB
  // cell was 16 gets in 0.25 s, and its figure swung with one slow op. They get their own.
  const uint64_t shm_budget = Flag("shm-budget-mib", 4 * (budget >> 20)) << 20;
  auto cell_ops = [&](Path path, uint64_t clients, uint64_t cb) {
    return std::max(clients * min_ops, (path == Path::kShm ? shm_budget : budget) / cb);
  };
  const uint64_t ram_mib = Flag("ram-mib", 4096);
  std::vector<Path> paths;  // --paths=grpc,shm (both by default; one for profiling).
  for (Path p : {Path::kGrpc, Path::kShm}) {
    if (StrFlag("paths", "grpc,shm").find(Name(p)) != std::string::npos) paths.push_back(p);
  }
  const std::string dir = kvtier::testing::MakeTempDir("samehost-bench");
  // --copy-threads: the daemon's shm_copy_threads (0, its default: one per core).
  auto daemon = DaemonProcess::Start(
      dir, {absl::StrCat("--ram-capacity=", ram_mib, "MiB"), "--write-mode=ram-only",
            "--shm-socket=auto", "--log-level=warn",
            absl::StrCat("--shm-copy-threads=", Flag("copy-threads", 0))});
  if (!daemon.ok()) Die("start kvtierd", daemon.status());
  const std::string target = daemon->target();
  auto admin = MakeClient(target, Path::kGrpc, 100000);
  {
    // Fill the pool once, so that put cells measure a warm daemon (slots reused after
    // eviction) rather than the kernel zeroing the pool's pages on first touch, which
    // a long-running daemon pays once (profiled: 49% of a cold shared-memory put).
    const uint64_t fill_mib = 32;
    auto reg = admin->RegisterLayout(kvtier::testing::LayoutOfMiB(fill_mib, "pool-fill"));
    if (!reg.ok()) Die("register", reg.status());
    const std::string fill = kvtier::testing::PatternBytes(9, fill_mib << 20);
    for (uint64_t i = 0; i < ram_mib / fill_mib; ++i) {
      if (!PutFrom(*admin, reg->namespace_id, kvtier::testing::KeyOf(~0ull - i), fill.data(),
                   fill.size())) {
        return 1;
      }
    }
  }
  std::printf("| path | op | chunk | clients | ops | GB/s | p50 ms | p99 ms | errors |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  uint64_t key_base = 0;
  for (uint64_t cmib : chunks) {
    const uint64_t cb = cmib << 20;
    auto reg = admin->RegisterLayout(kvtier::testing::LayoutOfMiB(cmib));
    if (!reg.ok()) Die("register", reg.status());
    const uint64_t ns = reg->namespace_id;
    const std::string payload = kvtier::testing::PatternBytes(cmib, cb);
    const uint64_t hot = std::max<uint64_t>(
        1, std::min<uint64_t>(Flag("hot-mib", 1024) << 20, (ram_mib << 20) / 2) / cb);

    // memcpy twice: between two cache-hot buffers (the copy's ceiling), and from a
    // working set the size of the gets' hot set (the same memory traffic as a get); and
    // loopback TCP. Each is measured before the puts, before the gets and after them,
    // and the median of the three is reported: a neighbour's burst on a shared machine
    // then moves one sample, not the baseline.
    std::vector<double> hot_gbps, ws_gbps, tcp_gbps;
    auto baselines = [&] {
      hot_gbps.push_back(MemcpyGbps(cb, cb));
      ws_gbps.push_back(MemcpyGbps(cb, hot * cb));
      tcp_gbps.push_back(
          LoopbackTcpGbps(cb, static_cast<int>(std::max<uint64_t>(5, (256ull << 20) / cb))));
    };
    baselines();

    for (Path path : paths) {
      for (uint64_t clients : client_counts) {
        if (Flag("skip-puts", 0) != 0) break;  // Profiling the gets alone.
        const uint64_t ops = cell_ops(path, clients, cb);
        const uint64_t base = key_base;
        key_base += ops + clients;  // Warm-up puts use keys base + ops + w.
        EmitCell(Name(path), "put", cb, clients,
                 RunCell(target, path, clients, ops, payload,
                         [&](KvTierClient& c, ClientBuffer& b, uint64_t i) {
                           return PutFrom(c, ns, kvtier::testing::KeyOf(base + i), b.data(), cb);
                         }));
      }
    }
    baselines();
    // The gets' hot set: put last, so it is the most recently used part of the pool.
    const uint64_t hot_base = key_base;
    key_base += hot;
    for (uint64_t i = 0; i < hot; ++i) {
      if (!PutFrom(*admin, ns, kvtier::testing::KeyOf(hot_base + i), payload.data(), cb)) return 1;
    }
    for (Path path : paths) {
      for (uint64_t clients : client_counts) {
        const uint64_t ops = cell_ops(path, clients, cb);
        EmitCell(Name(path), "get", cb, clients,
                 RunCell(target, path, clients, ops, payload,
                         [&](KvTierClient& c, ClientBuffer& b, uint64_t i) {
                           return GetInto(c, ns, kvtier::testing::KeyOf(hot_base + i % hot),
                                          b.data(), cb);
                         }));
      }
    }
    baselines();
    for (auto [name, samples] : {std::pair<const char*, std::vector<double>*>{"copy_hot", &hot_gbps},
                                 {"copy_ws", &ws_gbps}, {"recv", &tcp_gbps}}) {
      CellResult r;
      r.gbps = Pct(*samples, 0.5);
      EmitCell(std::string(name) == "recv" ? "tcp" : "memcpy", name, cb, 1, r);
    }
    if (cmib == chunks.front()) {
      // Latency of one small get on an idle daemon: many samples, one client.
      const uint64_t samples = Flag("latency-samples", 2000);
      for (Path path : paths) {
        CellResult r = RunCell(target, path, 1, samples, payload,
                               [&](KvTierClient& c, ClientBuffer& b, uint64_t i) {
                                 return GetInto(c, ns, kvtier::testing::KeyOf(hot_base + i % hot),
                                                b.data(), cb);
                               });
        EmitCell(Name(path), "get_latency", cb, 1, r);
      }
    }
  }
  const uint64_t region_chunk = chunks.front() << 20;
  auto reg = admin->RegisterLayout(kvtier::testing::LayoutOfMiB(chunks.front()));
  if (!reg.ok()) Die("register", reg.status());
  const ChunkKey rkey = kvtier::testing::KeyOf(~1ull);
  const std::string rpayload = kvtier::testing::PatternBytes(5, region_chunk);
  if (!PutFrom(*admin, reg->namespace_id, rkey, rpayload.data(), region_chunk)) return 1;
  const int rc = RegionMemory(*daemon, reg->namespace_id, rkey, region_chunk);
  admin.reset();
  daemon->Terminate(120).IgnoreError();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  kvtier::bench::InitFlags(argc, argv);
  if (!StrFlag("help", "").empty() || (argc > 1 && std::string(argv[1]) == "--help")) {
    std::printf("samehost_bench [--chunks=2,32,128] [--clients=1,4,16] [--budget-mib=1024]\n"
                "  [--shm-budget-mib=4 x budget-mib]\n"
                "  [--min-ops-per-client=3] [--ram-mib=4096] [--hot-mib=1024] [--regions=1000]\n"
                "  [--latency-samples=2000] [--memcpy-runs=15] [--paths=grpc,shm]\n"
                "  [--copy-threads=0 (the daemon's shm_copy_threads; 1: no helpers)]\n"
                "  [--json=FILE]\n");
    return 0;
  }
  return Run();
}
