// LayoutSpec: the KV-cache shape of one model shard, its canonical encoding and the
// namespace id derived from it. Mirrors kvtier.v1.Layout; the encoding is normative
// (see the proto) and shared by every client.
//
// Thread-safety: value type.
#ifndef KVTIER_STORAGE_LAYOUT_SPEC_H_
#define KVTIER_STORAGE_LAYOUT_SPEC_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier {

struct LayoutSpec {
  // Values match kvtier.v1.DType.
  enum class DType : uint32_t {
    kUnspecified = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3,
    kFloat8E4M3 = 4, kFloat8E5M2 = 5,
  };
  // Values match kvtier.v1.KeyPosition.
  enum class KeyPosition : uint8_t { kUnspecified = 0, kPostRope = 1, kPreRope = 2 };

  static constexpr size_t kMaxModelIdBytes = 256;

  std::string model_id;
  std::string model_revision;
  DType dtype = DType::kUnspecified;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens_per_chunk = 0;
  uint32_t tp_world_size = 1;
  uint32_t tp_rank = 0;
  KeyPosition key_position = KeyPosition::kUnspecified;

  // Returns InvalidArgument naming the first bad field.
  absl::Status Validate() const;

  // Bytes of one element of `dtype`; 0 if unspecified or unknown.
  static uint32_t DTypeBytes(DType dtype);

  // num_layers * 2 * num_kv_heads * head_dim * tokens_per_chunk * DTypeBytes(dtype).
  // Only meaningful after Validate() returned Ok.
  uint64_t ChunkBytes() const;
  uint64_t LayerBytes() const { return ChunkBytes() / num_layers; }

  // The canonical encoding (normative; see kvtier.proto) and its XXH3-64 hash.
  std::string CanonicalEncoding() const;
  uint64_t NamespaceId() const;

  // Inverse of CanonicalEncoding(). Returns: Ok, InvalidArgument (truncated or not an
  // encoding this version knows).
  static absl::StatusOr<LayoutSpec> FromCanonicalEncoding(absl::string_view bytes);

  friend bool operator==(const LayoutSpec&, const LayoutSpec&) = default;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_LAYOUT_SPEC_H_
