#include "storage/promoter.h"

#include <utility>

namespace kvtier {

Promoter::Promoter(HostPool* ram, StorageTier* below,
                   std::function<void(const ChunkId&, const ChunkMeta&)> on_promoted,
                   std::function<bool(const ChunkId&, uint64_t)> admit, KeyLocks* locks)
    : ram_(ram),
      below_(below),
      on_promoted_(std::move(on_promoted)),
      admit_(std::move(admit)),
      locks_(locks) {}

Promoter::Result Promoter::Read(const ChunkId& id,
                                absl::FunctionRef<ChunkSink*(const ChunkMeta&)> no_room,
                                absl::FunctionRef<bool(const ChunkId&)> spare) {
  Result out;
  const uint64_t generation = locks_ != nullptr ? locks_->Generation(id) : 0;
  std::optional<PoolSink> pool_sink;
  absl::StatusOr<ChunkMeta> meta =
      ReadAndWait(*below_, id, [&](const ChunkMeta& m) -> ChunkSink* {
        out.meta = m;
        if (admit_ && !admit_(id, m.size)) return no_room(m);
        // A chunk larger than the pool (from a run with a bigger ram_capacity) is no
        // room too.
        absl::StatusOr<std::shared_ptr<PoolChunk>> room =
            ram_->Allocate(m.size, HostPool::DirtyVictim::kSkip, spare);
        if (!room.ok()) return no_room(m);
        out.room = *std::move(room);
        pool_sink.emplace(out.room.get());
        return &*pool_sink;
      });
  out.status = meta.status();
  if (!meta.ok()) {
    out.room.reset();  // Its slots go back; nothing was indexed.
    return out;
  }
  if (out.room == nullptr) return out;
  // Not if it was deleted while it was read; the read is served from the room anyway.
  bool inserted = false;
  auto insert = [&] { inserted = ram_->Insert(id, out.room, *meta, /*dirty=*/false); };
  if (locks_ == nullptr) {
    insert();
  } else {
    locks_->InsertIfUnchanged(id, generation, insert);
  }
  if (inserted) {
    promotions_.fetch_add(1, std::memory_order_relaxed);
    if (on_promoted_) on_promoted_(id, *meta);
  }
  return out;
}

}  // namespace kvtier
