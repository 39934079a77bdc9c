// PoolChunk: one chunk's bytes in the host-RAM pool, as a list of arena slots. It owns
// its slots and gives them back to the arena when destroyed, so a reader holding a
// std::shared_ptr<PoolChunk> keeps the bytes alive even if the chunk is evicted or
// deleted meanwhile.
//
// Thread-safety: filled by one writer (Write) before it is published; after that it is
// immutable and any number of threads may read it.
#ifndef KVTIER_STORAGE_POOL_CHUNK_H_
#define KVTIER_STORAGE_POOL_CHUNK_H_

#include <cstdint>
#include <memory>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/functional/function_ref.h"
#include "storage/slot_arena.h"

namespace kvtier {

class PoolChunk {
 public:
  // Shares ownership of `arena`: a chunk held past its pool (a view kept by a lease, a
  // GPU copy, a reply in flight) keeps the arena's memory mapped until it is dropped.
  PoolChunk(std::shared_ptr<SlotArena> arena, std::vector<uint32_t> slots, uint64_t size);
  ~PoolChunk();
  PoolChunk(const PoolChunk&) = delete;
  PoolChunk& operator=(const PoolChunk&) = delete;

  uint64_t size() const { return size_; }
  uint64_t slot_count() const { return slots_.size(); }

  // Copies `data` to [offset, offset + data.size()); the caller keeps it within size().
  void Write(uint64_t offset, absl::string_view data);
  // Write, extending `crc` over the bytes as stored (the pool's copy) in the same pass;
  // `data` may be memory another process writes meanwhile. Returns the extended CRC.
  uint32_t WriteAndExtendCrc(uint64_t offset, absl::string_view data, uint32_t crc);
  // Calls `fn` with consecutive pieces covering [offset, offset + len), each within one
  // slot; the pieces point into the pool (no copy).
  void ForEachPiece(uint64_t offset, uint64_t len,
                    absl::FunctionRef<void(absl::string_view)> fn) const;
  // The same, writable: for a device copy (DMA) into the pool. The caller keeps the
  // range within size() and writes only before the chunk is published.
  void ForEachWritablePiece(uint64_t offset, uint64_t len,
                            absl::FunctionRef<void(char*, uint64_t)> fn);
  // Copies [offset, offset + len) to `out`.
  void CopyOut(uint64_t offset, uint64_t len, char* out) const;
  uint32_t Crc32c() const;

 private:
  const std::shared_ptr<SlotArena> arena_;
  const std::vector<uint32_t> slots_;
  const uint64_t size_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_POOL_CHUNK_H_
