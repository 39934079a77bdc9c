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

struct ChunkMeta {
  uint64_t size = 0;         // Payload bytes.
  uint32_t crc32c = 0;       // CRC32C of the payload.
  uint32_t token_count = 0;  // Tokens the chunk covers, as given at put.
  uint32_t codec = 0;        // 0 = raw bytes. Reserved for compression.

  friend bool operator==(const ChunkMeta&, const ChunkMeta&) = default;
};

// Where a chunk lives; values match kvtier.v1.Tier.
enum class Tier { kNone = 0, kGpu = 1, kRam = 2, kSsd = 3 };
const char* TierName(Tier tier);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_CHUNK_ID_H_
