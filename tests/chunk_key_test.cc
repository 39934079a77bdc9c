// Pins the chunk-key scheme and the layout encoding that every client shares
// (normative text: the header comment of proto/kvtier/v1/kvtier.proto).
//
// The expected values below were computed independently of this C++ code, with the
// Python xxhash binding (python3-xxhash 3.0.0 over libxxhash 0.8.1) straight from the
// byte encoding written in the proto:
//
//   import struct, xxhash
//   le32 = lambda x: struct.pack('<I', x)
//   le64 = lambda x: struct.pack('<Q', x)
//   key0 = lambda ns, t: xxhash.xxh3_128_digest(le64(ns) + b''.join(map(le32, t)))
//   keyn = lambda prev, t: xxhash.xxh3_128_digest(prev + b''.join(map(le32, t)))
//   def layout(model, rev, dtype, L, H, D, C, W, R, kp):
//       m, r = model.encode('utf-8'), rev.encode('utf-8')
//       return (b'kvtier-layout-v1' + le32(len(m)) + m + le32(len(r)) + r +
//               b''.join(le32(v) for v in (dtype, L, H, D, C, W, R)) + bytes([kp]))
//   ns = lambda enc: '%016x' % xxhash.xxh3_64_intdigest(enc)
//
//   key0(0, []).hex()                                 # 2c0a8a99dc147d5445c3b49d035665b2
//   k = key0(0x0123456789abcdef, [1, 2, 3, 4])        # c4217189edd4662a479679955a6efdfe
//   keyn(k, [5, 6, 7, 8]).hex()                       # 77bd2af594cf00a2bc007dfeb479e85c
//   keyn(k, [0, 0xffffffff]).hex()                    # 3c853a5ee0e73ccf4dd5e4c8e27b424e
//   A = layout("meta-llama/Llama-3.1-8B", "main", 2, 32, 8, 128, 256, 1, 0, 1)
//   ns(A)                                             # a1600d0cd58ae4ac
//   B = layout("Qwen/Qwen2.5-72B-Instruct-\u00dcn\u00efcode", "", 4, 80, 2, 128, 16, 4, 3, 2)
//   ns(B)                                             # 4bfb2616b561aa1b
//   C = layout("tiny", "r1", 1, 2, 1, 8, 4, 1, 0, 1)
//   C.hex(), ns(C)                                    # see kTinyEncodingHex, 9c83ad2e88bb5a2a
//   toks = [0, 1, 2, 3, 128000, 4294967295, 7, 42, 99, 100]
//   k0 = key0(int(ns(C), 16), toks[0:4])              # ffc13ec1b1ee5def0883e2dfe29091fb
//   keyn(k0, toks[4:8])                               # 945f265d86988c5a6d20f0337ef7d848
//
// A change to any of these values breaks every client's cache hits: do not "fix" the
// constants, fix the code.
#include "storage/chunk_key.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "storage/layout_spec.h"

namespace kvtier {
namespace {

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

TEST(ChunkKeyVectors, FirstChunkKeyOfNoTokensHashesTheNamespaceAlone) {
  EXPECT_EQ(FirstChunkKey(0, {}).ToHex(), "2c0a8a99dc147d5445c3b49d035665b2");
}

TEST(ChunkKeyVectors, FirstChunkKey) {
  const std::vector<uint32_t> tokens = {1, 2, 3, 4};
  const ChunkKey k = FirstChunkKey(0x0123456789abcdefull, tokens);
  EXPECT_EQ(k.ToHex(), "c4217189edd4662a479679955a6efdfe");
  // hi/lo are XXH128's halves: the wire form is hi big-endian then lo big-endian.
  EXPECT_EQ(k.hi, 0xc4217189edd4662aull);
  EXPECT_EQ(k.lo, 0x479679955a6efdfeull);
}

TEST(ChunkKeyVectors, NextChunkKeyChainsOnThePreviousKeysWireBytes) {
  const ChunkKey k0 = Key("c4217189edd4662a479679955a6efdfe");
  const std::vector<uint32_t> next = {5, 6, 7, 8};
  EXPECT_EQ(NextChunkKey(k0, next).ToHex(), "77bd2af594cf00a2bc007dfeb479e85c");
  // Token ids are unsigned 32-bit little-endian, including the extremes.
  const std::vector<uint32_t> extremes = {0, 0xffffffffu};
  EXPECT_EQ(NextChunkKey(k0, extremes).ToHex(), "3c853a5ee0e73ccf4dd5e4c8e27b424e");
}

TEST(ChunkKeyVectors, ComputeChunkKeysOverARealNamespace) {
  const LayoutSpec tiny = TinyLayout();
  ASSERT_EQ(tiny.NamespaceId(), 0x9c83ad2e88bb5a2aull);
  const std::vector<uint32_t> tokens = {0, 1, 2, 3, 128000, 4294967295u, 7, 42, 99, 100};
  const std::vector<ChunkKey> keys =
      ComputeChunkKeys(tiny.NamespaceId(), tokens, tiny.tokens_per_chunk);
  // Ten tokens, four per chunk: two keys; the partial last chunk (99, 100) gets none.
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0].ToHex(), "ffc13ec1b1ee5def0883e2dfe29091fb");
  EXPECT_EQ(keys[1].ToHex(), "945f265d86988c5a6d20f0337ef7d848");
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

TEST(LayoutSpecVectors, NamespaceIds) {
  EXPECT_EQ(LlamaLayout().NamespaceId(), 0xa1600d0cd58ae4acull);
  EXPECT_EQ(QwenShardLayout().NamespaceId(), 0x4bfb2616b561aa1bull);
  EXPECT_EQ(TinyLayout().NamespaceId(), 0x9c83ad2e88bb5a2aull);
}

TEST(LayoutSpecVectors, CanonicalEncodingBytes) {
  EXPECT_EQ(absl::BytesToHexString(TinyLayout().CanonicalEncoding()), kTinyEncodingHex);
  EXPECT_EQ(absl::BytesToHexString(LlamaLayout().CanonicalEncoding()),
            "6b76746965722d6c61796f75742d7631170000006d6574612d6c6c616d612f4c6c616d612d"
            "332e312d3842040000006d61696e020000002000000008000000800000000001000001000000"
            "0000000001");
  EXPECT_EQ(QwenShardLayout().CanonicalEncoding().size(), 88u);
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
