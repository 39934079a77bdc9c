#include "storage/ssd_row.h"

#include "storage/crc32c.h"

namespace kvtier {
namespace {

// Version 3 appends the lineage; version 2 rows (written before it) still decode, with
// an unknown lineage.
constexpr uint32_t kRowVersion = 3;
constexpr size_t kFixedBytes = 4 + 8 + 4 + 4 + 4 + 8 + 4 + 8 + 4 + 4;
constexpr size_t kLineageBytes = 4 + 1 + ChunkKey::kWireBytes;
constexpr size_t kKeyBytes = 8 + ChunkKey::kWireBytes;

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads little-endian fields front to back.
class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  uint64_t Le(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(in_[at_ + i])} << (8 * i);
    at_ += bytes;
    return v;
  }
  size_t at() const { return at_; }
  void Skip(size_t bytes) { at_ += bytes; }

 private:
  absl::string_view in_;
  size_t at_ = 0;
};

std::string Be64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * (7 - i))) & 0xff);
  return out;
}
uint64_t GetBe64(absl::string_view in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(in[i]);
  return v;
}

}  // namespace

std::string EncodeSsdRow(const SsdRow& row) {
  std::string out;
  out.reserve(kFixedBytes + 4 * row.piece_crcs.size() + kLineageBytes + 4);
  PutLe(out, kRowVersion, 4);
  PutLe(out, row.meta.size, 8);
  PutLe(out, row.meta.crc32c, 4);
  PutLe(out, row.meta.token_count, 4);
  PutLe(out, row.meta.codec, 4);
  PutLe(out, static_cast<uint64_t>(absl::ToUnixMicros(row.written_at)), 8);
  PutLe(out, row.extent.file, 4);
  PutLe(out, row.extent.offset, 8);
  PutLe(out, row.piece_bytes, 4);
  PutLe(out, row.piece_crcs.size(), 4);
  for (uint32_t c : row.piece_crcs) PutLe(out, c, 4);
  PutLe(out, row.meta.lineage.position, 4);
  PutLe(out, row.meta.lineage.has_parent ? 1 : 0, 1);
  const ChunkKey parent = row.meta.lineage.has_parent ? row.meta.lineage.parent : ChunkKey{};
  out.append(parent.ToByteString());
  PutLe(out, crc32c::Value(out), 4);
  return out;
}

bool DecodeSsdRow(absl::string_view in, SsdRow* row) {
  if (in.size() < kFixedBytes + 4) return false;
  Reader r(in);
  const uint64_t version = r.Le(4);
  if (version != 2 && version != kRowVersion) return false;
  const size_t lineage_bytes = version == 2 ? 0 : kLineageBytes;
  row->meta.size = r.Le(8);
  row->meta.crc32c = static_cast<uint32_t>(r.Le(4));
  row->meta.token_count = static_cast<uint32_t>(r.Le(4));
  row->meta.codec = static_cast<uint32_t>(r.Le(4));
  row->written_at = absl::FromUnixMicros(static_cast<int64_t>(r.Le(8)));
  row->extent.file = static_cast<uint32_t>(r.Le(4));
  row->extent.offset = r.Le(8);
  row->extent.size = row->meta.size;
  row->piece_bytes = static_cast<uint32_t>(r.Le(4));
  const uint64_t pieces = r.Le(4);
  if (in.size() != kFixedBytes + 4 * pieces + lineage_bytes + 4) return false;
  if (row->piece_bytes == 0 ||
      pieces != (row->meta.size + row->piece_bytes - 1) / row->piece_bytes) {
    return false;
  }
  row->piece_crcs.resize(pieces);
  for (uint64_t i = 0; i < pieces; ++i) row->piece_crcs[i] = static_cast<uint32_t>(r.Le(4));
  row->meta.lineage = ChunkLineage{};
  if (version >= 3) {
    row->meta.lineage.position = static_cast<uint32_t>(r.Le(4));
    const uint64_t has_parent = r.Le(1);
    if (has_parent > 1) return false;
    row->meta.lineage.has_parent = has_parent == 1;
    auto parent = ChunkKey::FromBytes(in.substr(r.at(), ChunkKey::kWireBytes));
    if (!parent.ok()) return false;
    r.Skip(ChunkKey::kWireBytes);
    if (row->meta.lineage.has_parent) row->meta.lineage.parent = *parent;
  }
  const size_t body = r.at();
  return r.Le(4) == crc32c::Value(in.substr(0, body));
}

std::string SsdRowKey(const ChunkId& id) { return Be64(id.ns) + id.key.ToByteString(); }

bool ParseSsdRowKey(absl::string_view key, ChunkId* id) {
  if (key.size() != kKeyBytes) return false;
  auto k = ChunkKey::FromBytes(key.substr(8));
  if (!k.ok()) return false;
  id->ns = GetBe64(key);
  id->key = *k;
  return true;
}

std::string SsdLayoutKey(uint64_t ns) { return Be64(ns); }

bool ParseSsdLayoutKey(absl::string_view key, uint64_t* ns) {
  if (key.size() != 8) return false;
  *ns = GetBe64(key);
  return true;
}

}  // namespace kvtier
