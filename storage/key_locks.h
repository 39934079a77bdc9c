// KeyLocks: keeps a read that brings a chunk into RAM from a tier below (a promotion)
// from putting back a chunk deleted while it was being read. A Delete removes the chunk
// from RAM, then from SSD; a promotion reads it from SSD (or the shared tier), then
// inserts it into RAM. Interleaved, the insert would bring a deleted chunk back, clean
// and on no SSD, and a later Put of its key would answer "already present" and store
// nothing.
//
// Each chunk maps to one of a fixed set of stripes: a mutex and a generation. A Delete
// (or Clear: every stripe) holds its stripe across the removals and bumps the
// generation; a promotion notes the generation before it reads and inserts, under the
// stripe, only if it is unchanged. Either the insert comes first (the Delete then
// removes it) or the Delete does (the insert is skipped: the read is still served). A
// Delete of another chunk on the same stripe skips a promotion needlessly, which only
// costs that promotion.
//
// A Delete removes the shared tier's copy last, over the network, without the stripe.
// A promotion from the shared tier that starts in that window notes the bumped
// generation and reads the copy not yet deleted: so the chunk is marked as being
// deleted there (no insert of it runs), and the generation is bumped again after.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_KEY_LOCKS_H_
#define KVTIER_STORAGE_KEY_LOCKS_H_

#include <array>
#include <atomic>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "storage/chunk_id.h"

namespace kvtier {

class KeyLocks {
 public:
  // The generation of `id`'s stripe, to pass to InsertIfUnchanged.
  uint64_t Generation(const ChunkId& id) const;
  // Runs `insert` under `id`'s stripe if no Delete or Clear touched it since
  // `generation`; returns whether it ran.
  bool InsertIfUnchanged(const ChunkId& id, uint64_t generation,
                         absl::FunctionRef<void()> insert);
  // As above, but where the stripe did change (a Delete of any of its chunks, or any
  // Clear), runs `insert` still if `survived()`, asked under the stripe, says `id`
  // itself is still there: for work that must not be lost to another chunk's Delete.
  bool InsertIfUnchanged(const ChunkId& id, uint64_t generation,
                         absl::FunctionRef<void()> insert, absl::FunctionRef<bool()> survived);
  // Runs `remove` under `id`'s stripe, after bumping its generation.
  void Removing(const ChunkId& id, absl::FunctionRef<void()> remove);
  // The same, then `remove_far` without the stripe, while no insert of `id` runs (by
  // the first InsertIfUnchanged; the second, for work that must not be lost, is not held
  // back); the generation is bumped again once it returns.
  void Removing(const ChunkId& id, absl::FunctionRef<void()> remove,
                absl::FunctionRef<void()> remove_far);
  // Runs `remove` under every stripe (in order), after bumping every generation.
  void RemovingAll(absl::FunctionRef<void()> remove) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // The same for namespace `ns`, then `remove_far` without the stripes, while no insert
  // of a chunk of `ns` runs (by the first InsertIfUnchanged); every generation is bumped
  // again once it returns. A Clear: its local tiers, then the shared tier's copies.
  void RemovingAll(uint64_t ns, absl::FunctionRef<void()> remove,
                   absl::FunctionRef<void()> remove_far) ABSL_NO_THREAD_SAFETY_ANALYSIS;

 private:
  static constexpr size_t kStripes = 64;
  struct Stripe {
    absl::Mutex mu;
    std::atomic<uint64_t> generation{0};  // Written under mu.
    // Chunks in a Removing's remove_far (how many Removings of each).
    absl::flat_hash_map<ChunkId, uint32_t> far ABSL_GUARDED_BY(mu);
    // Namespaces in a RemovingAll's remove_far (how many of each); in every stripe.
    absl::flat_hash_map<uint64_t, uint32_t> far_ns ABSL_GUARDED_BY(mu);
  };
  Stripe& For(const ChunkId& id) const;

  mutable std::array<Stripe, kStripes> stripes_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_KEY_LOCKS_H_
