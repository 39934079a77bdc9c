#include "storage/layout_spec.h"

#include <xxhash.h>

#include <limits>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

constexpr absl::string_view kMagic = "kvtier-layout-v1";

void AppendLe32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads little-endian integers and length-prefixed strings from an encoding.
class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  bool Le32(uint32_t& v) {
    if (in_.size() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(in_[i])} << (8 * i);
    in_.remove_prefix(4);
    return true;
  }
  bool U8(uint8_t& v) {
    if (in_.empty()) return false;
    v = static_cast<uint8_t>(in_[0]);
    in_.remove_prefix(1);
    return true;
  }
  bool String(std::string& s) {
    uint32_t n;
    if (!Le32(n) || in_.size() < n) return false;
    s.assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool Literal(absl::string_view lit) {
    if (in_.substr(0, lit.size()) != lit) return false;
    in_.remove_prefix(lit.size());
    return true;
  }
  bool AtEnd() const { return in_.empty(); }

 private:
  absl::string_view in_;
};

}  // namespace

uint32_t LayoutSpec::DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
    case DType::kUnspecified:
      break;
  }
  return 0;
}

absl::Status LayoutSpec::Validate() const {
  auto bad = [](absl::string_view field, auto&&... why) {
    return absl::InvalidArgumentError(absl::StrCat("layout.", field, " ", why...));
  };
  if (model_id.empty()) return bad("model_id", "is required");
  if (model_id.size() > kMaxModelIdBytes) {
    return bad("model_id", "is longer than ", kMaxModelIdBytes, " bytes");
  }
  if (model_revision.size() > kMaxModelIdBytes) {
    return bad("model_revision", "is longer than ", kMaxModelIdBytes, " bytes");
  }
  if (DTypeBytes(dtype) == 0) {
    return bad("dtype", "is unspecified or unknown (", static_cast<uint32_t>(dtype), ")");
  }
  if (num_layers == 0) return bad("num_layers", "must be >= 1");
  if (num_kv_heads == 0) return bad("num_kv_heads", "must be >= 1");
  if (head_dim == 0) return bad("head_dim", "must be >= 1");
  if (tokens_per_chunk == 0) return bad("tokens_per_chunk", "must be >= 1");
  if (tp_world_size == 0) return bad("tp_world_size", "must be >= 1");
  if (tp_rank >= tp_world_size) {
    return bad("tp_rank", "must be < tp_world_size (", tp_world_size, "), got ", tp_rank);
  }
  if (key_position != KeyPosition::kPostRope && key_position != KeyPosition::kPreRope) {
    return bad("key_position", "is unspecified or unknown");
  }
  // Overflow guard: the product must fit comfortably in 64 bits. Each factor is < 2^32,
  // so check step by step.
  unsigned __int128 bytes = static_cast<unsigned __int128>(num_layers) * 2 * num_kv_heads *
                            head_dim * tokens_per_chunk * DTypeBytes(dtype);
  if (bytes > (unsigned __int128)std::numeric_limits<uint64_t>::max() / 2) {
    return bad("num_layers", "and the other dimensions give an impossibly large chunk");
  }
  return absl::OkStatus();
}

uint64_t LayoutSpec::ChunkBytes() const {
  return uint64_t{num_layers} * 2 * num_kv_heads * head_dim * tokens_per_chunk *
         DTypeBytes(dtype);
}

std::string LayoutSpec::CanonicalEncoding() const {
  std::string out(kMagic);
  AppendLe32(out, static_cast<uint32_t>(model_id.size()));
  out += model_id;
  AppendLe32(out, static_cast<uint32_t>(model_revision.size()));
  out += model_revision;
  AppendLe32(out, static_cast<uint32_t>(dtype));
  AppendLe32(out, num_layers);
  AppendLe32(out, num_kv_heads);
  AppendLe32(out, head_dim);
  AppendLe32(out, tokens_per_chunk);
  AppendLe32(out, tp_world_size);
  AppendLe32(out, tp_rank);
  out.push_back(static_cast<char>(key_position));
  return out;
}

uint64_t LayoutSpec::NamespaceId() const {
  const std::string enc = CanonicalEncoding();
  return XXH3_64bits(enc.data(), enc.size());
}

absl::StatusOr<LayoutSpec> LayoutSpec::FromCanonicalEncoding(absl::string_view bytes) {
  Reader r(bytes);
  LayoutSpec s;
  uint32_t dtype = 0;
  uint8_t key_position = 0;
  if (!r.Literal(kMagic) || !r.String(s.model_id) || !r.String(s.model_revision) ||
      !r.Le32(dtype) || !r.Le32(s.num_layers) || !r.Le32(s.num_kv_heads) ||
      !r.Le32(s.head_dim) || !r.Le32(s.tokens_per_chunk) || !r.Le32(s.tp_world_size) ||
      !r.Le32(s.tp_rank) || !r.U8(key_position) || !r.AtEnd()) {
    return absl::InvalidArgumentError("not a kvtier-layout-v1 encoding");
  }
  s.dtype = static_cast<DType>(dtype);
  s.key_position = static_cast<KeyPosition>(key_position);
  return s;
}

}  // namespace kvtier
