#include "storage/fetch_claims.h"

namespace kvtier {

std::vector<ChunkId> FetchClaims::ClaimFree(absl::Span<const ChunkId> ids) {
  std::vector<ChunkId> claimed;
  absl::MutexLock l(&mu_);
  for (const ChunkId& id : ids) {
    if (held_.insert(id).second) claimed.push_back(id);
  }
  return claimed;
}

void FetchClaims::WaitAndClaim(const ChunkId& id) {
  struct Wait {
    FetchClaims* claims;
    const ChunkId* id;
  } wait{this, &id};
  absl::MutexLock l(&mu_);
  mu_.Await(absl::Condition(
      +[](Wait* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->claims->mu_) {
        return !w->claims->held_.contains(*w->id);
      },
      &wait));
  held_.insert(id);
}

void FetchClaims::Release(absl::Span<const ChunkId> ids) {
  absl::MutexLock l(&mu_);
  for (const ChunkId& id : ids) held_.erase(id);
}

bool FetchClaims::held(const ChunkId& id) const {
  absl::MutexLock l(&mu_);
  return held_.contains(id);
}

void FetchClaims::JobQueued() {
  absl::MutexLock l(&mu_);
  ++jobs_;
}

void FetchClaims::JobDone() {
  absl::MutexLock l(&mu_);
  --jobs_;
}

void FetchClaims::WaitForJobs() {
  absl::MutexLock l(&mu_);
  constexpr auto kNoneOut = +[](int* jobs) { return *jobs == 0; };
  if (!kNoneOut(&jobs_) && before_jobs_wait_) before_jobs_wait_();
  mu_.Await(absl::Condition(kNoneOut, &jobs_));
}

}  // namespace kvtier
