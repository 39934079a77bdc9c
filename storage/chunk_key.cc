#include "storage/chunk_key.h"

#include <xxhash.h>

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

void AppendLe32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void AppendLe64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

ChunkKey Hash128(const std::string& bytes) {
  XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return ChunkKey{h.high64, h.low64};
}

std::string TokenBytes(std::string prefix, absl::Span<const uint32_t> tokens) {
  prefix.reserve(prefix.size() + 4 * tokens.size());
  for (uint32_t t : tokens) AppendLe32(prefix, t);
  return prefix;
}

}  // namespace

absl::StatusOr<ChunkKey> ChunkKey::FromBytes(absl::string_view bytes) {
  if (bytes.size() != kWireBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key must be ", kWireBytes, " bytes, got ", bytes.size()));
  }
  XXH128_canonical_t c;
  std::memcpy(c.digest, bytes.data(), kWireBytes);
  XXH128_hash_t h = XXH128_hashFromCanonical(&c);
  return ChunkKey{h.high64, h.low64};
}

absl::StatusOr<ChunkKey> ChunkKey::FromHex(absl::string_view hex) {
  if (hex.size() != 2 * kWireBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key must be ", 2 * kWireBytes, " hex digits, got ", hex.size()));
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(
          absl::StrCat("key has a non-hex character: '", hex, "'"));
    }
  }
  return FromBytes(absl::HexStringToBytes(hex));
}

std::array<uint8_t, ChunkKey::kWireBytes> ChunkKey::ToBytes() const {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH128_hash_t{lo, hi});
  std::array<uint8_t, kWireBytes> out;
  std::memcpy(out.data(), c.digest, kWireBytes);
  return out;
}

std::string ChunkKey::ToByteString() const {
  auto b = ToBytes();
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

std::string ChunkKey::ToHex() const { return absl::BytesToHexString(ToByteString()); }

ChunkKey FirstChunkKey(uint64_t namespace_id, absl::Span<const uint32_t> tokens) {
  std::string prefix;
  AppendLe64(prefix, namespace_id);
  return Hash128(TokenBytes(std::move(prefix), tokens));
}

ChunkKey NextChunkKey(const ChunkKey& prev, absl::Span<const uint32_t> tokens) {
  return Hash128(TokenBytes(prev.ToByteString(), tokens));
}

std::vector<ChunkKey> ComputeChunkKeys(uint64_t namespace_id,
                                       absl::Span<const uint32_t> tokens,
                                       uint32_t tokens_per_chunk) {
  std::vector<ChunkKey> keys;
  if (tokens_per_chunk == 0) return keys;
  const size_t n = tokens.size() / tokens_per_chunk;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto chunk = tokens.subspan(i * tokens_per_chunk, tokens_per_chunk);
    keys.push_back(i == 0 ? FirstChunkKey(namespace_id, chunk)
                          : NextChunkKey(keys.back(), chunk));
  }
  return keys;
}

}  // namespace kvtier
