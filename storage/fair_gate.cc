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
  SkipAbandonedLocked();
}

bool FairGate::EnterUnless(absl::FunctionRef<bool()> cancelled, absl::Duration poll) {
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = next_ticket_++;
  auto my_turn = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ticket == serving_ && inside_ < capacity_;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), poll)) {
    mu_.Unlock();
    const bool give_up = cancelled();
    mu_.Lock();
    if (give_up) {
      abandoned_.insert(ticket);
      SkipAbandonedLocked();
      return false;
    }
  }
  ++serving_;
  ++inside_;
  SkipAbandonedLocked();
  return true;
}

void FairGate::SkipAbandonedLocked() {
  while (!abandoned_.empty()) {
    auto it = abandoned_.find(serving_);
    if (it == abandoned_.end()) return;
    abandoned_.erase(it);
    ++serving_;
  }
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
  return next_ticket_ - serving_ - abandoned_.size();
}

}  // namespace kvtier
