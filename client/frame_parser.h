// FrameParser<Frame>: splits a received GetFrame or PutFrame message (a grpc::ByteBuffer,
// as gRPC's receive path left it: a list of slices) into its fields other than `data`,
// parsed by protobuf, and `data` as views into those slices, without copying the
// payload. The client parses Get frames with it, the daemon Put frames, so that chunk
// bytes are copied once, from gRPC's receive buffers to where they are kept.
//
// Any valid encoding of the message parses: fields in any order, unknown fields (kept in
// the header), `data` repeated (the last occurrence wins, as protobuf has it). An
// encoding the walker does not follow (the deprecated group wire types) falls back to
// flattening the message and letting protobuf parse all of it: one copy, same result.
//
// Threading: not thread-safe; one per stream. Lifetimes: header() and pieces() stay
// valid until the next Parse(); pieces() point into the ByteBuffer passed to Parse (the
// parser holds references on its slices) or into the parser on the fallback path.
#ifndef KVTIER_CLIENT_FRAME_PARSER_H_
#define KVTIER_CLIENT_FRAME_PARSER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

// The message-independent part: walks the top-level fields of an encoded message held
// in slices, copying every field but `data_field` into header_bytes() and keeping views
// of the last `data_field` occurrence.
class FrameSplitter {
 public:
  // False when the message holds a wire type the walker does not follow (groups, or an
  // invalid one) or ends inside a field; the caller then falls back to protobuf.
  bool Split(const grpc::ByteBuffer& message, uint32_t data_field);

  const std::string& header_bytes() const { return header_bytes_; }
  absl::Span<const absl::string_view> pieces() const { return pieces_; }
  uint64_t data_size() const { return data_size_; }

 private:
  bool Walk(uint32_t data_field);

  std::vector<grpc::Slice> slices_;  // References (no copy) to the message's bytes.
  std::string header_bytes_;         // The encoded fields other than data.
  std::vector<absl::string_view> pieces_;
  uint64_t data_size_ = 0;
};

template <typename Frame>
class FrameParser {
 public:
  // Returns false when `message` is not a Frame (truncated, or a field protobuf rejects).
  bool Parse(const grpc::ByteBuffer& message) {
    flat_.clear();
    flat_piece_.clear();
    if (splitter_.Split(message, Frame::kDataFieldNumber)) {
      flat_path_ = false;
      return header_.ParseFromString(splitter_.header_bytes());
    }
    flat_path_ = true;
    grpc::Slice flat;
    if (!message.DumpToSingleSlice(&flat).ok() ||
        !header_.ParseFromArray(flat.begin(), static_cast<int>(flat.size()))) {
      return false;
    }
    flat_ = std::move(*header_.mutable_data());
    header_.clear_data();
    if (!flat_.empty()) flat_piece_.push_back(flat_);
    return true;
  }

  // The frame's fields; data() is always empty (the bytes are in pieces()).
  const Frame& header() const { return header_; }
  // Frame.data, in order; no piece is empty.
  absl::Span<const absl::string_view> pieces() const {
    return flat_path_ ? absl::Span<const absl::string_view>(flat_piece_) : splitter_.pieces();
  }
  // Sum of the pieces' sizes.
  uint64_t data_size() const { return flat_path_ ? flat_.size() : splitter_.data_size(); }

 private:
  FrameSplitter splitter_;
  Frame header_;
  bool flat_path_ = false;
  std::string flat_;  // data on the fallback path.
  std::vector<absl::string_view> flat_piece_;
};

using GetFrameParser = FrameParser<v1::GetFrame>;
using PutFrameParser = FrameParser<v1::PutFrame>;

}  // namespace kvtier

#endif  // KVTIER_CLIENT_FRAME_PARSER_H_
