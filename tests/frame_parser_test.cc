// FrameParser: any valid encoding of a GetFrame or PutFrame, cut into slices anywhere,
// gives the same header and data as protobuf's own parse; broken messages fail.
#include "client/frame_parser.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

namespace kvtier {
namespace {

// `bytes` as a ByteBuffer of slices cut at `cuts` (ascending offsets).
grpc::ByteBuffer Cut(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    slices.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

template <typename Parser>
std::string Joined(const Parser& p) {
  std::string s;
  for (absl::string_view piece : p.pieces()) {
    EXPECT_FALSE(piece.empty());
    s.append(piece.data(), piece.size());
  }
  EXPECT_EQ(s.size(), p.data_size());
  return s;
}

v1::GetFrame Sample(size_t data_bytes) {
  v1::GetFrame f;
  f.set_key_index(3);
  f.set_found(true);
  f.set_offset(1u << 22);
  f.set_last(true);
  f.set_total_bytes(uint64_t{5} << 30);
  f.set_crc32c(0xdeadbeef);
  f.set_token_count(256);
  f.set_tier(v1::TIER_RAM);
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  f.set_data(data);
  return f;
}

void ExpectParsesAs(const GetFrameParser& p, const v1::GetFrame& want) {
  v1::GetFrame header = want;
  header.clear_data();
  EXPECT_EQ(p.header().SerializeAsString(), header.SerializeAsString());
  EXPECT_TRUE(p.header().data().empty());
  EXPECT_EQ(Joined(p), want.data());
}

TEST(GetFrameParser, ProtobufEncodingCutEverywhere) {
  const v1::GetFrame want = Sample(100);
  const std::string bytes = want.SerializeAsString();
  GetFrameParser p;
  // One slice, then two slices cut at every offset (inside tags, varints, fixed32, data).
  ASSERT_TRUE(p.Parse(Cut(bytes, {})));
  ExpectParsesAs(p, want);
  for (size_t c = 0; c <= bytes.size(); ++c) {
    ASSERT_TRUE(p.Parse(Cut(bytes, {c}))) << "cut " << c;
    ExpectParsesAs(p, want);
  }
  // Every byte its own slice.
  std::vector<size_t> all;
  for (size_t c = 1; c < bytes.size(); ++c) all.push_back(c);
  ASSERT_TRUE(p.Parse(Cut(bytes, all)));
  ExpectParsesAs(p, want);
}

TEST(GetFrameParser, DaemonLayoutHeaderThenDataLast) {
  // kvtierd sends every other field first, then data's tag and length, then the data.
  v1::GetFrame want = Sample(3000);
  v1::GetFrame head = want;
  head.clear_data();
  std::string bytes = head.SerializeAsString();
  bytes.push_back((4 << 3) | 2);
  bytes.append("\xb8\x17");  // 3000 as a varint.
  bytes.append(want.data());
  GetFrameParser p;
  ASSERT_TRUE(p.Parse(Cut(bytes, {bytes.size() - 3000, bytes.size() - 1000})));
  ExpectParsesAs(p, want);
  EXPECT_EQ(p.pieces().size(), 2u);  // Views of the slices, not a copy.
}

TEST(GetFrameParser, RandomFieldOrderUnknownFieldsAndRepeatedData) {
  std::mt19937_64 rng(5);
  const v1::GetFrame want = Sample(777);
  // Encode each field on its own, plus an unknown fixed64 (field 20) and an unknown
  // length-delimited field (21), and an earlier `data` that the last one overrides.
  std::vector<std::string> fields;
  const auto* descriptor = v1::GetFrame::descriptor();
  for (int n = 1; n <= 9; ++n) {
    v1::GetFrame only = want;  // Keep only field n.
    for (int m = 1; m <= 9; ++m) {
      if (m != n) only.GetReflection()->ClearField(&only, descriptor->FindFieldByNumber(m));
    }
    fields.push_back(only.SerializeAsString());
  }
  fields.push_back(std::string("\xa1\x01", 2) + std::string(8, '\x42'));  // 20, fixed64
  fields.push_back(std::string("\xaa\x01\x03xyz", 6));                    // 21, bytes
  for (int round = 0; round < 50; ++round) {
    std::shuffle(fields.begin(), fields.end(), rng);
    // data = "junk" first: the real data, later in any order, overrides it.
    std::string bytes = std::string("\x22\x04junk", 6);
    for (const std::string& f : fields) bytes += f;
    v1::GetFrame reference;
    ASSERT_TRUE(reference.ParseFromString(bytes));
    std::vector<size_t> cuts;
    for (size_t c = 1 + rng() % 7; c < bytes.size(); c += 1 + rng() % 97) cuts.push_back(c);
    GetFrameParser p;
    ASSERT_TRUE(p.Parse(Cut(bytes, cuts)));
    ExpectParsesAs(p, reference);
    EXPECT_EQ(Joined(p), want.data());
    // The unknown fields are kept in the header, as protobuf keeps them.
    v1::GetFrame ref_head = reference;
    ref_head.clear_data();
    EXPECT_EQ(p.header().SerializeAsString(), ref_head.SerializeAsString());
  }
}

TEST(GetFrameParser, GroupFallsBackToProtobuf) {
  const v1::GetFrame want = Sample(10);
  // An unknown group (field 30: start tag, a varint field 1 inside, end tag) first.
  std::string bytes = std::string("\xf3\x01\x08\x05\xf4\x01", 6) + want.SerializeAsString();
  v1::GetFrame reference;
  ASSERT_TRUE(reference.ParseFromString(bytes));
  GetFrameParser p;
  ASSERT_TRUE(p.Parse(Cut(bytes, {3, 9})));
  ExpectParsesAs(p, reference);
}

TEST(GetFrameParser, BrokenMessagesFail) {
  const std::string bytes = Sample(50).SerializeAsString();
  GetFrameParser p;
  for (size_t n = 1; n < bytes.size(); ++n) {  // Every truncation but the empty message.
    const std::string cut = bytes.substr(0, n);
    v1::GetFrame reference;
    if (reference.ParseFromString(cut)) continue;  // Cut on a field boundary: valid.
    EXPECT_FALSE(p.Parse(Cut(cut, {n / 2}))) << n;
  }
  // Field number 0 is invalid.
  EXPECT_FALSE(p.Parse(Cut(std::string("\x00\x01", 2), {})));
  // An empty message is a valid GetFrame with every field at its default.
  ASSERT_TRUE(p.Parse(Cut("", {})));
  EXPECT_EQ(p.data_size(), 0u);
  EXPECT_TRUE(p.pieces().empty());
}

// The daemon parses Put frames with the same walker: every field but data (field 4 here
// too), including the RegionRef message, comes through protobuf; data stays in views.
TEST(PutFrameParser, EveryCutGivesProtobufsParse) {
  v1::PutFrame want;
  want.set_namespace_id(0x1122334455667788ull);
  want.set_key(std::string(16, '\x5a'));
  want.set_offset(4096);
  want.set_crc32c(0xfeedface);
  want.set_token_count(17);
  want.mutable_region()->set_region_id(9);
  want.mutable_region()->set_length(12345);
  std::string data(600, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 13 + 5);
  want.set_data(data);
  const std::string bytes = want.SerializeAsString();
  PutFrameParser p;
  for (size_t c = 1; c < bytes.size(); c += 7) {
    ASSERT_TRUE(p.Parse(Cut(bytes, {c})));
    v1::PutFrame head = want;
    head.clear_data();
    EXPECT_EQ(p.header().SerializeAsString(), head.SerializeAsString()) << c;
    EXPECT_EQ(Joined(p), data) << c;
  }
  // A message gRPC hands over with no slices at all is the empty PutFrame.
  ASSERT_TRUE(p.Parse(grpc::ByteBuffer()));
  EXPECT_EQ(p.data_size(), 0u);
  EXPECT_EQ(p.header().namespace_id(), 0u);
  // A truncated one is not a PutFrame.
  EXPECT_FALSE(p.Parse(Cut(bytes.substr(0, bytes.size() - 1), {})));
}

}  // namespace
}  // namespace kvtier
