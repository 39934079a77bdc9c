// PutAdmission: puts waiting for room in the RAM pool, admitted in arrival order by one
// thread, so that a waiting put holds no thread of its own. Admit() answers at once
// (inline, on the caller's thread) when nobody waits ahead and the pool has room without
// blocking; otherwise the put joins a FIFO queue and the admission thread answers it:
// with room, once the head of the queue finds it (the thread may make room the slow way,
// e.g. by writing dirty chunks to SSD), or ResourceExhausted once the put has waited
// `wait`. Cancel() takes a put out of the queue (its stream ended).
//
// Nothing tells the queue when room appears (readers drop chunks, flushes finish, puts
// abandon their slots), so while puts wait, the thread retries the head every
// `retry_interval`, and at once on Notify().
//
// Thread-safety: thread-safe. `done` runs exactly once, without the queue's lock held,
// on the caller's thread, the thread that calls Cancel, or (answers from the admission
// thread) through `answer_on`.
#ifndef KVTIER_STORAGE_PUT_ADMISSION_H_
#define KVTIER_STORAGE_PUT_ADMISSION_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/pool_chunk.h"

namespace kvtier {

struct PutAdmissionOptions {
  // How long a put may wait in the queue before ResourceExhausted.
  absl::Duration wait = absl::Seconds(5);
  // How often the head of the queue retries while nothing notifies.
  absl::Duration retry_interval = absl::Milliseconds(1);
  // Clock for the deadlines; tests inject a fake one.
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Runs the answers the admission thread gives (a put's `done` may copy its first
  // frame, megabytes, which must not hold up the queue). Null: on the admission thread.
  // Must accept tasks until the PutAdmission is destroyed.
  std::function<void(std::function<void()>)> answer_on;

  absl::Status Validate() const;
};

class PutAdmission {
 public:
  using Room = absl::StatusOr<std::shared_ptr<PoolChunk>>;
  // Tries to find room for `size` bytes. `may_block`: false on a caller's thread (only
  // what is quick, such as evicting clean chunks), true on the admission thread (may
  // also write dirty chunks to SSD). `noted` is the put's own flag, false at its first
  // try and kept across its tries (a waiting put is tried again every retry_interval):
  // TryRoom sets it to count a put in its metrics once, not once per try. Returns the
  // room, ResourceExhausted (none yet: try again later), or another error (the put
  // fails with it).
  using TryRoom = std::function<Room(uint64_t size, bool may_block, bool& noted)>;
  using Done = std::function<void(Room)>;

  PutAdmission(PutAdmissionOptions options, TryRoom try_room);
  // Answers every waiting put Unavailable, then joins the thread.
  ~PutAdmission();
  PutAdmission(const PutAdmission&) = delete;
  PutAdmission& operator=(const PutAdmission&) = delete;

  // Asks for room for `size` bytes. Returns a ticket for Cancel (0 when `done` already
  // ran on this thread).
  uint64_t Admit(uint64_t size, Done done);
  // Takes a waiting put out of the queue; its `done` gets Cancelled (here, on this
  // thread). False when the ticket is not waiting (answered already).
  bool Cancel(uint64_t ticket);
  // Room may have appeared: the head of the queue retries now.
  void Notify();

  size_t waiting() const;
  // Puts that waited in the queue, and those of them that timed out.
  uint64_t queued_total() const;
  uint64_t timed_out_total() const;

 private:
  struct Waiter {
    uint64_t ticket;
    uint64_t size;
    absl::Time deadline;
    Done done;
    bool noted = false;  // TryRoom's flag (see TryRoom).
  };
  void Loop();
  // Runs `done(room)` through answer_on, or here without one.
  void Answer(Done done, Room room);
  bool ShouldWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PutAdmissionOptions options_;
  const TryRoom try_room_;
  mutable absl::Mutex mu_;
  std::deque<Waiter> queue_ ABSL_GUARDED_BY(mu_);
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t timed_out_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // Last: started after the state above exists.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PUT_ADMISSION_H_
