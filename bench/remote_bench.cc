// The shared tier's throughput against raw Redis Cluster SET/GET of the same segments
// in the same run (issue 14's target: remote get >= 0.8x raw GET, put >= 0.8x raw SET).
// Starts its own cluster on loopback (three masters; --replicas adds replicas), then
// for each chunk size: writes `--chunks` chunks through RemoteTier (WriteAsync, the
// daemon's path: EXISTS, segments pipelined over the masters, then the commit record)
// and reads them back, verifying every segment and chunk: one chunk at a time (op
// get1: ReadRecord + ReadPayload) and all at once as a Get of them does (op get:
// ReadRecords + ReadPayloads). The baseline SETs and GETs the same segments with the
// same client and the same pipelining (get1: per chunk; get: across chunks), with no
// record, checksums or existence check. Rounds interleave them; one JSON line per
// (size, path, op, round) on stderr.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/json_line.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/remote_record.h"
#include "storage/remote_tier.h"
#include "tests/support/redis_cluster_process.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Flags {
  int chunks = 32;
  uint64_t budget_mib = 0;
  int rounds = 3;
  int replicas = 0;
  uint32_t segment_bytes = 1u << 20;
  uint64_t batch_bytes = 16ull << 20;  // The daemon's default.
  std::vector<uint64_t> sizes = {2ull << 20, 32ull << 20};
};

int Run(const Flags& f) {
  SetMinLogLevel(LogLevel::kWarning);
  testing::RedisClusterSpec spec;
  spec.replicas_per_master = f.replicas;
  auto cluster = testing::RedisClusterProcess::Start(spec);
  if (!cluster.ok()) {
    std::fprintf(stderr, "cluster: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  RemoteTierOptions o;
  o.cluster.seeds = (*cluster)->Seeds();
  o.segment_bytes = f.segment_bytes;
  o.max_pending_bytes = 4ull << 30;
  o.batch_bytes = std::max<uint64_t>(f.batch_bytes, f.segment_bytes);
  auto tier = RemoteTier::Open(o);
  auto raw = RedisCluster::Create(o.cluster);
  if (!tier.ok() || !raw.ok()) return 1;
  for (uint64_t size : f.sizes) {
    // At least --chunks chunks and --budget-mib bytes a cell: 16 chunks of 2 MiB ran
    // for tens of milliseconds, too short to measure on this VM.
    const int chunks = std::max<int>(f.chunks, static_cast<int>((f.budget_mib << 20) / size));
    std::vector<std::string> payloads;
    for (int c = 0; c < chunks; ++c) {
      std::string p(size, '\0');
      for (size_t i = 0; i < size; i += 64) p[i] = static_cast<char>(c * 31 + i / 64);
      payloads.push_back(std::move(p));
    }
    const uint64_t total = size * chunks;
    for (int round = 0; round < f.rounds; ++round) {
      if (!(*cluster)->FlushAll().ok()) return 1;
      // Remote tier: put.
      auto start = Clock::now();
      for (int c = 0; c < chunks; ++c) {
        const ChunkId id{round + 1, ChunkKey{size, static_cast<uint64_t>(c)}};
        ChunkMeta meta{size, crc32c::Value(payloads[c]), 256, 0, {}};
        (*tier)->WriteAsync(id, meta, 7, {payloads[c]}, nullptr);
      }
      (*tier)->WaitIdle();
      const double put_s = Seconds(start);
      // Remote tier: get, one chunk at a time (a Get of one chunk, or a chunk a reader
      // asks for alone: the record, then its segments).
      std::string out(size, '\0');
      start = Clock::now();
      int ok = 0;
      for (int c = 0; c < chunks; ++c) {
        const ChunkId id{round + 1, ChunkKey{size, static_cast<uint64_t>(c)}};
        auto rec = (*tier)->ReadRecord(id, RemoteLayout{7, size});
        if (!rec.ok()) continue;
        StringSink sink(&out);
        ok += (*tier)->ReadPayload(id, *rec, sink).ok() ? 1 : 0;
      }
      const double get1_s = Seconds(start);
      // Remote tier: get of all the chunks at once, as a Get of them fetches what only
      // the shared tier holds (TieredStore::FetchRemote): every record in one round
      // trip, then the segments in pipelines of batch_bytes.
      std::vector<std::string> outs(chunks, std::string(size, '\0'));
      std::vector<ChunkId> ids;
      for (int c = 0; c < chunks; ++c) {
        ids.push_back(ChunkId{round + 1, ChunkKey{size, static_cast<uint64_t>(c)}});
      }
      // The destination buffers are written once, untimed, first: the first writes into
      // fresh pages here ran at half the speed of later ones even after zero-filling
      // them (the daemon's pool is prefaulted and reused).
      for (int c = 0; c < chunks; ++c) outs[c].assign(payloads[(c + 1) % chunks]);
      start = Clock::now();
      auto recs = (*tier)->ReadRecords(ids, RemoteLayout{7, size});
      std::vector<const RemoteRecord*> rec_ptrs;
      std::vector<std::unique_ptr<StringSink>> sinks;
      std::vector<ChunkSink*> sink_ptrs;
      for (int c = 0; c < chunks; ++c) {
        if (!recs[c].ok()) break;
        rec_ptrs.push_back(&*recs[c]);
        sinks.push_back(std::make_unique<StringSink>(&outs[c]));
        sink_ptrs.push_back(sinks.back().get());
      }
      int ok_many = 0;
      if (rec_ptrs.size() == ids.size()) {
        for (const absl::Status& s : (*tier)->ReadPayloads(ids, rec_ptrs, sink_ptrs)) {
          ok_many += s.ok() ? 1 : 0;
        }
      }
      const double get_s = Seconds(start);
      if (ok != chunks || ok_many != chunks) {
        std::fprintf(stderr, "remote get: %d and %d of %d chunks\n", ok, ok_many, chunks);
        return 1;
      }
      for (int c = 0; c < chunks; ++c) {
        if (outs[c] != payloads[c]) {
          std::fprintf(stderr, "remote get: chunk %d differs\n", c);
          return 1;
        }
      }
      // Raw: the same segments, SET then GET, batched as the tier batches them.
      const uint32_t per_chunk = RemoteSegmentCount(size, f.segment_bytes);
      std::vector<std::string> keys;
      for (int c = 0; c < chunks; ++c) {
        for (uint32_t s = 0; s < per_chunk; ++s) keys.push_back(absl::StrCat("raw:", size, ":", c, ":", s));
      }
      const uint32_t batch = std::max<uint32_t>(1, static_cast<uint32_t>(o.batch_bytes / f.segment_bytes));
      start = Clock::now();
      for (int c = 0; c < chunks; ++c) {
        for (uint32_t first = 0; first < per_chunk; first += batch) {
          std::vector<RedisCommand> cmds;
          for (uint32_t s = first; s < std::min(per_chunk, first + batch); ++s) {
            const uint64_t off = static_cast<uint64_t>(s) * f.segment_bytes;
            const std::string& k = keys[c * per_chunk + s];
            cmds.push_back({{"SET", k, absl::string_view(payloads[c]).substr(off, f.segment_bytes)}, k});
          }
          for (auto& r : (*raw)->Execute(cmds)) {
            if (!r.ok()) return 1;
          }
        }
      }
      const double set_s = Seconds(start);
      // Raw GET, per chunk (the baseline of the one-at-a-time reads) and across chunks
      // in pipelines of the same size (the baseline of the batched reads).
      auto raw_get = [&](bool across) -> double {
        const auto t0 = Clock::now();
        const size_t group = across ? keys.size() : per_chunk;
        for (size_t g = 0; g < keys.size(); g += group) {
          for (size_t first = g; first < g + group; first += batch) {
            std::vector<RedisCommand> cmds;
            for (size_t s = first; s < std::min(g + group, first + batch); ++s) {
              cmds.push_back({{"GET", keys[s]}, keys[s]});
            }
            auto replies = (*raw)->Execute(cmds);
            for (size_t k = 0; k < replies.size(); ++k) {
              if (!replies[k].ok()) return -1;
              // Where the tier lands the same bytes: the chunk's buffer at the
              // segment's offset (the per-chunk reads reuse one buffer, as get1 does).
              const size_t s = first + k;
              std::string& dest = across ? outs[s / per_chunk] : out;
              const absl::string_view v = ReplyString(**replies[k]);
              std::memcpy(dest.data() + (s % per_chunk) * uint64_t{f.segment_bytes}, v.data(),
                          v.size());
            }
          }
        }
        return Seconds(t0);
      };
      const double rawget1_s = raw_get(false);
      const double rawget_s = raw_get(true);
      if (rawget1_s < 0 || rawget_s < 0) return 1;
      for (auto [path, op, secs] :
           {std::tuple{"remote", "put", put_s}, {"remote", "get", get_s},
            {"remote", "get1", get1_s}, {"raw", "put", set_s}, {"raw", "get", rawget_s},
            {"raw", "get1", rawget1_s}}) {
        bench::JsonLine()
            .S("bench", "remote")
            .N("chunk_bytes", size)
            .N("segment_bytes", f.segment_bytes)
            .N("replicas", f.replicas)
            .S("path", path)
            .S("op", op)
            .N("round", round)
            .N("gbps", total / secs / 1e9)
            .Emit();
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  kvtier::Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string(name) + "=";
      return a.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (a == "--help") {
      std::printf(
          "usage: remote_bench [--chunks=N] [--rounds=N] [--replicas=N] [--segment-kib=N]\n"
          "                    [--batch-kib=N] [--sizes-mib=2,32] [--budget-mib=N]\n"
          "Shared tier (RemoteTier) put/get against raw Redis Cluster SET/GET of the same\n"
          "segments, on a cluster it starts on loopback. JSON lines on stdout.\n");
      return 0;
    }
    const char* v;
    int n = 0;
    if ((v = value("--chunks")) && absl::SimpleAtoi(v, &n)) {
      f.chunks = n;
    } else if ((v = value("--rounds")) && absl::SimpleAtoi(v, &n)) {
      f.rounds = n;
    } else if ((v = value("--replicas")) && absl::SimpleAtoi(v, &n)) {
      f.replicas = n;
    } else if ((v = value("--segment-kib")) && absl::SimpleAtoi(v, &n)) {
      f.segment_bytes = static_cast<uint32_t>(n) << 10;
    } else if ((v = value("--budget-mib")) && absl::SimpleAtoi(v, &n)) {
      f.budget_mib = static_cast<uint64_t>(n);
    } else if ((v = value("--batch-kib")) && absl::SimpleAtoi(v, &n)) {
      f.batch_bytes = static_cast<uint64_t>(n) << 10;
    } else if ((v = value("--sizes-mib"))) {
      f.sizes.clear();
      for (absl::string_view m : absl::StrSplit(v, ',')) {
        if (!absl::SimpleAtoi(m, &n) || n <= 0) {
          std::fprintf(stderr, "remote_bench: bad --sizes-mib %s\n", v);
          return 2;
        }
        f.sizes.push_back(static_cast<uint64_t>(n) << 20);
      }
    } else {
      std::fprintf(stderr, "remote_bench: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  return kvtier::Run(f);
}
