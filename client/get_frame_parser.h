// GetFrameParser: splits a received GetFrame message (a grpc::ByteBuffer, as gRPC's
// receive path left it: a list of slices) into its fields other than `data`, parsed by
// protobuf, and `data` as views into those slices, without copying the payload.
// Internal to the client library.
//
// Any valid encoding of GetFrame parses: fields in any order, unknown fields (kept in
// the header), `data` repeated (the last occurrence wins, as protobuf has it). An
// encoding this walker does not follow (the deprecated group wire types) falls back to
// flattening the message and letting protobuf parse all of it: one copy, same result.
//
// Threading: not thread-safe; one per stream. Lifetimes: header() and pieces() stay
// valid until the next Parse(); pieces() point into the ByteBuffer passed to Parse (or
// into the parser on the fallback path), so that buffer must outlive their use.
#ifndef KVTIER_CLIENT_GET_FRAME_PARSER_H_
#define KVTIER_CLIENT_GET_FRAME_PARSER_H_

#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

class GetFrameParser {
 public:
  // Returns: Ok, Internal (not a GetFrame: truncated, or a field protobuf rejects).
  absl::Status Parse(const grpc::ByteBuffer& message);

  // The frame's fields; data() is always empty (the bytes are in pieces()).
  const v1::GetFrame& header() const { return header_; }
  // GetFrame.data, in order; no piece is empty.
  absl::Span<const absl::string_view> pieces() const { return pieces_; }
  // Sum of the pieces' sizes.
  uint64_t data_size() const { return data_size_; }

 private:
  // Walks the top-level fields over slices_. Returns false when the message holds a
  // wire type it does not follow (groups) or ends inside a field; Parse then falls back.
  bool Walk();
  absl::Status ParseFlat(const grpc::ByteBuffer& message);

  std::vector<grpc::Slice> slices_;      // References (no copy) to the message's bytes.
  std::string header_bytes_;             // The encoded fields other than `data`.
  std::vector<absl::string_view> pieces_;
  uint64_t data_size_ = 0;
  v1::GetFrame header_;
  std::string flat_data_;                // `data` on the fallback path.
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_GET_FRAME_PARSER_H_
