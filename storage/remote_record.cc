#include "storage/remote_record.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'R', 'R'};
constexpr uint32_t kVersion = 1;
// Far above any chunk a layout allows; a record claiming more is corrupt.
constexpr uint32_t kMaxSegments = 1u << 20;

void PutU32(std::string* out, uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>(v >> (8 * i));
  out->append(b, 4);
}
void PutU64(std::string* out, uint64_t v) {
  PutU32(out, static_cast<uint32_t>(v));
  PutU32(out, static_cast<uint32_t>(v >> 32));
}

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  bool U32(uint32_t* v) {
    if (in_.size() < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    in_.remove_prefix(4);
    return true;
  }
  bool U64(uint64_t* v) {
    uint32_t lo, hi;
    if (!U32(&lo) || !U32(&hi)) return false;
    *v = (static_cast<uint64_t>(hi) << 32) | lo;
    return true;
  }
  size_t left() const { return in_.size(); }

 private:
  absl::string_view in_;
};

absl::Status Corrupt(absl::string_view why) {
  return absl::DataLossError(absl::StrCat("remote commit record: ", why));
}

}  // namespace

uint64_t RemoteRecord::SegmentSize(uint32_t i) const {
  const uint64_t begin = static_cast<uint64_t>(i) * segment_bytes;
  return std::min<uint64_t>(segment_bytes, meta.size - begin);
}

uint64_t RemoteSegmentCount(uint64_t size, uint32_t segment_bytes) {
  if (size == 0) return 1;
  return size / segment_bytes + (size % segment_bytes != 0 ? 1 : 0);  // No overflow.
}

std::string EncodeRemoteRecord(const RemoteRecord& r) {
  std::string out(kMagic, sizeof(kMagic));
  PutU32(&out, kVersion);
  PutU64(&out, r.meta.size);
  PutU32(&out, r.meta.crc32c);
  PutU32(&out, r.meta.token_count);
  PutU32(&out, r.meta.codec);
  PutU32(&out, r.meta.lineage.position);
  PutU32(&out, r.meta.lineage.has_parent ? 1 : 0);
  PutU64(&out, r.meta.lineage.parent.hi);
  PutU64(&out, r.meta.lineage.parent.lo);
  PutU64(&out, r.layout_fingerprint);
  PutU64(&out, r.generation);
  PutU32(&out, r.segment_bytes);
  PutU32(&out, r.segments());
  for (uint32_t crc : r.segment_crc32c) PutU32(&out, crc);
  PutU32(&out, crc32c::Value(out));
  return out;
}

absl::StatusOr<RemoteRecord> DecodeRemoteRecord(absl::string_view bytes) {
  if (bytes.size() < sizeof(kMagic) + 4 || std::memcmp(bytes.data(), kMagic, 4) != 0) {
    return Corrupt("not a kvtier record (magic)");
  }
  const uint32_t want_crc = crc32c::Value(bytes.substr(0, bytes.size() - 4));
  Reader tail(bytes.substr(bytes.size() - 4));
  uint32_t crc = 0;
  tail.U32(&crc);
  if (crc != want_crc) return Corrupt("its CRC32C does not match");
  Reader in(bytes.substr(4, bytes.size() - 8));
  RemoteRecord r;
  uint32_t version = 0, has_parent = 0, segments = 0;
  if (!in.U32(&version)) return Corrupt("truncated");
  if (version != kVersion) {
    // Whole and CRC-valid: another release wrote it (a rolling upgrade runs both).
    return absl::UnimplementedError(absl::StrCat("remote commit record: version ", version,
                                                 " (this release reads ", kVersion, ")"));
  }
  if (!in.U64(&r.meta.size) || !in.U32(&r.meta.crc32c) || !in.U32(&r.meta.token_count) ||
      !in.U32(&r.meta.codec) || !in.U32(&r.meta.lineage.position) || !in.U32(&has_parent) ||
      !in.U64(&r.meta.lineage.parent.hi) || !in.U64(&r.meta.lineage.parent.lo) ||
      !in.U64(&r.layout_fingerprint) || !in.U64(&r.generation) || !in.U32(&r.segment_bytes) ||
      !in.U32(&segments)) {
    return Corrupt("truncated");
  }
  r.meta.lineage.has_parent = has_parent != 0;
  // The count the size implies is compared in 64 bits: 2^32 + 1 must not pass as 1.
  if (r.segment_bytes == 0 || segments == 0 || segments > kMaxSegments ||
      segments != RemoteSegmentCount(r.meta.size, r.segment_bytes) ||
      in.left() != static_cast<size_t>(segments) * 4) {
    return Corrupt("segment count does not match the chunk's size");
  }
  r.segment_crc32c.resize(segments);
  for (uint32_t& c : r.segment_crc32c) in.U32(&c);
  return r;
}

std::string RemoteRecordKey(absl::string_view prefix, const ChunkId& id) {
  return absl::StrFormat("%s:%016x:%s", prefix, id.ns, id.key.ToHex());
}

std::string RemoteSegmentKey(absl::string_view prefix, const ChunkId& id, uint64_t generation,
                             uint32_t segment) {
  return absl::StrFormat("%s:%016x:%s:%016x:%u", prefix, id.ns, id.key.ToHex(), generation,
                         segment);
}

std::string RemoteNamespacePattern(absl::string_view prefix, uint64_t ns) {
  // SCAN's glob: the prefix is ours and never holds glob characters (validated).
  return absl::StrFormat("%s:%016x:*", prefix, ns);
}

}  // namespace kvtier
