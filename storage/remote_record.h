// The remote tier's data model in Redis. A chunk is stored as segments (segment_bytes
// each, the last shorter) under keys that hash to different cluster slots, so a read
// fetches from every master at once, plus one commit record written last:
//
//   <prefix>:<ns hex16>:<key hex32>                         the commit record
//   <prefix>:<ns hex16>:<key hex32>:<generation hex16>:<i>  segment i
//
// The record names the write's generation (random per write): a reader fetches only
// that generation's segments, so segments of two writers of the same chunk never mix,
// and a record whose segments are gone (evicted, expired) reads as a miss. The record
// carries the chunk's size, CRC32C, token count, lineage, the layout's fingerprint
// (a daemon that registered a different layout under the same namespace id must not use
// the chunk), a CRC32C per segment, and a CRC32C of itself.
//
// Thread-safety: value types and pure functions.
#ifndef KVTIER_STORAGE_REMOTE_RECORD_H_
#define KVTIER_STORAGE_REMOTE_RECORD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/chunk_id.h"

namespace kvtier {

struct RemoteRecord {
  ChunkMeta meta;
  uint64_t layout_fingerprint = 0;
  uint64_t generation = 0;
  uint32_t segment_bytes = 0;
  std::vector<uint32_t> segment_crc32c;  // One per segment.

  uint32_t segments() const { return static_cast<uint32_t>(segment_crc32c.size()); }
  // Bytes of segment i.
  uint64_t SegmentSize(uint32_t i) const;
};

// Segments a chunk of `size` bytes takes at `segment_bytes` (> 0) each (at least 1).
// 64 bits: a record's size field may claim anything, and its count must not wrap.
uint64_t RemoteSegmentCount(uint64_t size, uint32_t segment_bytes);

std::string EncodeRemoteRecord(const RemoteRecord& record);
// Returns: Ok, DataLoss (wrong magic, truncated, its CRC32C fails, or fields that
// contradict each other), Unimplemented (whole, its CRC32C holds, but another version:
// another release's record, not corrupt).
absl::StatusOr<RemoteRecord> DecodeRemoteRecord(absl::string_view bytes);

std::string RemoteRecordKey(absl::string_view prefix, const ChunkId& id);
std::string RemoteSegmentKey(absl::string_view prefix, const ChunkId& id, uint64_t generation,
                             uint32_t segment);
// The SCAN pattern matching every record and segment of namespace `ns`.
std::string RemoteNamespacePattern(absl::string_view prefix, uint64_t ns);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REMOTE_RECORD_H_
