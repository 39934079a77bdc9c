#include "client/shared_memory_plane.h"

#include <algorithm>

namespace kvtier {

absl::StatusOr<std::unique_ptr<SharedMemoryPlane>> SharedMemoryPlane::Open(
    const v1::DataPlaneResponse& info, uint64_t staging_bytes, absl::Duration timeout) {
  auto channel = RegionChannel::Connect(info.region_socket(), info.instance_id(), timeout);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<SharedMemoryPlane>(
      new SharedMemoryPlane(*std::move(channel), info.region_socket(), staging_bytes));
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedMemoryPlane::Allocate(uint64_t bytes) {
  auto buffer = SharedBuffer::Create(channel_, bytes);
  if (!buffer.ok()) return buffer.status();
  absl::MutexLock lock(&mu_);
  std::erase_if(allocated_, [](const std::weak_ptr<SharedBuffer>& w) { return w.expired(); });
  allocated_.push_back(*buffer);
  return buffer;
}

std::shared_ptr<SharedBuffer> SharedMemoryPlane::Find(const void* p, uint64_t n) {
  // The buffers looked at, kept until after the lock is released (declared before it):
  // a lock() may take what became the last reference (its owner dropped its own in the
  // meantime), and ~SharedBuffer unregisters the buffer, a round trip to the daemon
  // that must hold neither mu_ nor, for the Python binding, the GIL.
  std::vector<std::shared_ptr<SharedBuffer>> seen;
  absl::MutexLock lock(&mu_);
  seen.reserve(allocated_.size());
  for (const auto& w : allocated_) {
    std::shared_ptr<SharedBuffer> b = w.lock();
    if (b == nullptr) continue;
    if (find_hook_) find_hook_(*b);
    if (b->Contains(p, n)) return b;
    seen.push_back(std::move(b));
  }
  return nullptr;
}

void SharedMemoryPlane::SetFindHookForTest(std::function<void(const SharedBuffer&)> hook) {
  absl::MutexLock lock(&mu_);
  find_hook_ = std::move(hook);
}

std::shared_ptr<SharedBuffer> SharedMemoryPlane::AcquireStaging(uint64_t bytes) {
  if (bytes > staging_bytes_) return nullptr;
  uint64_t size = 4ull << 20;
  while (size < bytes) size *= 2;
  // Buffers given up to make room. Each unregisters (a round trip to the daemon) as it
  // is destroyed, which happens after the lock is released.
  std::vector<std::shared_ptr<SharedBuffer>> dropped;
  {
    absl::MutexLock lock(&mu_);
    // The smallest free buffer that fits.
    auto best = free_staging_.end();
    for (auto it = free_staging_.begin(); it != free_staging_.end(); ++it) {
      if ((*it)->size() >= bytes && (best == free_staging_.end() || (*it)->size() < (*best)->size())) {
        best = it;
      }
    }
    if (best != free_staging_.end()) {
      auto b = std::move(*best);
      free_staging_.erase(best);
      return b;
    }
    // Room comes from free buffers, largest first, then from discarded ones (a failed
    // call's, which otherwise wait for a call that succeeds: without this, one failure
    // that left too little room would stop staging for good). Nothing is given up when
    // even all of them would not make room.
    uint64_t reclaimable = 0;
    for (const auto& b : free_staging_) reclaimable += b->size();
    for (const auto& b : discarded_) reclaimable += b->size();
    if (staging_total_ - reclaimable + size > staging_bytes_) return nullptr;
    std::sort(free_staging_.begin(), free_staging_.end(),
              [](const auto& a, const auto& b) { return a->size() < b->size(); });
    while (staging_total_ + size > staging_bytes_ && !free_staging_.empty()) {
      staging_total_ -= free_staging_.back()->size();
      dropped.push_back(std::move(free_staging_.back()));
      free_staging_.pop_back();
    }
    if (staging_total_ + size > staging_bytes_) {
      for (auto& b : discarded_) {
        staging_total_ -= b->size();
        dropped.push_back(std::move(b));
      }
      discarded_.clear();
    }
    staging_total_ += size;
  }
  dropped.clear();  // Unregistered before the new one registers.
  auto b = SharedBuffer::Create(channel_, size);
  if (!b.ok()) {
    absl::MutexLock lock(&mu_);
    staging_total_ -= size;
    return nullptr;
  }
  return *std::move(b);
}

void SharedMemoryPlane::ReleaseStaging(std::shared_ptr<SharedBuffer> buffer) {
  if (!buffer) return;
  std::vector<std::shared_ptr<SharedBuffer>> discarded;
  {
    absl::MutexLock lock(&mu_);
    free_staging_.push_back(std::move(buffer));
    discarded.swap(discarded_);
    for (const auto& b : discarded) staging_total_ -= b->size();
  }
  // The daemon answered the call that used `buffer`: it answers these removals too.
  // Each unregisters as it goes, outside the lock.
}

}  // namespace kvtier

namespace kvtier {

void SharedMemoryPlane::DropStaging() {
  std::vector<std::shared_ptr<SharedBuffer>> free, discarded;
  {
    absl::MutexLock lock(&mu_);
    free.swap(free_staging_);
    discarded.swap(discarded_);
    for (const auto& b : free) staging_total_ -= b->size();
    for (const auto& b : discarded) staging_total_ -= b->size();
  }
  // Destroyed here: each unmaps (its Remove fails at once on a closed socket).
}

void SharedMemoryPlane::DiscardStaging(std::shared_ptr<SharedBuffer> buffer) {
  if (!buffer) return;
  absl::MutexLock lock(&mu_);
  // Unregistered later, when a call releases a staging buffer: the clean-up of a failed
  // or cancelled call must not wait on a daemon that has stopped answering. Its bytes
  // stay counted in the staging budget until then, so a run of failures streams rather
  // than mapping more.
  discarded_.push_back(std::move(buffer));
}

}  // namespace kvtier
