#include "client/frame_parser.h"

#include <algorithm>
#include <utility>

namespace kvtier {
namespace {

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5,
};

// A read position over a list of slices.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    SkipEmpty();
  }

  bool AtEnd() const { return slice_ == slices_.size(); }

  // Reads a varint, appending its encoded bytes to `raw`. False if the message ends
  // inside it or it is longer than 10 bytes.
  bool ReadVarint(uint64_t* value, std::string* raw) {
    *value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      if (AtEnd()) return false;
      const uint8_t b = slices_[slice_].begin()[at_];
      raw->push_back(static_cast<char>(b));
      Advance(1);
      *value |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // Calls fn(piece) for each non-empty piece of the next `n` bytes and moves past them.
  // False (having called fn for what there was) if fewer than n bytes remain.
  template <typename Fn>
  bool Take(uint64_t n, Fn&& fn) {
    while (n > 0) {
      if (AtEnd()) return false;
      const grpc::Slice& s = slices_[slice_];
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, s.size() - at_));
      fn(absl::string_view(reinterpret_cast<const char*>(s.begin()) + at_, k));
      Advance(k);
      n -= k;
    }
    return true;
  }

 private:
  void Advance(size_t k) {
    at_ += k;
    if (at_ == slices_[slice_].size()) {
      ++slice_;
      at_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;  // Index of the current slice; slices_.size() at the end.
  size_t at_ = 0;     // Offset in it; always < its size.
};

}  // namespace

bool FrameSplitter::Split(const grpc::ByteBuffer& message, uint32_t data_field) {
  slices_.clear();
  // An empty message may come as a buffer with no slices at all.
  if (message.Valid() && !message.Dump(&slices_).ok()) return false;  // Refs, no copy.
  return Walk(data_field);
}

bool FrameSplitter::Walk(uint32_t data_field) {
  header_bytes_.clear();
  pieces_.clear();
  data_size_ = 0;
  SliceCursor cursor(slices_);
  const auto append = [this](absl::string_view piece) {
    header_bytes_.append(piece.data(), piece.size());
  };
  std::string tag_bytes;
  while (!cursor.AtEnd()) {
    uint64_t tag;
    tag_bytes.clear();
    if (!cursor.ReadVarint(&tag, &tag_bytes)) return false;
    const auto wire_type = static_cast<uint32_t>(tag & 7);
    if (wire_type == kLengthDelimited && (tag >> 3) == data_field) {
      uint64_t n;
      std::string len_bytes;
      if (!cursor.ReadVarint(&n, &len_bytes)) return false;
      pieces_.clear();  // A repeated singular field: the last one wins.
      data_size_ = n;
      if (!cursor.Take(n, [this](absl::string_view piece) { pieces_.push_back(piece); })) {
        return false;
      }
      continue;
    }
    header_bytes_.append(tag_bytes);
    switch (wire_type) {
      case kVarint: {
        uint64_t ignored;
        if (!cursor.ReadVarint(&ignored, &header_bytes_)) return false;
        break;
      }
      case kFixed64:
        if (!cursor.Take(8, append)) return false;
        break;
      case kFixed32:
        if (!cursor.Take(4, append)) return false;
        break;
      case kLengthDelimited: {
        uint64_t n;
        if (!cursor.ReadVarint(&n, &header_bytes_)) return false;
        if (!cursor.Take(n, append)) return false;
        break;
      }
      default:  // Groups (3, 4) and invalid wire types (6, 7): let protobuf judge.
        return false;
    }
  }
  return true;
}

}  // namespace kvtier
