// Deterministic chunk payloads and layouts for tests and benchmarks.
#ifndef KVTIER_TESTS_SUPPORT_TEST_DATA_H_
#define KVTIER_TESTS_SUPPORT_TEST_DATA_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "storage/chunk_key.h"
#include "storage/layout_spec.h"

namespace kvtier::testing {

// `bytes` pseudo-random bytes determined by `seed` (splitmix64).
inline std::string PatternBytes(uint64_t seed, size_t bytes) {
  std::string out(bytes, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < bytes; i += 8) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(out.data() + i, &z, std::min<size_t>(8, bytes - i));
  }
  return out;
}

// A layout whose chunks are exactly `chunk_mib` MiB: fp16, 8 KV heads of 128 dims,
// 256 tokens per chunk (1 MiB per layer), `chunk_mib` layers.
inline LayoutSpec LayoutOfMiB(uint32_t chunk_mib, const std::string& model = "test-model") {
  LayoutSpec l;
  l.model_id = model;
  l.model_revision = "r1";
  l.dtype = LayoutSpec::DType::kFloat16;
  l.num_layers = chunk_mib;
  l.num_kv_heads = 8;
  l.head_dim = 128;
  l.tokens_per_chunk = 256;
  l.tp_world_size = 1;
  l.tp_rank = 0;
  l.key_position = LayoutSpec::KeyPosition::kPostRope;
  return l;
}

// A distinct key per integer.
inline ChunkKey KeyOf(uint64_t i) { return ChunkKey{0x6b76746965720000ull ^ i, ~i * 31}; }

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_TEST_DATA_H_
