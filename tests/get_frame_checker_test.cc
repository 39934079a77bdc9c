// GetFrameChecker: the streams kvtier.proto allows pass, in both orders; each way a
// daemon could break the protocol is caught (Internal) before the caller sees the
// frame, and a whole chunk whose bytes do not give its CRC32C is DataLoss.
#include "client/get_frame_checker.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <optional>
#include <string>
#include <vector>

#include "storage/crc32c.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::PatternBytes;

// One frame as the daemon would send it, with its data.
struct F {
  v1::GetFrame header;
  std::string data;
};

constexpr uint64_t kLayer = 64;  // Bytes per layer.
constexpr uint32_t kLayers = 3;

// The chunk of key i: kLayers layers of kLayer bytes.
std::string Chunk(uint32_t i) { return PatternBytes(i + 1, kLayer * kLayers); }

F Absent(uint32_t key, uint32_t layer = 0) {
  F f;
  f.header.set_key_index(key);
  f.header.set_found(false);
  f.header.set_last(true);
  f.header.set_layer(layer);
  return f;
}

// The frames of bytes [begin, end) of `chunk`, `frame` bytes each, with the first
// frame's metadata.
void AppendPiece(std::vector<F>& out, uint32_t key, const std::string& chunk, uint64_t begin,
                 uint64_t end, uint64_t frame, std::optional<uint32_t> layer) {
  for (uint64_t off = begin; off < end; off += frame) {
    F f;
    f.header.set_key_index(key);
    f.header.set_found(true);
    f.header.set_offset(off - begin);
    if (layer) f.header.set_layer(*layer);
    if (off == begin) {
      f.header.set_total_bytes(end - begin);
      f.header.set_crc32c(crc32c::Value(chunk));
      f.header.set_tier(v1::TIER_RAM);
    }
    f.data = chunk.substr(off, std::min(frame, end - off));
    f.header.set_last(off + frame >= end);
    out.push_back(std::move(f));
  }
}

// A layer-major stream of layers [first, end) of keys `found` (others absent).
std::vector<F> LayerMajor(uint32_t nkeys, const std::vector<bool>& found, uint32_t first,
                          uint32_t end) {
  std::vector<F> out;
  for (uint32_t l = first; l < end; ++l) {
    for (uint32_t k = 0; k < nkeys; ++k) {
      if (!found[k]) {
        if (l == first) out.push_back(Absent(k, l));
        continue;
      }
      AppendPiece(out, k, Chunk(k), l * kLayer, (l + 1) * kLayer, 24, l);
    }
  }
  return out;
}

class CheckerTest : public ::testing::Test {
 protected:
  CheckerTest() {
    for (uint32_t i = 0; i < 4; ++i) keys_.push_back(KeyOf(i));
  }
  // Feeds `frames`; returns the first non-Ok status (Check's, or Finish's).
  absl::Status Run(GetFrameChecker& c, const std::vector<F>& frames) {
    for (const F& f : frames) {
      absl::string_view d(f.data);
      absl::Status s = c.Check(f.header, {&d, 1}, f.data.size());
      if (!s.ok()) return s;
    }
    return c.Finish();
  }
  absl::Status RunLayerMajor(const std::vector<F>& frames,
                             std::optional<std::pair<uint32_t, uint32_t>> range = {}) {
    GetFrameChecker c(keys_, /*layer_major=*/true,
                      range ? std::optional<uint32_t>(range->first) : std::nullopt,
                      range ? std::optional<uint32_t>(range->second) : std::nullopt);
    return Run(c, frames);
  }
  std::vector<ChunkKey> keys_;
};

TEST_F(CheckerTest, ChunkMajorStreamPassesAndCorruptChunkIsDataLoss) {
  std::vector<F> frames;
  AppendPiece(frames, 0, Chunk(0), 0, kLayer * kLayers, 50, std::nullopt);
  frames.push_back(Absent(1));
  AppendPiece(frames, 2, Chunk(2), 0, kLayer * kLayers, 50, std::nullopt);
  frames.push_back(Absent(3));
  GetFrameChecker ok(keys_, false, std::nullopt, std::nullopt);
  EXPECT_TRUE(Run(ok, frames).ok());

  frames[1].data[3] ^= 1;
  GetFrameChecker bad(keys_, false, std::nullopt, std::nullopt);
  EXPECT_EQ(Run(bad, frames).code(), absl::StatusCode::kDataLoss);

  std::vector<F> skipped(frames.begin() + 4, frames.end());  // Key 0 never answered.
  GetFrameChecker order(keys_, false, std::nullopt, std::nullopt);
  EXPECT_EQ(Run(order, skipped).code(), absl::StatusCode::kInternal);
}

TEST_F(CheckerTest, LayerMajorStreamsThatFollowTheProtocolPass) {
  EXPECT_TRUE(RunLayerMajor(LayerMajor(4, {true, false, true, true}, 0, kLayers)).ok());
  EXPECT_TRUE(RunLayerMajor(LayerMajor(4, {true, true, true, true}, 0, kLayers)).ok());
  EXPECT_TRUE(RunLayerMajor(LayerMajor(4, {false, false, false, false}, 0, 1)).ok());
  EXPECT_TRUE(RunLayerMajor(LayerMajor(4, {false, true, false, true}, 1, 3), {{1, 3}}).ok());
}

TEST_F(CheckerTest, LayerMajorCorruptWholeChunkIsDataLossAtTheEnd) {
  std::vector<F> frames = LayerMajor(4, {true, true, false, true}, 0, kLayers);
  frames[frames.size() - 2].data[0] ^= 1;  // In key 3's last piece.
  GetFrameChecker c(keys_, true, std::nullopt, std::nullopt);
  for (const F& f : frames) {
    absl::string_view d(f.data);
    ASSERT_TRUE(c.Check(f.header, {&d, 1}, f.data.size()).ok());
  }
  absl::Status s = c.Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("key_index 3"), std::string::npos) << s;

  // A stream that stops a layer early fails the CRC32C of every found chunk.
  std::vector<F> short_stream = LayerMajor(4, {true, true, false, true}, 0, kLayers - 1);
  EXPECT_EQ(RunLayerMajor(short_stream).code(), absl::StatusCode::kDataLoss);
  // With a layer range the missing pass is a protocol violation instead.
  std::vector<F> short_range = LayerMajor(4, {true, true, false, true}, 0, 2);
  EXPECT_EQ(RunLayerMajor(short_range, {{0, 3}}).code(), absl::StatusCode::kInternal);
}

// An explicit range of every layer is a whole chunk: its CRC32C is checked as when no
// range is given (it once turned the check off).
TEST_F(CheckerTest, ARangeOfEveryLayerIsCheckedAsAWholeChunk) {
  const GetFrameChecker::Shape shape{kLayer * kLayers, kLayer, kLayers};
  std::vector<F> layer_major = LayerMajor(4, {true, true, false, true}, 0, kLayers);
  layer_major[1].data[0] ^= 1;  // In key 0's first piece.
  GetFrameChecker lm(keys_, /*layer_major=*/true, 0, kLayers, /*verify_crc=*/true, shape);
  EXPECT_EQ(Run(lm, layer_major).code(), absl::StatusCode::kDataLoss);

  std::vector<F> chunk_major;
  AppendPiece(chunk_major, 0, Chunk(0), 0, kLayer * kLayers, 50, std::nullopt);
  for (uint32_t k = 1; k < 4; ++k) chunk_major.push_back(Absent(k));
  chunk_major[0].data[3] ^= 1;
  GetFrameChecker cm(keys_, /*layer_major=*/false, 0, kLayers, /*verify_crc=*/true, shape);
  EXPECT_EQ(Run(cm, chunk_major).code(), absl::StatusCode::kDataLoss);

  // A part of the layers has no CRC32C of its own to check.
  std::vector<F> part = LayerMajor(4, {true, true, false, true}, 1, kLayers);
  part[1].data[0] ^= 1;
  GetFrameChecker pm(keys_, /*layer_major=*/true, 1, kLayers, /*verify_crc=*/true,
                     GetFrameChecker::Shape{kLayer * (kLayers - 1), kLayer, kLayers});
  EXPECT_TRUE(Run(pm, part).ok());
}

TEST_F(CheckerTest, LayerMajorProtocolViolationsAreInternal) {
  const std::vector<bool> found = {true, false, true, true};
  auto violates = [&](std::vector<F> frames,
                      std::optional<std::pair<uint32_t, uint32_t>> range = {}) {
    absl::Status s = RunLayerMajor(frames, range);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("protocol violation"), std::string::npos) << s;
  };
  const std::vector<F> good = LayerMajor(4, found, 0, kLayers);
  const size_t piece_frames = 3;  // 64-byte pieces in 24-byte frames.
  const size_t pass0 = 3 * piece_frames + 1;

  // A later pass skips a found key (key 0's layer 1 pieces removed).
  std::vector<F> skip = good;
  skip.erase(skip.begin() + pass0, skip.begin() + pass0 + piece_frames);
  violates(skip);

  // A pass jumps a layer (every layer-1 piece removed).
  std::vector<F> jump = good;
  jump.erase(jump.begin() + pass0, jump.begin() + pass0 + 3 * piece_frames);
  violates(jump);

  // A key found in the first pass is answered absent in a later one.
  std::vector<F> flip = good;
  flip.erase(flip.begin() + pass0 + 1, flip.begin() + pass0 + piece_frames);
  flip[pass0] = Absent(0, 1);
  violates(flip);

  // The absent key shows up with bytes in a later pass.
  std::vector<F> ghost = good;
  std::vector<F> extra;
  AppendPiece(extra, 1, Chunk(1), kLayer, 2 * kLayer, 24, 1u);
  ghost.insert(ghost.begin() + pass0 + piece_frames, extra.begin(), extra.end());
  violates(ghost);

  // Keys out of order within a pass (key 2 before key 0 in layer 1).
  std::vector<F> swapped = good;
  std::rotate(swapped.begin() + pass0, swapped.begin() + pass0 + piece_frames,
              swapped.begin() + pass0 + 2 * piece_frames);
  violates(swapped);

  // A piece of another size than the others.
  std::vector<F> resized = good;
  resized[pass0].header.set_total_bytes(kLayer + 24);
  violates(resized);

  // A later pass says another CRC32C for the chunk.
  std::vector<F> recrc = good;
  recrc[pass0].header.set_crc32c(recrc[pass0].header.crc32c() ^ 1);
  violates(recrc);

  // A frame in the middle of a piece for another layer.
  std::vector<F> mixed = good;
  mixed[1].header.set_layer(1);
  violates(mixed);

  // The first pass at another layer than the range asked for.
  violates(LayerMajor(4, found, 1, 3), {{0, 3}});

  // A pass past the requested range.
  violates(LayerMajor(4, found, 0, 3), {{0, 2}});

  // The stream ends inside a pass.
  std::vector<F> cut = good;
  cut.pop_back();
  violates(cut);
}

// A frame after a piece's first one says found = false: the bytes it carries belong to a
// key the caller was told is found, and a caller that skips absent keys' frames (GetInto,
// the Python binding) would drop them and leave stale bytes reported found. Each order,
// with and without the layout's sizes (the CRC32C of the whole chunk right, so nothing
// but this check stops it).
TEST_F(CheckerTest, AFrameSayingFoundFalseInsideAPieceIsAViolation) {
  const GetFrameChecker::Shape shape{kLayer * kLayers, kLayer, kLayers};
  auto violates = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("found = false"), std::string::npos) << s;
    EXPECT_NE(s.message().find("protocol violation"), std::string::npos) << s;
  };
  for (const bool with_shape : {false, true}) {
    const std::optional<GetFrameChecker::Shape> s =
        with_shape ? std::optional<GetFrameChecker::Shape>(shape) : std::nullopt;
    // Chunk-major: key 0 in two halves, the second marked absent.
    std::vector<F> chunk_major;
    AppendPiece(chunk_major, 0, Chunk(0), 0, kLayer * kLayers, kLayer * kLayers / 2, {});
    ASSERT_EQ(chunk_major.size(), 2u);
    chunk_major[1].header.set_found(false);
    for (uint32_t k = 1; k < 4; ++k) chunk_major.push_back(Absent(k));
    GetFrameChecker cm(keys_, /*layer_major=*/false, std::nullopt, std::nullopt, true, s);
    violates(Run(cm, chunk_major));

    // Layer-major: the second frame of key 0's layer-0 piece (first pass), then of key
    // 2's layer-1 piece (a later pass).
    const std::vector<bool> found = {true, false, true, true};
    const size_t pass0 = 3 * 3 + 1;  // Three found keys of three frames, one absent.
    for (const size_t at : {size_t{1}, pass0 + 3 + 1}) {
      std::vector<F> layer_major = LayerMajor(4, found, 0, kLayers);
      ASSERT_TRUE(layer_major[at].header.found() && layer_major[at].header.offset() != 0);
      layer_major[at].header.set_found(false);
      GetFrameChecker lm(keys_, /*layer_major=*/true, std::nullopt, std::nullopt, true, s);
      violates(Run(lm, layer_major));
    }
  }
}

// Given the layout's sizes, a stream consistent in itself but not with the layout is a
// violation: a chunk or piece of another size, a pass outside the layout's layers, a
// whole-chunk stream that stops before the last layer.
TEST_F(CheckerTest, TheLayoutsShapeHoldsTheServerToItsSizes) {
  const GetFrameChecker::Shape shape{kLayer * kLayers, kLayer, kLayers};
  auto run = [&](bool layer_major, const std::vector<F>& frames,
                 std::optional<std::pair<uint32_t, uint32_t>> range = {}) {
    std::optional<GetFrameChecker::Shape> s = shape;
    if (range) s->item_bytes = kLayer * (range->second - range->first);
    GetFrameChecker c(keys_, layer_major,
                      range ? std::optional<uint32_t>(range->first) : std::nullopt,
                      range ? std::optional<uint32_t>(range->second) : std::nullopt,
                      /*verify_crc=*/true, s);
    return Run(c, frames);
  };
  auto violates = [](const absl::Status& s, absl::string_view what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  const std::vector<bool> found = {true, false, true, true};

  // Chunk-major: the layout's chunks pass; a shorter one, consistent in itself, does not.
  std::vector<F> chunks;
  for (uint32_t k = 0; k < 4; ++k) AppendPiece(chunks, k, Chunk(k), 0, kLayer * kLayers, 50, {});
  EXPECT_TRUE(run(false, chunks).ok());
  std::vector<F> short_chunk;
  const std::string half = Chunk(0).substr(0, kLayer);
  AppendPiece(short_chunk, 0, half, 0, kLayer, 50, {});
  violates(run(false, short_chunk), "total_bytes");
  // With a layer range, its bytes are the item.
  std::vector<F> range_chunks;
  for (uint32_t k = 0; k < 4; ++k) AppendPiece(range_chunks, k, Chunk(k), kLayer, 3 * kLayer, 50, {});
  EXPECT_TRUE(run(false, range_chunks, {{1, 3}}).ok());

  // Layer-major: the layout's layers pass, with a range too.
  EXPECT_TRUE(run(true, LayerMajor(4, found, 0, kLayers)).ok());
  EXPECT_TRUE(run(true, LayerMajor(4, found, 1, 3), {{1, 3}}).ok());
  // Pieces of half a layer, the same size throughout (so consistent without the shape).
  std::vector<F> halves;
  for (uint32_t l = 0; l < 2 * kLayers; ++l) {
    AppendPiece(halves, 0, Chunk(0), l * kLayer / 2, (l + 1) * kLayer / 2, 24, l);
  }
  GetFrameChecker lenient({keys_.data(), 1}, true, std::nullopt, std::nullopt);
  EXPECT_TRUE(Run(lenient, halves).ok()) << "consistent in itself";
  GetFrameChecker strict({keys_.data(), 1}, true, std::nullopt, std::nullopt, true, shape);
  violates(Run(strict, halves), "the layout's layers");
  // A whole-chunk stream whose first pass is not layer 0, or that ends early.
  std::vector<F> shifted = LayerMajor(4, found, 0, kLayers);
  for (F& f : shifted) f.header.set_layer(f.header.layer() + 1000);
  violates(run(true, shifted), "first pass at layer 1000");
  violates(run(true, LayerMajor(4, found, 0, kLayers - 1)), "end of stream after layer");
}

}  // namespace
}  // namespace kvtier
