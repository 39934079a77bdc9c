#include "storage/key_locks.h"

namespace kvtier {

KeyLocks::Stripe& KeyLocks::For(const ChunkId& id) const {
  return stripes_[(id.key.lo ^ (id.key.hi * 0x9e3779b97f4a7c15ull) ^ id.ns) % kStripes];
}

uint64_t KeyLocks::Generation(const ChunkId& id) const {
  return For(id).generation.load(std::memory_order_acquire);
}

bool KeyLocks::InsertIfUnchanged(const ChunkId& id, uint64_t generation,
                                 absl::FunctionRef<void()> insert) {
  Stripe& s = For(id);
  absl::MutexLock lock(&s.mu);
  if (s.generation.load(std::memory_order_relaxed) != generation || s.far.contains(id) ||
      s.far_ns.contains(id.ns)) {
    return false;
  }
  insert();
  return true;
}

bool KeyLocks::InsertIfUnchanged(const ChunkId& id, uint64_t generation,
                                 absl::FunctionRef<void()> insert,
                                 absl::FunctionRef<bool()> survived) {
  Stripe& s = For(id);
  absl::MutexLock lock(&s.mu);
  // Not refused for a Delete of `id` in its far phase: work that must not be lost (a
  // put's shared write) that noted the generation after the Delete's first bump came
  // after the Delete, as far as the chunk is concerned.
  if (s.generation.load(std::memory_order_relaxed) != generation && !survived()) return false;
  insert();
  return true;
}

void KeyLocks::Removing(const ChunkId& id, absl::FunctionRef<void()> remove) {
  Stripe& s = For(id);
  absl::MutexLock lock(&s.mu);
  s.generation.fetch_add(1, std::memory_order_release);
  remove();
}

void KeyLocks::Removing(const ChunkId& id, absl::FunctionRef<void()> remove,
                        absl::FunctionRef<void()> remove_far) {
  Stripe& s = For(id);
  {
    absl::MutexLock lock(&s.mu);
    s.generation.fetch_add(1, std::memory_order_release);
    remove();
    ++s.far[id];
  }
  remove_far();
  absl::MutexLock lock(&s.mu);
  if (auto it = s.far.find(id); --it->second == 0) s.far.erase(it);
  // A promotion that noted the generation during remove_far read what it removed.
  s.generation.fetch_add(1, std::memory_order_release);
}

void KeyLocks::RemovingAll(absl::FunctionRef<void()> remove) {
  for (Stripe& s : stripes_) {
    s.mu.Lock();
    s.generation.fetch_add(1, std::memory_order_release);
  }
  remove();
  for (auto it = stripes_.rbegin(); it != stripes_.rend(); ++it) it->mu.Unlock();
}

void KeyLocks::RemovingAll(uint64_t ns, absl::FunctionRef<void()> remove,
                           absl::FunctionRef<void()> remove_far) {
  for (Stripe& s : stripes_) {
    s.mu.Lock();
    s.generation.fetch_add(1, std::memory_order_release);
  }
  remove();
  for (Stripe& s : stripes_) ++s.far_ns[ns];
  for (auto it = stripes_.rbegin(); it != stripes_.rend(); ++it) it->mu.Unlock();
  remove_far();
  for (Stripe& s : stripes_) {
    absl::MutexLock lock(&s.mu);
    if (auto it = s.far_ns.find(ns); --it->second == 0) s.far_ns.erase(it);
    // A promotion that noted the generation during remove_far read what it removed.
    s.generation.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace kvtier
