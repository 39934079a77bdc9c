#include "client/layout_convert.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

// The casts below rely on the two enum sets sharing values; pin that here so that a
// change to either side fails to compile instead of silently renumbering the wire.
static_assert(static_cast<int>(LayoutSpec::DType::kFloat16) == v1::DTYPE_FLOAT16);
static_assert(static_cast<int>(LayoutSpec::DType::kBFloat16) == v1::DTYPE_BFLOAT16);
static_assert(static_cast<int>(LayoutSpec::DType::kFloat32) == v1::DTYPE_FLOAT32);
static_assert(static_cast<int>(LayoutSpec::DType::kFloat8E4M3) == v1::DTYPE_FLOAT8_E4M3);
static_assert(static_cast<int>(LayoutSpec::DType::kFloat8E5M2) == v1::DTYPE_FLOAT8_E5M2);
static_assert(static_cast<int>(LayoutSpec::KeyPosition::kPostRope) ==
              v1::KEY_POSITION_POST_ROPE);
static_assert(static_cast<int>(LayoutSpec::KeyPosition::kPreRope) ==
              v1::KEY_POSITION_PRE_ROPE);

v1::Layout LayoutToProto(const LayoutSpec& spec) {
  v1::Layout out;
  out.set_model_id(spec.model_id);
  out.set_model_revision(spec.model_revision);
  // An out-of-range value in the spec stays out of range on the wire (proto3 enums are
  // open); the receiver's validation reports it.
  out.set_dtype(static_cast<v1::DType>(spec.dtype));
  out.set_num_layers(spec.num_layers);
  out.set_num_kv_heads(spec.num_kv_heads);
  out.set_head_dim(spec.head_dim);
  out.set_tokens_per_chunk(spec.tokens_per_chunk);
  out.set_tp_world_size(spec.tp_world_size);
  out.set_tp_rank(spec.tp_rank);
  out.set_key_position(static_cast<v1::KeyPosition>(spec.key_position));
  return out;
}

absl::StatusOr<LayoutSpec> LayoutFromProto(const v1::Layout& layout) {
  // Reject values LayoutSpec's enums cannot hold before casting: a key_position of 257
  // must not become 1 (kPostRope) by truncation.
  if (layout.dtype() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout.dtype is unspecified or unknown (", layout.dtype(), ")"));
  }
  if (layout.key_position() < 0 || layout.key_position() > 0xff) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout.key_position is unspecified or unknown (",
                     layout.key_position(), ")"));
  }
  LayoutSpec spec;
  spec.model_id = layout.model_id();
  spec.model_revision = layout.model_revision();
  spec.dtype = static_cast<LayoutSpec::DType>(layout.dtype());
  spec.num_layers = layout.num_layers();
  spec.num_kv_heads = layout.num_kv_heads();
  spec.head_dim = layout.head_dim();
  spec.tokens_per_chunk = layout.tokens_per_chunk();
  spec.tp_world_size = layout.tp_world_size();
  spec.tp_rank = layout.tp_rank();
  spec.key_position = static_cast<LayoutSpec::KeyPosition>(layout.key_position());
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  return spec;
}

}  // namespace kvtier
