// FetchClaims: the chunks some thread is fetching from the remote tier right now, so
// that two readers of one chunk fetch it once: the second waits for the first, then
// finds the chunk in RAM. A claim is taken only by a thread about to fetch (never for
// queued work), so a waiter always waits on work that is running.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_STORAGE_FETCH_CLAIMS_H_
#define KVTIER_STORAGE_FETCH_CLAIMS_H_

#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "storage/chunk_id.h"

namespace kvtier {

class FetchClaims {
 public:
  // Claims those of `ids` nobody holds and returns them, in order.
  std::vector<ChunkId> ClaimFree(absl::Span<const ChunkId> ids);
  // Waits until nobody holds `id`, then claims it.
  void WaitAndClaim(const ChunkId& id);
  void Release(absl::Span<const ChunkId> ids);
  bool held(const ChunkId& id) const;

  // Fetch jobs queued or running (submitted with JobQueued, ended with JobDone), so
  // tests and benchmarks can wait for them (WaitForJobs).
  void JobQueued();
  void JobDone();
  void WaitForJobs();
  // Tests only: called by WaitForJobs when it is about to wait for jobs still out (a
  // sync point), under the lock: it must not call this object. Set before any use.
  void set_before_jobs_wait_for_testing(std::function<void()> hook) {
    before_jobs_wait_ = std::move(hook);
  }

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_set<ChunkId> held_ ABSL_GUARDED_BY(mu_);
  int jobs_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> before_jobs_wait_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_FETCH_CLAIMS_H_
