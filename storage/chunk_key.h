// Chunk keys: the prefix-chained XXH3-128 scheme shared by the daemon and every client.
// The normative byte encoding is written in proto/kvtier/v1/kvtier.proto; the test
// vectors in tests/chunk_key_test.cc pin it.
//
// Thread-safety: ChunkKey is a value type; all functions here are pure.
#ifndef KVTIER_STORAGE_CHUNK_KEY_H_
#define KVTIER_STORAGE_CHUNK_KEY_H_

#include <array>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvtier {

// A 128-bit chunk key. `hi` and `lo` are the XXH128 halves; the wire form is 16 bytes,
// hi big-endian then lo big-endian (XXH128's canonical form).
struct ChunkKey {
  uint64_t hi = 0;
  uint64_t lo = 0;

  static constexpr size_t kWireBytes = 16;

  // Parses the 16-byte wire form. Returns: Ok, InvalidArgument (wrong length).
  static absl::StatusOr<ChunkKey> FromBytes(absl::string_view bytes);
  // Parses 32 hex digits (the wire form in hex). Returns: Ok, InvalidArgument.
  static absl::StatusOr<ChunkKey> FromHex(absl::string_view hex);

  std::array<uint8_t, kWireBytes> ToBytes() const;
  std::string ToByteString() const;
  std::string ToHex() const;

  friend bool operator==(const ChunkKey&, const ChunkKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ChunkKey& k) {
    return H::combine(std::move(h), k.hi, k.lo);
  }
};

// key[0] of a request: XXH3_128(le64(namespace_id) || le32 tokens...).
ChunkKey FirstChunkKey(uint64_t namespace_id, absl::Span<const uint32_t> tokens);
// key[i] from key[i-1]: XXH3_128(prev as 16 bytes || le32 tokens...).
ChunkKey NextChunkKey(const ChunkKey& prev, absl::Span<const uint32_t> tokens);

// Keys of every full chunk of `tokens` (a partial last chunk gets no key).
// tokens_per_chunk must be >= 1.
std::vector<ChunkKey> ComputeChunkKeys(uint64_t namespace_id,
                                       absl::Span<const uint32_t> tokens,
                                       uint32_t tokens_per_chunk);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_CHUNK_KEY_H_
