// ChunkId (namespace + key) and ChunkMeta (what every stored chunk carries).
#ifndef KVTIER_STORAGE_CHUNK_ID_H_
#define KVTIER_STORAGE_CHUNK_ID_H_

#include <cstdint>
#include <string>

#include "storage/chunk_key.h"

namespace kvtier {

struct ChunkId {
  uint64_t ns = 0;
  ChunkKey key;

  friend bool operator==(const ChunkId&, const ChunkId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ChunkId& id) {
    return H::combine(std::move(h), id.ns, id.key);
  }
  std::string DebugString() const;
};

// Where a chunk sits in its request's key chain, as its writer said (PutFrame's
// chunk_index and prev_key): chunk i's key names every token before it, so both are
// facts about the key, and eviction uses them (a chunk is useful only while its parent
// is cached; recomputing chunk i costs more the larger i is). Unknown for chunks put
// without them.
struct ChunkLineage {
  static constexpr uint32_t kUnknownPosition = UINT32_MAX;
  uint32_t position = kUnknownPosition;  // i, the chunk's index in its token sequence.
  bool has_parent = false;               // Whether `parent` is set.
  ChunkKey parent;                       // key[i-1] (same namespace).

  friend bool operator==(const ChunkLineage&, const ChunkLineage&) = default;
};

struct ChunkMeta {
  uint64_t size = 0;         // Payload bytes.
  uint32_t crc32c = 0;       // CRC32C of the payload.
  uint32_t token_count = 0;  // Tokens the chunk covers, as given at put.
  uint32_t codec = 0;        // 0 = raw bytes. Reserved for compression.
  ChunkLineage lineage;      // An eviction hint; not part of the chunk's identity.

  // Equal payload descriptions; lineage is not compared.
  friend bool operator==(const ChunkMeta& a, const ChunkMeta& b) {
    return a.size == b.size && a.crc32c == b.crc32c && a.token_count == b.token_count &&
           a.codec == b.codec;
  }
};

// Where a chunk lives; values match kvtier.v1.Tier.
enum class Tier { kNone = 0, kGpu = 1, kRam = 2, kSsd = 3, kRemote = 4 };
const char* TierName(Tier tier);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_CHUNK_ID_H_
