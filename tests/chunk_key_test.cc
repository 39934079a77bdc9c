// Pins the chunk-key scheme and the layout encoding that every client shares
// (normative text: the header comment of proto/kvtier/v1/kvtier.proto).
//
// The normative vectors (keys, namespace ids, canonical encodings) are read from
// tests/vectors/chunk_keys.json, the one file every client's tests load (the Python
// package's test_keys.py reads the same file); how they were computed, independently of
// this code, is written there. A change to any of them breaks every client's cache hits:
// do not "fix" the vectors, fix the code.
#include "storage/chunk_key.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "storage/layout_spec.h"

namespace kvtier {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

// tests/vectors/chunk_keys.json, parsed once. A missing or malformed file fails the
// test that asks for it.
const Struct& Vectors() {
  static const Struct* vectors = [] {
    auto* v = new Struct;
    std::ifstream in(KVTIER_VECTORS_FILE);
    std::stringstream text;
    text << in.rdbuf();
    const auto status = google::protobuf::util::JsonStringToMessage(text.str(), v);
    if (!in || !status.ok()) {
      ADD_FAILURE() << "cannot read " << KVTIER_VECTORS_FILE << ": " << status.ToString();
    }
    return v;
  }();
  return *vectors;
}

const ListValue& List(const Struct& s, const std::string& field) {
  static const ListValue* empty = new ListValue;
  auto it = s.fields().find(field);
  if (it == s.fields().end() || !it->second.has_list_value()) {
    ADD_FAILURE() << "vectors: no list '" << field << "'";
    return *empty;
  }
  return it->second.list_value();
}

const Value& Field(const Struct& s, const std::string& field) {
  static const Value* null = new Value;
  auto it = s.fields().find(field);
  if (it == s.fields().end()) {
    ADD_FAILURE() << "vectors: no field '" << field << "'";
    return *null;
  }
  return it->second;
}

std::string Str(const Struct& s, const std::string& field) {
  return Field(s, field).string_value();
}
uint32_t U32(const Struct& s, const std::string& field) {
  return static_cast<uint32_t>(Field(s, field).number_value());
}
uint64_t Hex64(const Struct& s, const std::string& field) {
  uint64_t v = 0;
  EXPECT_TRUE(absl::SimpleHexAtoi(Str(s, field), &v)) << field;
  return v;
}
std::vector<uint32_t> Tokens(const Struct& s) {
  std::vector<uint32_t> out;
  for (const Value& t : List(s, "tokens").values()) {
    out.push_back(static_cast<uint32_t>(t.number_value()));
  }
  return out;
}

LayoutSpec LayoutFromVector(const Struct& l) {
  LayoutSpec spec;
  spec.model_id = Str(l, "model_id");
  spec.model_revision = Str(l, "model_revision");
  spec.dtype = static_cast<LayoutSpec::DType>(U32(l, "dtype"));
  spec.num_layers = U32(l, "num_layers");
  spec.num_kv_heads = U32(l, "num_kv_heads");
  spec.head_dim = U32(l, "head_dim");
  spec.tokens_per_chunk = U32(l, "tokens_per_chunk");
  spec.tp_world_size = U32(l, "tp_world_size");
  spec.tp_rank = U32(l, "tp_rank");
  spec.key_position = static_cast<LayoutSpec::KeyPosition>(U32(l, "key_position"));
  return spec;
}

// The vector layout named `name`.
const Struct* VectorLayout(const std::string& name) {
  for (const Value& l : List(Vectors(), "layouts").values()) {
    if (Str(l.struct_value(), "name") == name) return &l.struct_value();
  }
  ADD_FAILURE() << "vectors: no layout '" << name << "'";
  return nullptr;
}

ChunkKey Key(absl::string_view hex) {
  auto k = ChunkKey::FromHex(hex);
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? *k : ChunkKey{};
}

LayoutSpec LlamaLayout() {
  LayoutSpec l;
  l.model_id = "meta-llama/Llama-3.1-8B";
  l.model_revision = "main";
  l.dtype = LayoutSpec::DType::kBFloat16;
  l.num_layers = 32;
  l.num_kv_heads = 8;
  l.head_dim = 128;
  l.tokens_per_chunk = 256;
  l.tp_world_size = 1;
  l.tp_rank = 0;
  l.key_position = LayoutSpec::KeyPosition::kPostRope;
  return l;
}

LayoutSpec QwenShardLayout() {
  LayoutSpec l;
  // UTF-8 for "Ünïcode"; split literals so the hex escapes end where they should.
  l.model_id =
      "Qwen/Qwen2.5-72B-Instruct-\xc3\x9c"
      "n\xc3\xaf"
      "code";
  l.model_revision = "";
  l.dtype = LayoutSpec::DType::kFloat8E4M3;
  l.num_layers = 80;
  l.num_kv_heads = 2;
  l.head_dim = 128;
  l.tokens_per_chunk = 16;
  l.tp_world_size = 4;
  l.tp_rank = 3;
  l.key_position = LayoutSpec::KeyPosition::kPreRope;
  return l;
}

LayoutSpec TinyLayout() {
  LayoutSpec l;
  l.model_id = "tiny";
  l.model_revision = "r1";
  l.dtype = LayoutSpec::DType::kFloat16;
  l.num_layers = 2;
  l.num_kv_heads = 1;
  l.head_dim = 8;
  l.tokens_per_chunk = 4;
  l.tp_world_size = 1;
  l.tp_rank = 0;
  l.key_position = LayoutSpec::KeyPosition::kPostRope;
  return l;
}

// clang-format off
constexpr char kTinyEncodingHex[] =
    "6b76746965722d6c61796f75742d7631"  // "kvtier-layout-v1"
    "04000000" "74696e79"               // le32(4) "tiny"
    "02000000" "7231"                   // le32(2) "r1"
    "01000000"                          // dtype FLOAT16
    "02000000" "01000000" "08000000"    // num_layers, num_kv_heads, head_dim
    "04000000"                          // tokens_per_chunk
    "01000000" "00000000"               // tp_world_size, tp_rank
    "01";                               // key_position POST_ROPE
// clang-format on

// ---------------------------------------------------------------------------------
// Key scheme vectors.

TEST(ChunkKeyVectors, FirstChunkKeys) {
  const ListValue& cases = List(Vectors(), "first_chunk_keys");
  ASSERT_GT(cases.values_size(), 0);
  for (const Value& c : cases.values()) {
    const Struct& v = c.struct_value();
    EXPECT_EQ(FirstChunkKey(Hex64(v, "namespace_id"), Tokens(v)).ToHex(), Str(v, "key"));
  }
  // hi/lo are XXH128's halves: the wire form is hi big-endian then lo big-endian.
  const Struct& v = cases.values(cases.values_size() - 1).struct_value();
  const ChunkKey k = FirstChunkKey(Hex64(v, "namespace_id"), Tokens(v));
  EXPECT_EQ(absl::StrCat(absl::Hex(k.hi, absl::kZeroPad16), absl::Hex(k.lo, absl::kZeroPad16)),
            Str(v, "key"));
}

TEST(ChunkKeyVectors, NextChunkKeysChainOnThePreviousKeysWireBytes) {
  const ListValue& cases = List(Vectors(), "next_chunk_keys");
  ASSERT_GT(cases.values_size(), 0);
  for (const Value& c : cases.values()) {
    const Struct& v = c.struct_value();
    EXPECT_EQ(NextChunkKey(Key(Str(v, "prev")), Tokens(v)).ToHex(), Str(v, "key"));
  }
}

TEST(ChunkKeyVectors, ComputeChunkKeysOverRealNamespaces) {
  const ListValue& cases = List(Vectors(), "chunk_keys");
  ASSERT_GT(cases.values_size(), 0);
  for (const Value& c : cases.values()) {
    const Struct& v = c.struct_value();
    const Struct* layout = VectorLayout(Str(v, "layout"));
    ASSERT_NE(layout, nullptr);
    const LayoutSpec spec = LayoutFromVector(*layout);
    // A case may chunk the tokens differently from its layout (to keep it short).
    const uint32_t per_chunk = v.fields().contains("tokens_per_chunk")
                                   ? U32(v, "tokens_per_chunk")
                                   : spec.tokens_per_chunk;
    const std::vector<ChunkKey> keys =
        ComputeChunkKeys(spec.NamespaceId(), Tokens(v), per_chunk);
    const ListValue& want = List(v, "keys");
    ASSERT_EQ(keys.size(), static_cast<size_t>(want.values_size())) << Str(v, "layout");
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(keys[i].ToHex(), want.values(static_cast<int>(i)).string_value()) << i;
    }
  }
}

TEST(ChunkKey, ComputeChunkKeysAgreesWithFirstAndNext) {
  std::vector<uint32_t> tokens(64);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i * 2654435761u;
  const uint64_t ns = 0xfeedfacecafebeefull;
  const auto keys = ComputeChunkKeys(ns, tokens, 8);
  ASSERT_EQ(keys.size(), 8u);
  const absl::Span<const uint32_t> all(tokens);
  ChunkKey expect = FirstChunkKey(ns, all.subspan(0, 8));
  EXPECT_EQ(keys[0], expect);
  for (size_t i = 1; i < keys.size(); ++i) {
    expect = NextChunkKey(expect, all.subspan(8 * i, 8));
    EXPECT_EQ(keys[i], expect) << "chunk " << i;
  }
}

TEST(ChunkKey, ComputeChunkKeysEdgeCases) {
  const std::vector<uint32_t> three = {1, 2, 3};
  EXPECT_TRUE(ComputeChunkKeys(1, three, 4).empty()) << "only a partial chunk";
  EXPECT_TRUE(ComputeChunkKeys(1, {}, 4).empty());
  EXPECT_TRUE(ComputeChunkKeys(1, three, 0).empty()) << "tokens_per_chunk 0 is no chunks";
  const auto one_each = ComputeChunkKeys(1, three, 1);
  ASSERT_EQ(one_each.size(), 3u);
  EXPECT_EQ(one_each[0], FirstChunkKey(1, absl::MakeConstSpan(three).subspan(0, 1)));
}

TEST(ChunkKey, KeysArePrefixChained) {
  // Same chunk tokens after different prefixes give different keys; a shared prefix
  // gives the same leading keys.
  const std::vector<uint32_t> a = {1, 2, 3, 4, 9, 9, 9, 9};
  const std::vector<uint32_t> b = {1, 2, 3, 5, 9, 9, 9, 9};
  const std::vector<uint32_t> c = {1, 2, 3, 4, 9, 9, 9, 8};
  const auto ka = ComputeChunkKeys(7, a, 4);
  const auto kb = ComputeChunkKeys(7, b, 4);
  const auto kc = ComputeChunkKeys(7, c, 4);
  EXPECT_NE(ka[1], kb[1]);
  EXPECT_EQ(ka[0], kc[0]);
  EXPECT_NE(ka[1], kc[1]);
  // And namespaces separate keys of identical tokens.
  EXPECT_NE(ComputeChunkKeys(8, a, 4)[0], ka[0]);
}

// ---------------------------------------------------------------------------------
// Wire forms.

TEST(ChunkKey, BytesRoundTrip) {
  const ChunkKey k{0x0011223344556677ull, 0x8899aabbccddeeffull};
  const auto bytes = k.ToBytes();
  const std::vector<uint8_t> expect = {0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77,
                                       0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff};
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), expect);
  const std::string s = k.ToByteString();
  ASSERT_EQ(s.size(), ChunkKey::kWireBytes);
  EXPECT_EQ(s, std::string(reinterpret_cast<const char*>(expect.data()), expect.size()));
  auto back = ChunkKey::FromBytes(s);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, k);
}

TEST(ChunkKey, HexRoundTrip) {
  const ChunkKey k{0x0011223344556677ull, 0x8899aabbccddeeffull};
  EXPECT_EQ(k.ToHex(), "00112233445566778899aabbccddeeff");
  auto back = ChunkKey::FromHex(k.ToHex());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, k);
  // Upper-case hex is accepted.
  auto upper = ChunkKey::FromHex("00112233445566778899AABBCCDDEEFF");
  ASSERT_TRUE(upper.ok()) << upper.status();
  EXPECT_EQ(*upper, k);
  // Hex and bytes agree.
  EXPECT_EQ(absl::BytesToHexString(k.ToByteString()), k.ToHex());
}

TEST(ChunkKey, FromBytesRejectsWrongLengths) {
  for (size_t n : {0, 1, 15, 17, 32}) {
    const std::string bytes(n, 'x');
    auto k = ChunkKey::FromBytes(bytes);
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument) << n;
    if (!k.ok()) {
      EXPECT_TRUE(absl::StrContains(k.status().message(), "16 bytes")) << k.status();
    }
  }
}

TEST(ChunkKey, FromHexRejectsBadInput) {
  for (absl::string_view bad : {
           absl::string_view(""),
           absl::string_view("00112233445566778899aabbccddeef"),    // 31 digits
           absl::string_view("00112233445566778899aabbccddeeff0"),  // 33 digits
           absl::string_view("00112233445566778899aabbccddeefg"),   // 'g'
           absl::string_view("0x112233445566778899aabbccddeeff"),   // "0x" prefix
           absl::string_view("00112233445566778899aabbccddee f"),   // space
       }) {
    auto k = ChunkKey::FromHex(bad);
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
}

TEST(ChunkKey, EqualityAndHashing) {
  const ChunkKey a{1, 2}, b{1, 2}, c{2, 1};
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  absl::flat_hash_set<ChunkKey> set = {a, b, c};
  EXPECT_EQ(set.size(), 2u);
}

// ---------------------------------------------------------------------------------
// Layouts.

TEST(LayoutSpecVectors, NamespaceIdsEncodingsAndSizes) {
  const ListValue& layouts = List(Vectors(), "layouts");
  ASSERT_GT(layouts.values_size(), 0);
  for (const Value& l : layouts.values()) {
    const Struct& v = l.struct_value();
    const LayoutSpec spec = LayoutFromVector(v);
    SCOPED_TRACE(Str(v, "name"));
    EXPECT_TRUE(spec.Validate().ok()) << spec.Validate();
    EXPECT_EQ(absl::BytesToHexString(spec.CanonicalEncoding()), Str(v, "canonical_encoding_hex"));
    EXPECT_EQ(spec.NamespaceId(), Hex64(v, "namespace_id"));
    EXPECT_EQ(spec.ChunkBytes(), static_cast<uint64_t>(Field(v, "chunk_bytes").number_value()));
    EXPECT_EQ(spec.LayerBytes(), static_cast<uint64_t>(Field(v, "layer_bytes").number_value()));
  }
  // The hand-built layouts below are the vector file's.
  EXPECT_EQ(LlamaLayout().NamespaceId(), Hex64(*VectorLayout("llama"), "namespace_id"));
  EXPECT_EQ(QwenShardLayout().NamespaceId(), Hex64(*VectorLayout("qwen_shard"), "namespace_id"));
  EXPECT_EQ(absl::BytesToHexString(TinyLayout().CanonicalEncoding()), kTinyEncodingHex);
  EXPECT_EQ(TinyLayout().NamespaceId(), Hex64(*VectorLayout("tiny"), "namespace_id"));
}

TEST(LayoutSpec, EveryFieldChangesTheNamespace) {
  const LayoutSpec base = LlamaLayout();
  std::vector<LayoutSpec> variants(10, base);
  variants[0].model_id = "meta-llama/Llama-3.1-70B";
  variants[1].model_revision = "main2";
  variants[2].dtype = LayoutSpec::DType::kFloat16;
  variants[3].num_layers = 33;
  variants[4].num_kv_heads = 4;
  variants[5].head_dim = 64;
  variants[6].tokens_per_chunk = 128;
  variants[7].tp_world_size = 2;
  variants[8].key_position = LayoutSpec::KeyPosition::kPreRope;
  // Moving bytes between model_id and model_revision must not collide (the lengths
  // are part of the encoding).
  variants[9].model_id = "meta-llama/Llama-3.1-8Bm";
  variants[9].model_revision = "ain";
  absl::flat_hash_set<uint64_t> ids = {base.NamespaceId()};
  for (const LayoutSpec& v : variants) {
    EXPECT_TRUE(ids.insert(v.NamespaceId()).second) << v.model_id << "/" << v.model_revision;
  }
}

TEST(LayoutSpec, CanonicalEncodingRoundTrips) {
  for (const LayoutSpec& l : {LlamaLayout(), QwenShardLayout(), TinyLayout()}) {
    auto back = LayoutSpec::FromCanonicalEncoding(l.CanonicalEncoding());
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, l);
    EXPECT_EQ(back->NamespaceId(), l.NamespaceId());
  }
}

TEST(LayoutSpec, FromCanonicalEncodingRejectsDamagedInput) {
  const std::string good = TinyLayout().CanonicalEncoding();
  // Every truncation.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(LayoutSpec::FromCanonicalEncoding(good.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "truncated to " << n;
  }
  // Trailing garbage.
  EXPECT_EQ(LayoutSpec::FromCanonicalEncoding(good + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Another version's magic.
  std::string v2 = good;
  v2[15] = '2';
  EXPECT_EQ(LayoutSpec::FromCanonicalEncoding(v2).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A model_id length running past the end.
  std::string long_len = good;
  long_len[16] = static_cast<char>(0x7f);
  EXPECT_EQ(LayoutSpec::FromCanonicalEncoding(long_len).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LayoutSpec, ValidAcceptsGoodLayouts) {
  EXPECT_TRUE(LlamaLayout().Validate().ok()) << LlamaLayout().Validate();
  EXPECT_TRUE(QwenShardLayout().Validate().ok()) << QwenShardLayout().Validate();
  EXPECT_TRUE(TinyLayout().Validate().ok()) << TinyLayout().Validate();
  LayoutSpec max_id = TinyLayout();
  max_id.model_id.assign(LayoutSpec::kMaxModelIdBytes, 'm');
  max_id.model_revision.assign(LayoutSpec::kMaxModelIdBytes, 'r');
  EXPECT_TRUE(max_id.Validate().ok()) << max_id.Validate();
}

TEST(LayoutSpec, ValidateNamesTheBadField) {
  struct Case {
    const char* field;
    void (*spoil)(LayoutSpec&);
  };
  const Case cases[] = {
      {"model_id", [](LayoutSpec& l) { l.model_id.clear(); }},
      {"model_id", [](LayoutSpec& l) { l.model_id.assign(257, 'm'); }},
      {"model_revision", [](LayoutSpec& l) { l.model_revision.assign(257, 'r'); }},
      {"dtype", [](LayoutSpec& l) { l.dtype = LayoutSpec::DType::kUnspecified; }},
      {"dtype", [](LayoutSpec& l) { l.dtype = static_cast<LayoutSpec::DType>(6); }},
      {"num_layers", [](LayoutSpec& l) { l.num_layers = 0; }},
      {"num_kv_heads", [](LayoutSpec& l) { l.num_kv_heads = 0; }},
      {"head_dim", [](LayoutSpec& l) { l.head_dim = 0; }},
      {"tokens_per_chunk", [](LayoutSpec& l) { l.tokens_per_chunk = 0; }},
      {"tp_world_size", [](LayoutSpec& l) { l.tp_world_size = 0; }},
      {"tp_rank", [](LayoutSpec& l) { l.tp_rank = 1; }},
      {"tp_rank", [](LayoutSpec& l) { l.tp_world_size = 4, l.tp_rank = 4; }},
      {"key_position",
       [](LayoutSpec& l) { l.key_position = LayoutSpec::KeyPosition::kUnspecified; }},
      {"key_position",
       [](LayoutSpec& l) { l.key_position = static_cast<LayoutSpec::KeyPosition>(3); }},
      // 2^32-1 on every axis overflows 64 bits.
      {"num_layers",
       [](LayoutSpec& l) {
         l.num_layers = l.num_kv_heads = l.head_dim = l.tokens_per_chunk = 0xffffffffu;
       }},
  };
  for (const Case& c : cases) {
    LayoutSpec l = LlamaLayout();
    c.spoil(l);
    const absl::Status s = l.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("layout.", c.field)))
        << "expected the message to name layout." << c.field << ", got: " << s;
  }
}

TEST(LayoutSpec, ChunkBytes) {
  // 32 layers * 2 (K, V) * 8 heads * 128 dims * 256 tokens * 2 bytes = 32 MiB.
  EXPECT_EQ(LlamaLayout().ChunkBytes(), 32ull << 20);
  EXPECT_EQ(LlamaLayout().LayerBytes(), 1ull << 20);
  // 80 * 2 * 2 * 128 * 16 * 1 (fp8).
  EXPECT_EQ(QwenShardLayout().ChunkBytes(), 655360u);
  // 2 * 2 * 1 * 8 * 4 * 2.
  EXPECT_EQ(TinyLayout().ChunkBytes(), 256u);
  EXPECT_EQ(TinyLayout().LayerBytes(), 128u);

  LayoutSpec f32 = TinyLayout();
  f32.dtype = LayoutSpec::DType::kFloat32;
  EXPECT_EQ(f32.ChunkBytes(), 512u);
  // Products past 32 bits do not wrap.
  LayoutSpec big = LlamaLayout();
  big.tokens_per_chunk = 1u << 20;
  EXPECT_EQ(big.ChunkBytes(), (32ull << 20) * 4096);

  EXPECT_EQ(LayoutSpec::DTypeBytes(LayoutSpec::DType::kFloat16), 2u);
  EXPECT_EQ(LayoutSpec::DTypeBytes(LayoutSpec::DType::kBFloat16), 2u);
  EXPECT_EQ(LayoutSpec::DTypeBytes(LayoutSpec::DType::kFloat32), 4u);
  EXPECT_EQ(LayoutSpec::DTypeBytes(LayoutSpec::DType::kFloat8E4M3), 1u);
  EXPECT_EQ(LayoutSpec::DTypeBytes(LayoutSpec::DType::kFloat8E5M2), 1u);
  EXPECT_EQ(LayoutSpec::DTypeBytes(LayoutSpec::DType::kUnspecified), 0u);
}

}  // namespace
}  // namespace kvtier
