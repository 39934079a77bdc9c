#include "storage/put_admission.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status PutAdmissionOptions::Validate() const {
  if (wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("put admission: wait must not be negative");
  }
  if (retry_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("put admission: retry_interval must be positive");
  }
  if (!now) return absl::InvalidArgumentError("put admission: a clock is required");
  return absl::OkStatus();
}

PutAdmission::PutAdmission(PutAdmissionOptions options, TryRoom try_room)
    : options_(std::move(options)),
      try_room_(std::move(try_room)),
      thread_([this] { Loop(); }) {}

PutAdmission::~PutAdmission() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

uint64_t PutAdmission::Admit(uint64_t size, Done done) {
  bool stopping, first;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    first = queue_.empty();
  }
  if (stopping) {
    done(absl::UnavailableError("put admission: the store is closing"));
    return 0;
  }
  bool noted = false;
  if (first) {
    // Nobody waits ahead: take room now if it is there for the quick kind of asking.
    Room room = try_room_(size, /*may_block=*/false, noted);
    if (room.ok() || !absl::IsResourceExhausted(room.status())) {
      done(std::move(room));
      return 0;
    }
  }
  mu_.Lock();
  if (stopping_) {  // Closing meanwhile: the thread may already have answered the queue.
    mu_.Unlock();
    done(absl::UnavailableError("put admission: the store is closing"));
    return 0;
  }
  const uint64_t ticket = next_ticket_++;
  queue_.push_back(
      Waiter{ticket, size, options_.now() + options_.wait, std::move(done), noted});
  ++queued_;
  notified_ = true;
  mu_.Unlock();
  return ticket;
}

bool PutAdmission::Cancel(uint64_t ticket) {
  Done done;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if (it->ticket != ticket) continue;
      done = std::move(it->done);
      queue_.erase(it);
      break;
    }
  }
  if (!done) return false;
  done(absl::CancelledError("put cancelled while waiting for room in RAM"));
  return true;
}

void PutAdmission::Notify() {
  absl::MutexLock lock(&mu_);
  notified_ = true;
}

bool PutAdmission::ShouldWake() const { return stopping_ || (!queue_.empty() && notified_); }

void PutAdmission::Loop() {
  mu_.Lock();
  bool retry_now = false;
  for (;;) {
    if (!retry_now) {
      if (queue_.empty()) {
        mu_.Await(absl::Condition(this, &PutAdmission::ShouldWake));
      } else {
        mu_.AwaitWithTimeout(absl::Condition(this, &PutAdmission::ShouldWake),
                             options_.retry_interval);
      }
    }
    retry_now = false;
    if (stopping_) break;
    if (queue_.empty()) continue;
    notified_ = false;
    const uint64_t ticket = queue_.front().ticket;
    const uint64_t size = queue_.front().size;
    bool noted = queue_.front().noted;
    mu_.Unlock();
    Room room = try_room_(size, /*may_block=*/true, noted);
    mu_.Lock();
    Done done;
    const bool still_head = !queue_.empty() && queue_.front().ticket == ticket;
    if (still_head) queue_.front().noted = noted;
    if (!still_head) {
      retry_now = !queue_.empty();  // Cancelled meanwhile; the room goes back below.
    } else if (room.ok() || !absl::IsResourceExhausted(room.status())) {
      done = std::move(queue_.front().done);
    } else if (options_.now() >= queue_.front().deadline) {
      ++timed_out_;
      room = absl::ResourceExhaustedError(absl::StrCat(
          room.status().message(), "; waited ", absl::FormatDuration(options_.wait),
          " for room"));
      done = std::move(queue_.front().done);
    } else {
      continue;  // Still no room: wait for a notification or the retry interval.
    }
    if (done) {
      queue_.pop_front();
      retry_now = !queue_.empty();  // The next put may fit at once.
    }
    mu_.Unlock();
    if (done) {
      Answer(std::move(done), std::move(room));
    } else {
      room = absl::CancelledError("");  // Gives a cancelled put's room back, unlocked.
    }
    mu_.Lock();
  }
  std::deque<Waiter> left = std::move(queue_);
  queue_.clear();
  mu_.Unlock();
  for (Waiter& w : left) {
    Answer(std::move(w.done), absl::UnavailableError("put admission: the store is closing"));
  }
}

void PutAdmission::Answer(Done done, Room room) {
  if (!options_.answer_on) {
    done(std::move(room));
    return;
  }
  // std::function needs a copyable task: the answer travels in a shared_ptr.
  auto task = std::make_shared<std::pair<Done, Room>>(std::move(done), std::move(room));
  options_.answer_on([task] { task->first(std::move(task->second)); });
}

size_t PutAdmission::waiting() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

uint64_t PutAdmission::queued_total() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

uint64_t PutAdmission::timed_out_total() const {
  absl::MutexLock lock(&mu_);
  return timed_out_;
}

}  // namespace kvtier
