#include "client/get_frame_checker.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvtier_client.h"  // kMaxAcceptedChunkBytes
#include "storage/crc32c.h"

namespace kvtier {
namespace {

constexpr uint8_t kUnanswered = 0, kFound = 1, kAbsent = 2;

absl::Status Violation(absl::string_view what) {
  return absl::InternalError(absl::StrCat("Get: server protocol violation: ", what));
}

}  // namespace

GetFrameChecker::GetFrameChecker(absl::Span<const ChunkKey> keys, bool layer_major,
                                 std::optional<uint32_t> first_layer,
                                 std::optional<uint32_t> end_layer, bool verify_crc,
                                 std::optional<Shape> shape)
    : keys_(keys),
      layer_major_(layer_major),
      // A range of every layer asks for whole chunks too (and the daemon answers them
      // with the chunk's CRC32C): checked as such.
      whole_chunks_(verify_crc &&
                    (!first_layer.has_value() ||
                     (shape.has_value() && *first_layer == 0 &&
                      end_layer.value_or(shape->num_layers) == shape->num_layers))),
      first_layer_(first_layer.has_value() || !shape.has_value() ? first_layer
                                                                  : std::optional<uint32_t>(0)),
      end_layer_(end_layer.has_value() || !shape.has_value()
                     ? end_layer
                     : std::optional<uint32_t>(shape->num_layers)),
      shape_(shape) {
  if (layer_major_) {
    found_.assign(keys.size(), kUnanswered);
    key_crc_.assign(keys.size(), 0);
    key_expected_crc_.assign(keys.size(), 0);
  }
}

absl::Status GetFrameChecker::Check(const v1::GetFrame& frame,
                                    absl::Span<const absl::string_view> data, uint64_t n) {
  // Callers size buffers from total_bytes before the bytes arrive; without a Shape
  // nothing else bounds it.
  if (frame.total_bytes() > kMaxAcceptedChunkBytes) {
    return Violation(absl::StrCat("key_index ", frame.key_index(), " has total_bytes ",
                                  frame.total_bytes(), ", past the largest chunk accepted (",
                                  kMaxAcceptedChunkBytes, ")"));
  }
  return layer_major_ ? CheckLayerMajor(frame, data, n) : CheckChunkMajor(frame, data, n);
}

absl::Status GetFrameChecker::CheckBytes(const v1::GetFrame& frame,
                                         absl::Span<const absl::string_view> data,
                                         uint64_t n) {
  const uint32_t index = frame.key_index();
  // Every frame of a found key's piece says found: callers act on found() frame by frame
  // (GetInto and the Python binding skip absent keys' frames), so bytes under found =
  // false after the piece's first frame would be counted here, yet never land.
  if (!frame.found()) {
    return Violation(absl::StrCat("found = false for key_index ", index, " at offset ",
                                  frame.offset(), " of a piece it began found"));
  }
  if (frame.offset() != received_) {
    return Violation(absl::StrCat("offset ", frame.offset(), " for key_index ", index,
                                  ", expected ", received_));
  }
  if (n > total_ - received_) {
    return Violation(absl::StrCat("more than total_bytes (", total_, ") for key_index ",
                                  index));
  }
  received_ += n;
  if (whole_chunks_) {
    uint32_t& crc = layer_major_ ? key_crc_[index] : crc_;
    for (absl::string_view piece : data) crc = crc32c::Extend(crc, piece.data(), piece.size());
  }
  if (frame.last() && received_ != total_) {
    return Violation(absl::StrCat("last frame for key_index ", index, " after ", received_,
                                  " of ", total_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status GetFrameChecker::CheckChunkMajor(const v1::GetFrame& frame,
                                              absl::Span<const absl::string_view> data,
                                              uint64_t n) {
  const uint32_t index = frame.key_index();
  if (!in_piece_) {
    if (next_ >= keys_.size()) {
      return Violation(absl::StrCat("a frame for key_index ", index, " after all ",
                                    keys_.size(), " keys were answered"));
    }
    if (index != next_) {
      return Violation(
          absl::StrCat("a frame for key_index ", index, " when ", next_, " was due"));
    }
    if (!frame.found()) {
      if (n != 0) return Violation(absl::StrCat("data with found = false for key_index ", index));
      ++next_;
      return absl::OkStatus();
    }
    if (shape_.has_value() && frame.total_bytes() != shape_->item_bytes) {
      return Violation(absl::StrCat("key_index ", index, " has total_bytes ",
                                    frame.total_bytes(), "; the layout's chunks (or the "
                                    "requested layers of them) are ", shape_->item_bytes));
    }
    in_piece_ = true;
    total_ = frame.total_bytes();
    expected_crc_ = frame.crc32c();
    received_ = 0;
    crc_ = 0;
  } else if (index != next_) {
    return Violation(absl::StrCat("a frame for key_index ", index, " while key_index ", next_,
                                  " had ", received_, " of ", total_, " bytes"));
  }
  if (absl::Status s = CheckBytes(frame, data, n); !s.ok()) return s;
  if (frame.last()) {
    if (whole_chunks_ && crc_ != expected_crc_) {
      return absl::DataLossError(absl::StrFormat(
          "Get: chunk %s (key_index %u) failed its CRC32C: server says %08x, the %u bytes "
          "received give %08x",
          keys_[index].ToHex(), index, expected_crc_, received_, crc_));
    }
    in_piece_ = false;
    ++next_;
  }
  return absl::OkStatus();
}

uint32_t GetFrameChecker::NextDue(std::optional<uint32_t> after) const {
  uint32_t i = after.has_value() ? *after + 1 : 0;
  if (!first_pass_) {
    while (i < keys_.size() && found_[i] != kFound) ++i;
  }
  return i;
}

absl::Status GetFrameChecker::CheckLayerMajor(const v1::GetFrame& frame,
                                              absl::Span<const absl::string_view> data,
                                              uint64_t n) {
  const uint32_t index = frame.key_index();
  if (in_piece_) {
    if (index != next_ || frame.layer() != *layer_) {
      return Violation(absl::StrCat("a frame for key_index ", index, " layer ", frame.layer(),
                                    " while key_index ", next_, " layer ", *layer_, " had ",
                                    received_, " of ", total_, " bytes"));
    }
  } else {
    // A new piece: the next key of this pass, or the first of the next pass.
    if (!layer_.has_value()) {
      if (first_layer_.has_value() && frame.layer() != *first_layer_) {
        return Violation(absl::StrCat("first pass at layer ", frame.layer(),
                                      ", the request asked for layers from ", *first_layer_));
      }
      if (end_layer_.has_value() && frame.layer() >= *end_layer_) {
        return Violation(absl::StrCat("layer ", frame.layer(), " is outside [",
                                      first_layer_.value_or(0), ", ", *end_layer_, ")"));
      }
      layer_ = frame.layer();
      next_ = NextDue(std::nullopt);
    } else if (next_ >= keys_.size()) {
      // The pass is complete; this frame opens the next one.
      first_pass_ = false;
      next_ = NextDue(std::nullopt);
      if (next_ >= keys_.size()) {
        return Violation(absl::StrCat("a frame for key_index ", index, " layer ",
                                      frame.layer(), " after the pass of layer ", *layer_,
                                      ", but no key was found"));
      }
      if (frame.layer() != *layer_ + 1) {
        return Violation(absl::StrCat("a pass at layer ", frame.layer(), " after layer ",
                                      *layer_));
      }
      if (end_layer_.has_value() && frame.layer() >= *end_layer_) {
        return Violation(absl::StrCat("layer ", frame.layer(), " is outside the requested [",
                                      first_layer_.value_or(0), ", ", *end_layer_, ")"));
      }
      layer_ = frame.layer();
    }
    if (index != next_ || frame.layer() != *layer_) {
      return Violation(absl::StrCat("a frame for key_index ", index, " layer ", frame.layer(),
                                    " when key_index ", next_, " layer ", *layer_,
                                    " was due"));
    }
    if (!frame.found()) {
      if (!first_pass_) {
        return Violation(absl::StrCat("found = false for key_index ", index, " at layer ",
                                      frame.layer(), ", after it was found"));
      }
      if (n != 0) return Violation(absl::StrCat("data with found = false for key_index ", index));
      found_[index] = kAbsent;
      next_ = NextDue(index);
      return absl::OkStatus();
    }
    if (piece_bytes_ == 0) piece_bytes_ = shape_.has_value() ? shape_->layer_bytes
                                                             : frame.total_bytes();
    if (frame.total_bytes() != piece_bytes_ || piece_bytes_ == 0) {
      return Violation(absl::StrCat("key_index ", index, " layer ", frame.layer(), " has ",
                                    frame.total_bytes(), " bytes, ",
                                    shape_.has_value() ? "the layout's layers " : "other pieces ",
                                    piece_bytes_));
    }
    if (first_pass_) {
      found_[index] = kFound;
      key_expected_crc_[index] = frame.crc32c();
    } else if (frame.crc32c() != key_expected_crc_[index]) {
      return Violation(absl::StrFormat(
          "key_index %u layer %u says CRC32C %08x, its first layer said %08x", index,
          frame.layer(), frame.crc32c(), key_expected_crc_[index]));
    }
    in_piece_ = true;
    total_ = piece_bytes_;
    received_ = 0;
  }
  if (absl::Status s = CheckBytes(frame, data, n); !s.ok()) return s;
  if (frame.last()) {
    in_piece_ = false;
    next_ = NextDue(index);
  }
  return absl::OkStatus();
}

absl::Status GetFrameChecker::Finish() const {
  if (!layer_major_) {
    if (in_piece_ || next_ != keys_.size()) {
      return Violation(absl::StrCat("end of stream after ", next_, " of ", keys_.size(),
                                    " keys", in_piece_ ? " (one cut short)" : ""));
    }
    return absl::OkStatus();
  }
  if (keys_.empty()) return absl::OkStatus();
  if (in_piece_ || next_ != keys_.size()) {
    return Violation(absl::StrCat("end of stream in the pass of layer ",
                                  layer_.has_value() ? absl::StrCat(*layer_) : "(none)",
                                  " before key_index ", next_, " was answered",
                                  in_piece_ ? " (a piece cut short)" : ""));
  }
  bool any_found = false;
  for (uint8_t f : found_) any_found |= f == kFound;
  if (any_found && end_layer_.has_value() && *layer_ + 1 != *end_layer_) {
    return Violation(absl::StrCat("end of stream after layer ", *layer_, " of [",
                                  *first_layer_, ", ", *end_layer_, ")"));
  }
  if (whole_chunks_) {
    for (uint32_t i = 0; i < keys_.size(); ++i) {
      if (found_[i] == kFound && key_crc_[i] != key_expected_crc_[i]) {
        return absl::DataLossError(absl::StrFormat(
            "Get: chunk %s (key_index %u) failed its CRC32C: server says %08x, the bytes "
            "received give %08x",
            keys_[i].ToHex(), i, key_expected_crc_[i], key_crc_[i]));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier
