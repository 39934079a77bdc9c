// GetFrameChecker: checks a Get stream against the protocol in kvtier.proto as frames
// arrive, so that a caller never acts on a frame the daemon should not have sent.
// Internal to the client library.
//
// Chunk-major order: keys answered once each, in request order; each found key's frames
// contiguous from offset 0 up to total_bytes, the last one flagged; for whole-chunk
// reads, the CRC32C of the key's bytes checked on its last frame.
//
// Layer-major order: passes, one per layer, the first at the requested first layer (any
// layer when none was asked) and each one layer after the previous. The first pass
// answers every key in request order (found = false only there); each later pass holds
// exactly the keys found in the first, in request order. Each piece (one layer of one
// key) is contiguous from offset 0 to its total_bytes, which is the same for every piece.
// For whole-chunk reads the CRC32C of each found key, over its pieces in layer order, is
// checked at Finish (the client does not know which pass is the last before the stream
// ends); with a layer range, Finish also checks that the last pass was range.end - 1.
//
// Given the layout's Shape (the client knows it for any registered namespace), the sizes
// are the layout's, not the server's word: a found key's total_bytes is the chunk's (or
// its layer range's), a piece's is one layer's, and a whole-chunk layer-major read passes
// over layers [0, num_layers). A caller writing frames into a buffer sized from the
// layout can then trust every offset and layer the checker let through.
//
// Not thread-safe; one per stream.
#ifndef KVTIER_CLIENT_GET_FRAME_CHECKER_H_
#define KVTIER_CLIENT_GET_FRAME_CHECKER_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "storage/chunk_key.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

class GetFrameChecker {
 public:
  // What the namespace's layout says a Get of it answers.
  struct Shape {
    uint64_t item_bytes = 0;   // A found key's bytes: the chunk's, or its layer range's.
    uint64_t layer_bytes = 0;  // One layer of one chunk.
    uint32_t num_layers = 0;   // The layout's.
  };

  // `keys` must outlive the checker. `first_layer`/`end_layer`: the requested layer
  // range, or nullopt for whole chunks (as is every layer of `shape`: CRC-checked). `verify_crc` false skips the CRC32C checks (a
  // Get into registered memory: the daemon checked its copy as it wrote it). `shape`:
  // the layout's sizes, when known (nullopt: any consistent sizes pass).
  GetFrameChecker(absl::Span<const ChunkKey> keys, bool layer_major,
                  std::optional<uint32_t> first_layer, std::optional<uint32_t> end_layer,
                  bool verify_crc = true, std::optional<Shape> shape = std::nullopt);

  // `frame` is the header (its data() is ignored), `data` the payload's pieces, `n`
  // their total size.
  // Returns: Ok, Internal (protocol violation), DataLoss (chunk-major: CRC mismatch on
  // the last frame of a whole chunk).
  absl::Status Check(const v1::GetFrame& frame, absl::Span<const absl::string_view> data,
                     uint64_t n);

  // Call once the server ended the stream with Ok.
  // Returns: Ok, Internal (keys or layers left unanswered), DataLoss (layer-major: a
  // whole chunk's pieces do not give its CRC32C).
  absl::Status Finish() const;

  // Layer-major: the pass (layer) the last frame belonged to; nullopt before any frame.
  std::optional<uint32_t> current_layer() const { return layer_; }

 private:
  absl::Status CheckChunkMajor(const v1::GetFrame& frame,
                               absl::Span<const absl::string_view> data, uint64_t n);
  absl::Status CheckLayerMajor(const v1::GetFrame& frame,
                               absl::Span<const absl::string_view> data, uint64_t n);
  // Starts key `index` (found) at `frame`; checks the rest of the piece as Check does.
  absl::Status CheckBytes(const v1::GetFrame& frame, absl::Span<const absl::string_view> data,
                          uint64_t n);
  // Layer-major: the next key due in the current pass after `after` (or the first when
  // `after` is nullopt), skipping keys answered absent; keys_.size() when none is left.
  uint32_t NextDue(std::optional<uint32_t> after) const;

  const absl::Span<const ChunkKey> keys_;
  const bool layer_major_;
  const bool whole_chunks_;  // And verify_crc: the CRC32C is checked.
  // The layers the passes must cover: the requested range, else with a Shape all of them.
  const std::optional<uint32_t> first_layer_, end_layer_;
  const std::optional<Shape> shape_;

  uint32_t next_ = 0;        // Index of the key being (or next to be) answered.
  bool in_piece_ = false;    // Key next_ is found and some of its frames arrived.
  uint64_t total_ = 0;       // total_bytes of the key (or piece) being received.
  uint64_t received_ = 0;    // Bytes of it so far.
  uint32_t expected_crc_ = 0;
  uint32_t crc_ = 0;         // Chunk-major: CRC32C of the key's bytes so far.

  // Layer-major.
  std::optional<uint32_t> layer_;  // Current pass.
  bool first_pass_ = true;
  uint64_t piece_bytes_ = 0;       // total_bytes of every piece, once one arrived.
  std::vector<uint8_t> found_;     // Per key: 0 unanswered, 1 found, 2 absent.
  std::vector<uint32_t> key_crc_;  // Per key: CRC32C of its pieces so far.
  std::vector<uint32_t> key_expected_crc_;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_GET_FRAME_CHECKER_H_
