#include "client/call_cancellation.h"

#include <grpcpp/client_context.h>

#include <algorithm>

namespace kvtier {
namespace {

thread_local CallCancellation* current_cancellation = nullptr;

}  // namespace

void CallCancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  // Under the lock: a Hook leaves the list (under it too) before what it names goes.
  for (const auto& [hook, on_cancel] : hooks_) on_cancel();
}

bool CallCancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool CallCancellation::watching() const {
  absl::MutexLock lock(&mu_);
  return !hooks_.empty();
}

bool CallCancellation::CurrentCancelled() {
  return current_cancellation != nullptr && current_cancellation->cancelled();
}

CallCancellation::Scope::Scope(CallCancellation* c) : outer_(current_cancellation) {
  current_cancellation = c;
}

CallCancellation::Scope::~Scope() { current_cancellation = outer_; }

CallCancellation::Hook::Hook(std::function<void()> on_cancel)
    : cancellation_(current_cancellation) {
  if (cancellation_ == nullptr) return;
  absl::MutexLock lock(&cancellation_->mu_);
  if (cancellation_->cancelled_) on_cancel();
  cancellation_->hooks_.emplace_back(this, std::move(on_cancel));
}

CallCancellation::Hook::~Hook() {
  if (cancellation_ == nullptr) return;
  absl::MutexLock lock(&cancellation_->mu_);
  auto& h = cancellation_->hooks_;
  h.erase(std::remove_if(h.begin(), h.end(), [this](const auto& e) { return e.first == this; }),
          h.end());
}

// Before its call starts, TryCancel marks the context: the call is cancelled as it starts.
CallCancellation::Watch::Watch(grpc::ClientContext* ctx) : hook_([ctx] { ctx->TryCancel(); }) {}

}  // namespace kvtier
