// The SSD tier's RocksDB schema: one row per chunk in the "meta" column family, keyed by
// be64(namespace) || 16-byte chunk key. The row is the chunk's commit record: it is
// written only after the payload it points to is in its file, and a chunk without one
// does not exist. Layouts live in the "layouts" column family, keyed by be64(namespace).
//
// Row (version 3), little-endian: u32 version, u64 size, u32 crc32c, u32 token_count,
// u32 codec, i64 written_at (unix micros), u32 file, u64 offset, u32 piece_bytes,
// u32 piece count, piece count x u32 piece CRC32C, the lineage (u32 position, u8
// has_parent, 16-byte parent key, zeros without one), and last a u32 CRC32C of
// everything before it, so that a flipped bit in a row is caught even where RocksDB's
// block checksum is not consulted. Version 2 rows (no lineage) still decode.
//
// Thread-safety: pure functions.
#ifndef KVTIER_STORAGE_SSD_ROW_H_
#define KVTIER_STORAGE_SSD_ROW_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "storage/chunk_id.h"
#include "storage/payload_log.h"

namespace kvtier {

struct SsdRow {
  ChunkMeta meta;
  absl::Time written_at;
  PayloadExtent extent;
  uint32_t piece_bytes = 0;
  std::vector<uint32_t> piece_crcs;
};

std::string EncodeSsdRow(const SsdRow& row);
// False if `in` is not a well-formed version-2 row, fails its CRC, or disagrees with
// itself (extent size against meta size, piece count against size).
bool DecodeSsdRow(absl::string_view in, SsdRow* row);

std::string SsdRowKey(const ChunkId& id);
bool ParseSsdRowKey(absl::string_view key, ChunkId* id);

std::string SsdLayoutKey(uint64_t ns);
bool ParseSsdLayoutKey(absl::string_view key, uint64_t* ns);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_SSD_ROW_H_
