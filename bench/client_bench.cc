// The C++ client's single-connection put and get throughput against a running kvtierd,
// the baseline that bench/py_client_bench.py measures the Python client against in the
// same run. One repetition per invocation:
//
//   client_bench --target=127.0.0.1:PORT --chunk-mib=32 --ops=4 --seed=7
//
// registers the layout that makes a chunk --chunk-mib MiB (bf16, 32 layers, 8 KV heads,
// head_dim 128, tokens_per_chunk = chunk-mib * 8), puts --ops chunks from one buffer,
// gets them back into one preallocated buffer (GetStreamRaw, one copy per byte, as the
// Python client's get_into does), deletes them, and prints one JSON line (after the same
// batch once each way, untimed: see the warm-up). --plane=stream keeps the bytes on the
// gRPC stream on the daemon's host too:
//   {"impl":"cpp","chunk_mib":32,"ops":4,"put_gbps":...,"get_gbps":...}
// GB/s is 1e9 bytes per second of wall time around the whole put or get call.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_flags.h"
#include "client/kvtier_client.h"

using namespace kvtier;
using bench::Flag;
using bench::StrFlag;

int main(int argc, char** argv) {
  bench::InitFlags(argc, argv);
  const std::string target = StrFlag("target", "");
  if (target.empty() || StrFlag("help", "") != "") {
    std::fprintf(stderr, "usage: client_bench --target=HOST:PORT [--chunk-mib=32] [--ops=4] [--seed=1]\n");
    return 2;
  }
  const uint64_t chunk_mib = Flag("chunk-mib", 32), ops = Flag("ops", 4), seed = Flag("seed", 1);
  ClientOptions options;
  options.connect_timeout = absl::Seconds(30);
  options.rpc_deadline = absl::Seconds(600);
  // --plane=stream keeps chunk bytes on the gRPC stream even on the daemon's host.
  if (StrFlag("plane", "auto") == "stream") options.data_plane = ClientOptions::DataPlane::kStream;
  auto client = KvTierClient::Connect(target, options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  LayoutSpec layout;
  layout.model_id = "bench-layout";
  layout.dtype = LayoutSpec::DType::kBFloat16;
  layout.num_layers = 32;
  layout.num_kv_heads = 8;
  layout.head_dim = 128;
  layout.tokens_per_chunk = static_cast<uint32_t>(chunk_mib * 8);
  layout.key_position = LayoutSpec::KeyPosition::kPostRope;
  auto reg = (*client)->RegisterLayout(layout);
  if (!reg.ok()) {
    std::fprintf(stderr, "register: %s\n", reg.status().ToString().c_str());
    return 1;
  }
  const uint64_t size = reg->chunk_bytes;
  std::vector<char> payload(size);
  for (uint64_t i = 0; i < size; ++i) payload[i] = static_cast<char>(i * 131 + seed);
  std::vector<ChunkKey> keys;
  std::vector<ChunkToPut> chunks;
  for (uint64_t i = 0; i < ops; ++i) {
    const std::vector<uint32_t> tokens = {static_cast<uint32_t>(seed), static_cast<uint32_t>(i),
                                          0xC0FFEEu};
    keys.push_back(FirstChunkKey(reg->namespace_id, tokens));
    chunks.push_back({keys.back(), absl::string_view(payload.data(), size), 0});
  }
  // Warm up as the Python side's long-lived client is warm: the connection (TCP window,
  // HTTP/2 flow control) and, on the daemon's host, the staging buffer a batch of this
  // size goes through (kept by the client for the next call; created and faulted in by
  // the first). So the same batch, each way, under keys the timed run does not use.
  {
    std::vector<ChunkKey> warm_keys;
    std::vector<ChunkToPut> warm;
    for (uint64_t i = 0; i < ops; ++i) {
      warm_keys.push_back(FirstChunkKey(reg->namespace_id, {static_cast<uint32_t>(seed),
                                                             static_cast<uint32_t>(i), 0xFFFFFFFFu}));
      warm.push_back({warm_keys.back(), absl::string_view(payload.data(), size), 0});
    }
    std::vector<char> sink(size);
    auto put = (*client)->Put(reg->namespace_id, warm);
    absl::Status got = (*client)->GetStreamRaw(
        reg->namespace_id, warm_keys, std::nullopt,
        [&](uint32_t, const GetFrameHeader& h, absl::Span<const absl::string_view> data) {
          uint64_t off = h.offset();
          for (absl::string_view p : data) {
            std::memcpy(sink.data() + off, p.data(), p.size());
            off += p.size();
          }
          return absl::OkStatus();
        });
    if (!put.ok() || put->stored != ops || !got.ok()) {
      std::fprintf(stderr, "warm-up failed\n");
      return 1;
    }
    (*client)->Delete(reg->namespace_id, warm_keys).IgnoreError();
  }
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  auto put = (*client)->Put(reg->namespace_id, chunks);
  const double put_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!put.ok() || put->stored != ops) {
    std::fprintf(stderr, "put: %s\n", put.ok() ? "not all stored" : put.status().ToString().c_str());
    return 1;
  }
  std::vector<char> out(size * ops);
  t0 = Clock::now();
  uint64_t got = 0;
  absl::Status s = (*client)->GetStreamRaw(
      reg->namespace_id, keys, std::nullopt,
      [&](uint32_t index, const GetFrameHeader& h, absl::Span<const absl::string_view> data) {
        uint64_t off = index * size + h.offset();
        for (absl::string_view p : data) {
          std::memcpy(out.data() + off, p.data(), p.size());
          off += p.size();
          got += p.size();
        }
        return absl::OkStatus();
      });
  const double get_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!s.ok() || got != size * ops) {
    std::fprintf(stderr, "get: %s\n", s.ok() ? "short" : s.ToString().c_str());
    return 1;
  }
  if (std::memcmp(out.data() + (ops - 1) * size, payload.data(), size) != 0) {
    std::fprintf(stderr, "get: bytes differ\n");
    return 1;
  }
  (*client)->Delete(reg->namespace_id, keys).IgnoreError();  // Best effort: frees the pool.
  const double bytes = static_cast<double>(size * ops);
  std::printf("{\"impl\":\"cpp\",\"chunk_mib\":%llu,\"ops\":%llu,\"put_gbps\":%.4f,\"get_gbps\":%.4f}\n",
              static_cast<unsigned long long>(chunk_mib), static_cast<unsigned long long>(ops),
              bytes / put_s / 1e9, bytes / get_s / 1e9);
  return 0;
}
