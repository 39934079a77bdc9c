// cache_bench: what eviction policies and scheduler hints buy on the Mooncake trace
// (bench/RESULTS.md, "Keeping what will be reused"). Each run starts its own kvtierd.
//
//   --section=policies  The hit-ratio grid. RAM capacities of --fracs percent of the
//     trace's distinct chunks (the pool's slot is the chunk, so capacity counts chunks)
//     x --policies x hints off/on; each cell a fresh ram-only kvtierd driven by one
//     client in trace order, so that a run is deterministic and comparable with
//     simulation. Per request, as an engine does: Lookup, Get of the prefix hits, Put of
//     the absent chunks after them (with chunk_index and prev_key). With hints, before
//     each request the client sends Hint with the next --hint-depth requests (the
//     scheduler's queue). Beside each capacity, offline LRU and Belady simulations of
//     the same access sequence, computed here: LRU must equal the daemon's lru cell
//     exactly; Belady is MIN with bypass (evict the chunk used farthest ahead, the
//     incoming one included), an upper bound no online policy reaches.
//   --section=timed  Write-back, RAM --timed-frac percent of the distinct chunks, an SSD
//     tier holding all, arrival times compressed by --compress, --workers clients, with
//     and without hints of the next --hint-depth queued requests (sent every
//     --hint-every dispatches, by the dispatching client, off the request's clock): the
//     share of loaded chunks served from RAM, request latency percentiles (Lookup, Get,
//     Put), the daemon's CPU time and the time its Hint handler took.
//   --section=shared  The shared tier (issue 14): request i goes to daemon i % --daemons
//     (3, round robin, as a cache-unaware balancer spreads them), arrival times
//     compressed by --compress, --workers clients. Cells: one ram-only daemon holding
//     every distinct chunk (the reference), then for each --shared-fracs percent of the
//     distinct chunks in each daemon's RAM, the daemons alone and the daemons sharing a
//     Redis Cluster (--masters masters, started here on loopback). Reported: prefix hit
//     ratio (and its ratio to the reference's), recompute time saved, chunks loaded
//     from the shared tier, remote writes and drops, request latency.
//
// Recompute time saved is the sum of a + b*i over the prefix hits (chunk i of its
// request), with the Cake benchmark's fit (--a, --b seconds). Results are JSON lines
// (--json, read by bench/report.py) and a markdown line per cell on stdout.
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <list>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_flags.h"
#include "bench/json_line.h"
#include "bench/proc_stat.h"
#include "bench/trace.h"
#include "client/kvtier_client.h"
#include "tests/support/daemon_process.h"
#include "tests/support/redis_cluster_process.h"
#include "tests/support/test_data.h"

namespace {

using kvtier::ChunkKey;
using kvtier::KvTierClient;
using kvtier::bench::DFlag;
using kvtier::bench::Flag;
using kvtier::bench::JsonLine;
using kvtier::bench::ListFlag;
using kvtier::bench::Pct;
using kvtier::bench::StrFlag;
using kvtier::bench::TraceReq;
using kvtier::testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

struct Trace {
  std::vector<TraceReq> reqs;
  uint64_t refs = 0;
  uint64_t unique = 0;
};

double Cost(uint64_t i) { return DFlag("a", 0.02385) + DFlag("b", 0.002753) * double(i); }
ChunkKey KeyOfId(uint64_t id) { return kvtier::testing::KeyOf(1000000000ull + id); }

struct Outcome {
  uint64_t refs = 0, hits = 0, prefix_hits = 0;
  double saved_s = 0;
  void Request(const std::vector<uint64_t>& ids, const std::vector<bool>& present) {
    refs += ids.size();
    size_t p = 0;
    while (p < ids.size() && present[p]) saved_s += Cost(p), ++p;
    prefix_hits += p;
    hits += std::count(present.begin(), present.end(), true);
  }
};

// ---- offline simulations of the access sequence an engine makes: the prefix hits are
// touched in order, then the absent chunks after them inserted in order ----

Outcome SimulateLru(const Trace& t, uint64_t capacity) {
  std::list<uint64_t> order;  // Front: most recent.
  absl::flat_hash_map<uint64_t, std::list<uint64_t>::iterator> where;
  Outcome out;
  for (const TraceReq& r : t.reqs) {
    std::vector<bool> present(r.ids.size());
    for (size_t k = 0; k < r.ids.size(); ++k) present[k] = where.contains(r.ids[k]);
    out.Request(r.ids, present);
    size_t p = 0;
    while (p < r.ids.size() && present[p]) {
      order.splice(order.begin(), order, where[r.ids[p]]);
      ++p;
    }
    for (size_t k = p; k < r.ids.size(); ++k) {
      if (where.contains(r.ids[k])) continue;
      if (where.size() >= capacity) {
        where.erase(order.back());
        order.pop_back();
      }
      order.push_front(r.ids[k]);
      where[r.ids[k]] = order.begin();
    }
  }
  return out;
}

Outcome SimulateBelady(const Trace& t, uint64_t capacity) {
  // Every reference in order, each knowing when its chunk is referenced next. MIN needs
  // no recency, so touching a chunk or finding it present is the same event here.
  std::vector<uint64_t> stream;
  for (const TraceReq& r : t.reqs) stream.insert(stream.end(), r.ids.begin(), r.ids.end());
  std::vector<uint64_t> next(stream.size());
  absl::flat_hash_map<uint64_t, uint64_t> last;
  for (size_t i = stream.size(); i-- > 0;) {
    auto it = last.find(stream[i]);
    next[i] = it == last.end() ? UINT64_MAX : it->second;
    last[stream[i]] = i;
  }
  absl::flat_hash_map<uint64_t, uint64_t> cached;  // id -> its next use.
  std::priority_queue<std::pair<uint64_t, uint64_t>> farthest;  // (next use, id), lazy.
  Outcome out;
  size_t at = 0;  // Position in `stream` of the request's first chunk.
  for (const TraceReq& r : t.reqs) {
    std::vector<bool> here(r.ids.size());
    for (size_t k = 0; k < r.ids.size(); ++k) here[k] = cached.contains(r.ids[k]);
    out.Request(r.ids, here);
    for (size_t k = 0; k < r.ids.size(); ++k) {
      const uint64_t id = r.ids[k], nu = next[at + k];
      if (auto c = cached.find(id); c != cached.end()) {
        c->second = nu;
        farthest.push({nu, id});
        continue;
      }
      if (cached.size() >= capacity) {
        while (true) {  // Drop stale heap entries.
          auto [use, victim] = farthest.top();
          auto c = cached.find(victim);
          if (c != cached.end() && c->second == use) break;
          farthest.pop();
        }
        if (farthest.top().first <= nu) continue;  // Bypass: the newcomer is needed last.
        cached.erase(farthest.top().second);
        farthest.pop();
      }
      cached[id] = nu;
      farthest.push({nu, id});
    }
    at += r.ids.size();
  }
  return out;
}

// ---- replay through a real daemon ----

struct Replay {
  Outcome o;
  uint64_t from_ram = 0, from_ssd = 0, from_gpu = 0, from_remote = 0, lost = 0, puts = 0,
           errors = 0;
  uint64_t truncated_hints = 0;
  std::vector<double> lat_ms;   // Lookup + Get + Put of each request.
  std::vector<double> hint_ms;  // Each Hint call.
  double secs = 0;
};

std::unique_ptr<KvTierClient> Connect(const std::string& target, int i) {
  kvtier::ClientOptions o;
  o.rpc_deadline = absl::Minutes(5);
  o.connect_timeout = absl::Seconds(30);
  o.max_message_bytes = (64 << 20) + i;  // One connection per client.
  auto c = KvTierClient::Connect(target, o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(c);
}

// Request i goes to targets[i % targets.size()].
Replay Run(const Trace& t, const std::vector<std::string>& targets, uint64_t ns,
           uint64_t chunk_bytes, uint32_t tokens, int workers, double compress,
           uint64_t hint_depth, bool lease) {
  const uint64_t hint_every = std::max<uint64_t>(1, Flag("hint-every", 1));
  const std::string payload = kvtier::testing::PatternBytes(11, chunk_bytes);
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  Replay total;
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      std::vector<std::unique_ptr<KvTierClient>> clients;
      for (size_t d = 0; d < targets.size(); ++d) {
        clients.push_back(Connect(targets[d], w * static_cast<int>(targets.size()) + static_cast<int>(d)));
      }
      Replay mine;
      for (uint64_t i; (i = next.fetch_add(1)) < t.reqs.size();) {
        const TraceReq& r = t.reqs[i];
        KvTierClient* c = clients[i % clients.size()].get();
        if (compress > 0) {
          std::this_thread::sleep_until(
              t0 + std::chrono::microseconds(static_cast<int64_t>(r.ts_ms * 1000 / compress)));
        }
        if (hint_depth > 0 && i % hint_every == 0) {
          // The scheduler's side, off the request's clock: it hints as it dispatches,
          // every --hint-every requests.
          const auto hint_start = Clock::now();
          std::vector<kvtier::HintedRequest> queue;
          for (uint64_t j = i + 1; j < t.reqs.size() && j <= i + hint_depth; ++j) {
            kvtier::HintedRequest& q = queue.emplace_back();
            q.namespace_id = ns;
            for (uint64_t id : t.reqs[j].ids) q.keys.push_back(KeyOfId(id));
          }
          auto h = c->Hint("replayer", queue);
          if (!h.ok()) {
            ++mine.errors;
          } else if (h->truncated()) {
            ++mine.truncated_hints;
          }
          mine.hint_ms.push_back(
              std::chrono::duration<double, std::milli>(Clock::now() - hint_start).count());
        }
        const auto start = Clock::now();
        std::vector<ChunkKey> keys;
        for (uint64_t id : r.ids) keys.push_back(KeyOfId(id));
        auto lk = c->Lookup(ns, keys, lease ? 30 : 0);
        if (!lk.ok()) {
          ++mine.errors;
          continue;
        }
        std::vector<bool> loaded(keys.size(), false);
        const uint32_t p = lk->prefix_hits;
        if (p > 0) {
          absl::Status s = c->GetStreamRaw(
              ns, absl::MakeConstSpan(keys.data(), p), std::nullopt,
              [&](uint32_t idx, const kvtier::GetFrameHeader& f,
                  absl::Span<const absl::string_view>) {
                if (f.offset() != 0) return absl::OkStatus();  // A chunk's later frames.
                if (!f.found()) {
                  ++mine.lost;
                } else {
                  loaded[idx] = true;
                  if (f.tier() == kvtier::v1::TIER_RAM) ++mine.from_ram;
                  else if (f.tier() == kvtier::v1::TIER_SSD) ++mine.from_ssd;
                  else if (f.tier() == kvtier::v1::TIER_REMOTE) ++mine.from_remote;
                  else ++mine.from_gpu;
                }
                return absl::OkStatus();
              },
              kvtier::v1::GET_ORDER_CHUNK_MAJOR, lk->lease_id);
          if (!s.ok()) ++mine.errors;
        }
        std::vector<bool> present(keys.size());
        for (size_t k = 0; k < keys.size(); ++k) {
          present[k] = k < p ? loaded[k] : lk->tiers[k] != kvtier::v1::TIER_UNSPECIFIED;
        }
        mine.o.Request(r.ids, present);
        // What the engine computed: everything after the loaded prefix. Chunks already
        // stored are not sent again.
        size_t loaded_prefix = 0;
        while (loaded_prefix < keys.size() && present[loaded_prefix]) ++loaded_prefix;
        std::vector<kvtier::ChunkToPut> puts;
        for (size_t k = loaded_prefix; k < keys.size(); ++k) {
          if (present[k]) continue;
          kvtier::ChunkToPut& put = puts.emplace_back();
          put.key = keys[k];
          put.data = payload;
          put.token_count = tokens;
          put.chunk_index = static_cast<uint32_t>(k);
          if (k > 0) put.prev_key = keys[k - 1];
        }
        if (!puts.empty()) {
          auto pr = c->Put(ns, puts);
          if (pr.ok()) {
            mine.puts += puts.size();
          } else {
            ++mine.errors;
          }
        }
        mine.lat_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      }
      std::lock_guard<std::mutex> l(mu);
      total.o.refs += mine.o.refs;
      total.o.hits += mine.o.hits;
      total.o.prefix_hits += mine.o.prefix_hits;
      total.o.saved_s += mine.o.saved_s;
      total.from_ram += mine.from_ram;
      total.from_ssd += mine.from_ssd;
      total.from_gpu += mine.from_gpu;
      total.from_remote += mine.from_remote;
      total.lost += mine.lost;
      total.puts += mine.puts;
      total.errors += mine.errors;
      total.truncated_hints += mine.truncated_hints;
      total.lat_ms.insert(total.lat_ms.end(), mine.lat_ms.begin(), mine.lat_ms.end());
      total.hint_ms.insert(total.hint_ms.end(), mine.hint_ms.begin(), mine.hint_ms.end());
    });
  }
  for (auto& th : threads) th.join();
  total.secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return total;
}

// Seconds the daemon's handlers of `method` took in total, from /metrics.
double RpcSeconds(const DaemonProcess& d, const std::string& method) {
  auto r = kvtier::testing::HttpGet(d.metrics_port(), "/metrics");
  if (!r.ok()) return 0;
  return std::max(0.0, kvtier::testing::SeriesValue(
                           r->body, "kvtier_rpc_latency_seconds_sum{method=\"" + method + "\"}"));
}

struct Daemon {
  DaemonProcess process;
  std::unique_ptr<KvTierClient> admin;
  uint64_t ns = 0;
  uint64_t chunk_bytes = 0;
  uint32_t tokens = 0;
};

Daemon StartDaemon(const std::string& dir, std::vector<std::string> args) {
  const uint64_t chunk_kib = Flag("chunk-kib", 16);
  args.push_back(absl::StrCat("--ram-slot-size=", chunk_kib, "KiB"));
  args.push_back("--log-level=warn");
  args.push_back("--ram-prefault=false");
  auto d = DaemonProcess::Start(dir, args);
  if (!d.ok()) {
    std::fprintf(stderr, "start kvtierd: %s\n", d.status().ToString().c_str());
    std::exit(1);
  }
  Daemon out{*std::move(d), nullptr};
  out.admin = Connect(out.process.target(), 100000);
  kvtier::LayoutSpec layout = kvtier::testing::LayoutOfMiB(1, "trace-model");
  layout.tokens_per_chunk = static_cast<uint32_t>(chunk_kib / 4);  // 4 KiB per token.
  auto r = out.admin->RegisterLayout(layout);
  if (!r.ok()) {
    std::fprintf(stderr, "register: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  out.ns = r->namespace_id;
  out.chunk_bytes = layout.ChunkBytes();
  out.tokens = layout.tokens_per_chunk;
  return out;
}

int Policies(const Trace& t, const std::string& dir) {
  const std::vector<std::string> policies =
      absl::StrSplit(StrFlag("policies", "lru,prefix-lru,prefix-cost"), ',');
  const uint64_t depth = Flag("hint-depth", 32);
  std::printf("| RAM %% | chunks | policy | hints | prefix hit ratio | hit ratio | recompute saved s | vs LRU | of Belady | daemon CPU s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (uint64_t pct : ListFlag("fracs", "5,10,20")) {
    const uint64_t cap = std::max<uint64_t>(1, t.unique * pct / 100);
    const Outcome lru = SimulateLru(t, cap), opt = SimulateBelady(t, cap);
    for (const auto& [name, o] : {std::pair{"lru", lru}, std::pair{"belady", opt}}) {
      JsonLine().S("kind", "cache_sim").S("sim", name).N("ram_pct", pct).N("capacity_chunks", cap)
          .N("prefix_hit_ratio", o.prefix_hits / double(t.refs)).N("hit_ratio", o.hits / double(t.refs))
          .N("saved_s", o.saved_s).Emit();
      std::printf("| %lu | %lu | sim %s | - | %.4f | %.4f | %.1f | | | |\n", pct, cap, name,
                  o.prefix_hits / double(t.refs), o.hits / double(t.refs), o.saved_s);
    }
    for (const std::string& policy : policies) {
      for (uint64_t hints : {uint64_t{0}, depth}) {
        Daemon d = StartDaemon(dir + "/" + policy + std::to_string(pct) + "-" + std::to_string(hints),
                               {"--write-mode=ram-only", "--eviction-policy=" + policy,
                                absl::StrCat("--ram-capacity=", cap * Flag("chunk-kib", 16), "KiB")});
        const double cpu0 = kvtier::bench::ProcessCpuSeconds(d.process.pid());
        Replay r = Run(t, {d.process.target()}, d.ns, d.chunk_bytes, d.tokens, 1, 0, hints, false);
        const double cpu = kvtier::bench::ProcessCpuSeconds(d.process.pid()) - cpu0;
        const double hint_s = RpcSeconds(d.process, "Hint");
        const double ratio = r.o.prefix_hits / double(t.refs);
        const double lru_ratio = lru.prefix_hits / double(t.refs);
        const double opt_ratio = opt.prefix_hits / double(t.refs);
        JsonLine().S("kind", "cache_cell").S("policy", policy).N("hint_depth", hints)
            .N("ram_pct", pct).N("capacity_chunks", cap).N("refs", r.o.refs)
            .N("prefix_hit_ratio", ratio).N("hit_ratio", r.o.hits / double(t.refs))
            .N("saved_s", r.o.saved_s).N("lru_sim_prefix_hit_ratio", lru_ratio)
            .N("lru_sim_saved_s", lru.saved_s).N("belady_prefix_hit_ratio", opt_ratio)
            .N("belady_saved_s", opt.saved_s)
            .N("matches_lru_sim", r.o.prefix_hits == lru.prefix_hits ? 1 : 0)
            .N("from_ram", r.from_ram).N("from_ssd", r.from_ssd).N("lost", r.lost)
            .N("puts", r.puts).N("errors", r.errors).N("truncated_hints", r.truncated_hints)
            .N("secs", r.secs).N("daemon_cpu_s", cpu).N("hint_handler_s", hint_s)
            .N("p50_ms", Pct(r.lat_ms, 0.5)).N("p99_ms", Pct(r.lat_ms, 0.99)).Emit();
        std::printf("| %lu | %lu | %s | %s | %.4f | %.4f | %.1f | %+.1f%% | %.0f%% | %.1f |\n", pct, cap,
                    policy.c_str(), hints ? std::to_string(hints).c_str() : "off", ratio,
                    r.o.hits / double(t.refs), r.o.saved_s, (ratio / lru_ratio - 1) * 100,
                    (ratio - lru_ratio) / std::max(1e-9, opt_ratio - lru_ratio) * 100, cpu);
        std::fflush(stdout);
        d.admin.reset();
        d.process.Terminate(60).IgnoreError();
      }
    }
  }
  return 0;
}

int Timed(const Trace& t, const std::string& dir) {
  const uint64_t pct = Flag("timed-frac", 5);
  const uint64_t cap = std::max<uint64_t>(1, t.unique * pct / 100);
  const uint64_t depth = Flag("hint-depth", 32);
  const std::string policy = StrFlag("timed-policy", "lru");
  std::printf("| hints | policy | loaded from RAM | RAM share | SSD | p50 ms | p99 ms | p99.9 ms | daemon CPU s | Hint handler s | errors |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (uint64_t hints : ListFlag("timed-hints", absl::StrCat("0,", depth))) {
    Daemon d = StartDaemon(dir + "/timed-" + std::to_string(hints),
                           {"--write-mode=write-back", "--eviction-policy=" + policy,
                            absl::StrCat("--ram-capacity=", cap * Flag("chunk-kib", 16), "KiB"),
                            absl::StrCat("--ssd-capacity=", Flag("ssd-mib", 8192), "MiB")});
    const double cpu0 = kvtier::bench::ProcessCpuSeconds(d.process.pid());
    Replay r = Run(t, {d.process.target()}, d.ns, d.chunk_bytes, d.tokens,
                   static_cast<int>(Flag("workers", 16)), DFlag("compress", 100), hints, true);
    const double cpu = kvtier::bench::ProcessCpuSeconds(d.process.pid()) - cpu0;
    const double hint_s = RpcSeconds(d.process, "Hint");
    const uint64_t loaded = r.from_ram + r.from_ssd + r.from_gpu;
    const double share = loaded ? double(r.from_ram + r.from_gpu) / loaded : 0;
    JsonLine().S("kind", "cache_timed").S("policy", policy).N("hint_depth", hints)
        .N("hint_every", hints ? Flag("hint-every", 1) : 0)
        .N("ram_pct", pct).N("capacity_chunks", cap).N("compress", DFlag("compress", 100))
        .N("workers", Flag("workers", 16)).N("span_s", t.reqs.back().ts_ms / 1000)
        .N("secs", r.secs).N("loaded", loaded).N("from_ram", r.from_ram + r.from_gpu)
        .N("from_ssd", r.from_ssd).N("ram_share", share).N("lost", r.lost)
        .N("prefix_hit_ratio", r.o.prefix_hits / double(t.refs)).N("saved_s", r.o.saved_s)
        .N("p50_ms", Pct(r.lat_ms, 0.5)).N("p99_ms", Pct(r.lat_ms, 0.99))
        .N("p999_ms", Pct(r.lat_ms, 0.999)).N("daemon_cpu_s", cpu).N("hint_handler_s", hint_s)
        .N("hint_cpu_share", cpu > 0 ? hint_s / cpu : 0).N("errors", r.errors)
        .N("hint_p50_ms", Pct(r.hint_ms, 0.5)).N("hint_p99_ms", Pct(r.hint_ms, 0.99))
        .N("truncated_hints", r.truncated_hints).Emit();
    std::printf("| %s | %s | %lu | %.3f | %lu | %.2f | %.2f | %.2f | %.1f | %.2f | %lu |\n",
                hints ? std::to_string(hints).c_str() : "off", policy.c_str(), r.from_ram + r.from_gpu,
                share, r.from_ssd, Pct(r.lat_ms, 0.5), Pct(r.lat_ms, 0.99), Pct(r.lat_ms, 0.999),
                cpu, hint_s, r.errors);
    std::fflush(stdout);
    d.admin.reset();
    d.process.Terminate(300).IgnoreError();
  }
  return 0;
}


// The value of series `name` (exact, labels included) on the daemon's /metrics; 0 when absent.
double Metric(const DaemonProcess& d, const std::string& name) {
  auto r = kvtier::testing::HttpGet(d.metrics_port(), "/metrics");
  if (!r.ok()) return 0;
  return std::max(0.0, kvtier::testing::SeriesValue(r->body, name));
}

int Shared(const Trace& t, const std::string& dir) {
  const int daemons = static_cast<int>(Flag("daemons", 3));
  const int workers = static_cast<int>(Flag("workers", 8));
  const double compress = DFlag("compress", 20);
  const uint64_t chunk_kib = Flag("chunk-kib", 16);
  kvtier::testing::RedisClusterSpec spec;
  spec.masters = static_cast<int>(Flag("masters", 3));
  spec.replicas_per_master = 0;
  auto cluster = kvtier::testing::RedisClusterProcess::Start(spec);
  if (!cluster.ok()) {
    std::fprintf(stderr, "redis cluster: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  std::printf("| daemons | RAM %% each | shared tier | prefix hit ratio | vs one daemon | recompute saved s | vs one daemon | from shared tier | remote writes | dropped | p50 ms | p99 ms | errors |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  double ref_ratio = 0, ref_saved = 0;
  struct Cell { int n; uint64_t pct; bool shared; };
  std::vector<Cell> cells = {{1, 100, false}};
  for (uint64_t pct : ListFlag("shared-fracs", "10,100")) {
    cells.push_back({daemons, pct, false});
    cells.push_back({daemons, pct, true});
  }
  int index = 0;
  for (const Cell& cell : cells) {
    if (!(*cluster)->FlushAll().ok()) return 1;
    const uint64_t cap = std::max<uint64_t>(1, t.unique * cell.pct / 100);
    std::vector<Daemon> ds;
    std::vector<std::string> targets;
    for (int k = 0; k < cell.n; ++k) {
      std::vector<std::string> args = {"--write-mode=ram-only",
                                       absl::StrCat("--ram-capacity=", cap * chunk_kib, "KiB")};
      if (cell.shared) args.push_back("--remote-seeds=" + (*cluster)->SeedList());
      ds.push_back(StartDaemon(absl::StrCat(dir, "/shared-", index, "-", k), args));
      targets.push_back(ds.back().process.target());
    }
    ++index;
    Replay r = Run(t, targets, ds[0].ns, ds[0].chunk_bytes, ds[0].tokens, workers, compress, 0,
                   false);
    double writes = 0, dropped = 0;
    for (const Daemon& d : ds) {
      writes += Metric(d.process, "kvtier_remote_writes_total{result=\"stored\"}");
      dropped += Metric(d.process, "kvtier_remote_writes_total{result=\"dropped\"}");
    }
    const double ratio = r.o.prefix_hits / double(t.refs);
    if (cell.n == 1) ref_ratio = ratio, ref_saved = r.o.saved_s;
    JsonLine().S("kind", "shared_cell").N("daemons", cell.n).N("ram_pct", cell.pct)
        .N("capacity_chunks", cap).N("shared", cell.shared ? 1 : 0).N("compress", compress)
        .N("workers", workers).N("refs", r.o.refs).N("prefix_hit_ratio", ratio)
        .N("hit_ratio", r.o.hits / double(t.refs)).N("saved_s", r.o.saved_s)
        .N("ref_prefix_hit_ratio", ref_ratio).N("ref_saved_s", ref_saved)
        .N("from_ram", r.from_ram).N("from_remote", r.from_remote).N("lost", r.lost)
        .N("puts", r.puts).N("remote_writes", writes).N("remote_dropped", dropped)
        .N("errors", r.errors).N("secs", r.secs).N("p50_ms", Pct(r.lat_ms, 0.5))
        .N("p99_ms", Pct(r.lat_ms, 0.99)).Emit();
    std::printf("| %d | %lu | %s | %.4f | %.3f | %.1f | %.3f | %lu | %.0f | %.0f | %.2f | %.2f | %lu |\n",
                cell.n, cell.pct, cell.shared ? "yes" : "no", ratio, ratio / ref_ratio, r.o.saved_s,
                r.o.saved_s / ref_saved, r.from_remote, writes, dropped, Pct(r.lat_ms, 0.5),
                Pct(r.lat_ms, 0.99), r.errors);
    std::fflush(stdout);
    for (Daemon& d : ds) {
      d.admin.reset();
      d.process.Terminate(60).IgnoreError();
    }
  }
  return 0;
}

}  // namespace

constexpr char kUsage[] =
    "usage: cache_bench [--section=policies|timed|shared] [--trace=FILE]\n"
    "                   [--trace-requests=N] [--chunk-kib=N] [--fracs=5,10,20]\n"
    "                   [--policies=lru,prefix-lru,prefix-cost] [--hint-depth=N]\n"
    "                   [--hint-every=N] [--timed-frac=N] [--timed-hints=0,N]\n"
    "                   [--timed-policy=P] [--ssd-mib=N] [--compress=X] [--workers=N]\n"
    "                   [--daemons=N] [--masters=N] [--shared-fracs=10,100] [--a=S] [--b=S]\n"
    "                   [--json=FILE]\n"
    "Replays the Mooncake trace against kvtierd instances it starts; see the comment\n"
    "at the top of bench/cache_bench.cc for the sections.\n";

int main(int argc, char** argv) {
  if (kvtier::bench::HelpRequested(argc, argv)) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  kvtier::bench::InitFlags(argc, argv);
  Trace t;
  const std::string path =
      StrFlag("trace", "/work/shared/data/traces/mooncake_synthetic_trace.jsonl");
  t.reqs = kvtier::bench::LoadTrace(path, Flag("trace-requests", 1u << 30));
  if (t.reqs.empty()) {
    std::fprintf(stderr, "no trace at %s\n", path.c_str());
    return 1;
  }
  {
    std::vector<uint64_t> all;
    for (const TraceReq& r : t.reqs) all.insert(all.end(), r.ids.begin(), r.ids.end());
    t.refs = all.size();
    std::sort(all.begin(), all.end());
    t.unique = std::unique(all.begin(), all.end()) - all.begin();
  }
  JsonLine().S("kind", "cache_trace").S("trace", path).N("requests", t.reqs.size())
      .N("chunk_refs", t.refs).N("unique_chunks", t.unique).N("chunk_kib", Flag("chunk-kib", 16))
      .N("a", DFlag("a", 0.02385)).N("b", DFlag("b", 0.002753)).Emit();
  const std::string dir = kvtier::testing::MakeTempDir("cache-bench");
  const std::string section = StrFlag("section", "policies");
  if (section == "policies") return Policies(t, dir);
  if (section == "timed") return Timed(t, dir);
  if (section == "shared") return Shared(t, dir);
  std::fprintf(stderr, "unknown --section=%s\n", section.c_str());
  return 2;
}
