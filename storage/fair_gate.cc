#include "storage/fair_gate.h"

namespace kvtier {

void FairGate::Enter() {
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = next_ticket_++;
  auto my_turn = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ticket == serving_ && inside_ < capacity_;
  };
  mu_.Await(absl::Condition(&my_turn));
  ++serving_;
  ++inside_;
}

bool FairGate::TryEnter() {
  absl::MutexLock lock(&mu_);
  if (next_ticket_ != serving_ || inside_ >= capacity_) return false;
  ++next_ticket_;
  ++serving_;
  ++inside_;
  return true;
}

void FairGate::Leave() {
  absl::MutexLock lock(&mu_);
  --inside_;
}

uint64_t FairGate::waiting() const {
  absl::MutexLock lock(&mu_);
  return next_ticket_ - serving_;
}

}  // namespace kvtier
