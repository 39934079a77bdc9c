// FrameParser walks PutFrame and GetFrame wire bytes by hand (the daemon's Put path and
// the client's Get path use it to avoid copying data), falling back to protobuf where
// its walker stops. Differential check against protobuf: both accept the same bytes,
// and the header plus the data pieces are exactly protobuf's message. The first
// input byte chooses where the bytes are cut into two slices (gRPC delivers messages in
// slices of any size).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "client/frame_parser.h"
#include "kvtier/v1/kvtier.pb.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "frame_splitter_fuzz: %s\n", what);
  abort();
}

template <typename Frame>
void Check(const std::string& bytes, size_t cut) {
  grpc::Slice slices[2] = {grpc::Slice(bytes.substr(0, cut)), grpc::Slice(bytes.substr(cut))};
  grpc::ByteBuffer buffer(slices, 2);
  kvtier::FrameParser<Frame> parser;
  const bool ours = parser.Parse(buffer);
  Frame reference;
  const bool theirs = reference.ParseFromString(bytes);
  if (ours != theirs) Fail(ours ? "accepted bytes protobuf rejects" : "rejected bytes protobuf accepts");
  if (!ours) return;
  if (!parser.header().data().empty()) Fail("the header kept data");
  std::string data;
  for (absl::string_view piece : parser.pieces()) {
    if (piece.empty()) Fail("an empty piece");
    data.append(piece.data(), piece.size());
  }
  if (data.size() != parser.data_size()) Fail("data_size disagrees with the pieces");
  Frame whole = parser.header();
  whole.set_data(data);
  // Protobuf keeps the last of repeated singular fields; so must the walker.
  if (whole.SerializeAsString() != reference.SerializeAsString()) {
    Fail("header + data differ from protobuf's parse");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  const size_t cut = bytes.empty() ? 0 : data[0] % (bytes.size() + 1);
  Check<kvtier::v1::PutFrame>(bytes, cut);
  Check<kvtier::v1::GetFrame>(bytes, cut);
  return 0;
}
