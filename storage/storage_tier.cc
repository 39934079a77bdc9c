#include "storage/storage_tier.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "storage/crc32c.h"
#include "storage/pool_chunk.h"

namespace kvtier {

void StringSink::Write(uint64_t offset, absl::string_view bytes) {
  std::memcpy(out_->data() + offset, bytes.data(), bytes.size());
}

uint32_t StringSink::Crc32c() const { return crc32c::Value(*out_); }

void PoolSink::Write(uint64_t offset, absl::string_view bytes) { chunk_->Write(offset, bytes); }

uint32_t PoolSink::Crc32c() const { return chunk_->Crc32c(); }

ChunkBytes ChunkBytes::Of(std::shared_ptr<const PoolChunk> chunk) {
  ChunkBytes b;
  b.pieces.reserve(chunk->slot_count());
  chunk->ForEachPiece(0, chunk->size(), [&](absl::string_view p) { b.pieces.push_back(p); });
  b.keep_alive = std::move(chunk);
  return b;
}

ChunkBytes ChunkBytes::Of(std::shared_ptr<const std::string> buffer) {
  ChunkBytes b;
  b.pieces.push_back(*buffer);
  b.keep_alive = std::move(buffer);
  return b;
}

uint64_t ChunkBytes::size() const {
  uint64_t n = 0;
  for (absl::string_view p : pieces) n += p.size();
  return n;
}

absl::Status CheckChunkBytes(Tier tier, const ChunkId& id, const ChunkMeta& meta,
                             const ChunkBytes& bytes) {
  if (bytes.size() == meta.size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(TierName(tier), " write of ",
                                                 id.DebugString(), ": ", bytes.size(),
                                                 " bytes for a chunk of ", meta.size));
}

absl::Status NoSinkError() {
  return absl::ResourceExhaustedError("no room to read the chunk into");
}

absl::Status WriteAndWait(StorageTier& tier, const ChunkId& id, const ChunkMeta& meta,
                          ChunkBytes bytes) {
  absl::Notification landed;
  absl::Status status;
  tier.Write(id, meta, std::move(bytes), [&](absl::Status s) {
    status = std::move(s);
    landed.Notify();
  });
  landed.WaitForNotification();
  return status;
}

absl::StatusOr<ChunkMeta> ReadAndWait(StorageTier& tier, const ChunkId& id,
                                      StorageTier::SinkFor sink_for) {
  absl::Notification read;
  absl::StatusOr<ChunkMeta> meta;
  tier.Read(id, std::move(sink_for), [&](absl::StatusOr<ChunkMeta> m) {
    meta = std::move(m);
    read.Notify();
  });
  read.WaitForNotification();
  return meta;
}

std::vector<bool> StorageTier::ContainsMany(absl::Span<const ChunkId> ids) const {
  std::vector<bool> out;
  out.reserve(ids.size());
  for (const ChunkId& id : ids) out.push_back(Contains(id));
  return out;
}

void StorageTier::ReadMany(absl::Span<const ChunkId> ids, SinkForEach sink_for,
                           ReadEachDone done) {
  for (size_t i = 0; i < ids.size(); ++i) {
    done(i, ReadAndWait(*this, ids[i],
                        [&](const ChunkMeta& meta) { return sink_for(i, meta); }));
  }
}

absl::Status StorageTier::ReadRange(const ChunkId&, const ChunkMeta&, uint64_t, uint64_t,
                                    char*) {
  return absl::UnimplementedError(
      absl::StrCat("the ", TierName(tier()), " tier does not read ranges of a chunk"));
}

absl::Status StorageTier::DropCorrupt(const ChunkId& id, const ChunkMeta&) {
  Delete(id).IgnoreError();  // Unreachable: the copy fails its checksum again next time.
  return absl::DataLossError(
      absl::StrCat("the ", TierName(tier()), " tier's copy failed its checksum"));
}

absl::StatusOr<uint64_t> StorageTier::ShrinkNamespaces(const absl::flat_hash_set<uint64_t>&,
                                                       uint64_t) {
  return absl::UnimplementedError(
      absl::StrCat("the ", TierName(tier()), " tier keeps no per-namespace quota"));
}

}  // namespace kvtier
