// Promoter: reads chunks from the tier under the RAM pool (the SSD tier) back into it.
// A read lands straight in fresh pool slots when the pool has room without demoting
// anything, a promotion (a read must not cascade into writes to the tier below: dirty
// chunks are passed over); without room it lands where the caller says, or nowhere.
// One meta lookup per read, through StorageTier::Read, so the tier below counts one hit
// or miss and touches its policy once.
//
// Thread-safety: thread-safe; Read blocks the calling thread on the tier below.
#ifndef KVTIER_STORAGE_PROMOTER_H_
#define KVTIER_STORAGE_PROMOTER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "storage/chunk_id.h"
#include "storage/host_pool.h"
#include "storage/key_locks.h"
#include "storage/storage_tier.h"

namespace kvtier {

class Promoter {
 public:
  // `ram` and `below` must outlive this object. `on_promoted(id, meta)` runs after each
  // chunk this object put in RAM is indexed (counters, events). `admit(id, bytes)` (may
  // be empty: always) says, before any room is taken, whether a chunk may come into RAM
  // at all; refused, the read goes where `no_room` says.
  // `locks` (may be null; must outlive this object): a chunk deleted while it was read
  // is not put in RAM (KeyLocks).
  Promoter(HostPool* ram, StorageTier* below,
           std::function<void(const ChunkId&, const ChunkMeta&)> on_promoted,
           std::function<bool(const ChunkId&, uint64_t)> admit = nullptr,
           KeyLocks* locks = nullptr);

  struct Result {
    absl::Status status;             // The read's: Ok, NotFound, DataLoss, Unavailable,
                                     // ResourceExhausted (no room and no sink).
    std::optional<ChunkMeta> meta;   // Set once the tier below found the chunk.
    std::shared_ptr<PoolChunk> room;  // Set when it was promoted (status Ok).
  };
  // Reads `id` from the tier below: into RAM when there is room (evicting nothing
  // `spare` names: HostPool::Allocate), else where `no_room(meta)` says (null: nowhere;
  // the read stops at its meta).
  Result Read(const ChunkId& id, absl::FunctionRef<ChunkSink*(const ChunkMeta&)> no_room,
              absl::FunctionRef<bool(const ChunkId&)> spare = [](const ChunkId&) {
                return false;
              });

  uint64_t promotions() const { return promotions_.load(std::memory_order_relaxed); }

 private:
  HostPool* const ram_;
  StorageTier* const below_;
  const std::function<void(const ChunkId&, const ChunkMeta&)> on_promoted_;
  const std::function<bool(const ChunkId&, uint64_t)> admit_;
  KeyLocks* const locks_;
  std::atomic<uint64_t> promotions_{0};
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PROMOTER_H_
