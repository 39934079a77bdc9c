#include "storage/pool_chunk.h"

#include <algorithm>
#include <cstring>

#include "storage/crc32c.h"

namespace kvtier {

PoolChunk::PoolChunk(std::shared_ptr<SlotArena> arena, std::vector<uint32_t> slots,
                     uint64_t size)
    : arena_(std::move(arena)), slots_(std::move(slots)), size_(size) {}

PoolChunk::~PoolChunk() { arena_->Release(slots_); }

void PoolChunk::ForEachPiece(uint64_t offset, uint64_t len,
                             absl::FunctionRef<void(absl::string_view)> fn) const {
  const uint64_t slot_bytes = arena_->slot_bytes();
  while (len > 0) {
    const uint64_t slot = offset / slot_bytes;
    const uint64_t in_slot = offset % slot_bytes;
    const uint64_t n = std::min(len, slot_bytes - in_slot);
    fn(absl::string_view(arena_->SlotData(slots_[slot]) + in_slot, n));
    offset += n;
    len -= n;
  }
}

void PoolChunk::Write(uint64_t offset, absl::string_view data) {
  const uint64_t slot_bytes = arena_->slot_bytes();
  while (!data.empty()) {
    const uint64_t slot = offset / slot_bytes;
    const uint64_t in_slot = offset % slot_bytes;
    const uint64_t n = std::min<uint64_t>(data.size(), slot_bytes - in_slot);
    std::memcpy(arena_->SlotData(slots_[slot]) + in_slot, data.data(), n);
    data.remove_prefix(n);
    offset += n;
  }
}

uint32_t PoolChunk::WriteAndExtendCrc(uint64_t offset, absl::string_view data, uint32_t crc) {
  const uint64_t slot_bytes = arena_->slot_bytes();
  while (!data.empty()) {
    const uint64_t slot = offset / slot_bytes;
    const uint64_t in_slot = offset % slot_bytes;
    const uint64_t n = std::min<uint64_t>(data.size(), slot_bytes - in_slot);
    crc = crc32c::CopyAndExtend(crc, arena_->SlotData(slots_[slot]) + in_slot, data.data(), n,
                                crc32c::CrcOver::kDestination);
    data.remove_prefix(n);
    offset += n;
  }
  return crc;
}

void PoolChunk::CopyOut(uint64_t offset, uint64_t len, char* out) const {
  ForEachPiece(offset, len, [&out](absl::string_view piece) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  });
}

void PoolChunk::ForEachWritablePiece(uint64_t offset, uint64_t len,
                                     absl::FunctionRef<void(char*, uint64_t)> fn) {
  ForEachPiece(offset, len, [&](absl::string_view p) {
    // The arena's memory is writable; the const is ForEachPiece's promise to readers.
    fn(const_cast<char*>(p.data()), p.size());
  });
}

uint32_t PoolChunk::Crc32c() const {
  uint32_t crc = 0;
  ForEachPiece(0, size_, [&crc](absl::string_view piece) {
    crc = crc32c::Extend(crc, piece.data(), piece.size());
  });
  return crc;
}

}  // namespace kvtier
