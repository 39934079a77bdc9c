// RegionChannel: a client's connection to the daemon's region socket, on which it
// registers shared memory (protocol: kvtier.proto, "Same-host data plane"). The
// registrations live as long as this connection: when the process exits, the kernel
// closes the socket and the daemon forgets them.
//
// A request the daemon does not answer within the channel's timeout (a daemon that is
// stopped or wedged) fails with DeadlineExceeded, and the channel is then broken: every
// later request fails at once (Unavailable), since a late answer could no longer be told
// apart from the next one's. Closing it makes the daemon forget its regions. A caller
// that cancels its call (CallCancellation) stops waiting at once instead; the next
// request first reads the answer it was owed (a registration that answer made is
// removed then: its caller has already let the memory go).
//
// Thread-safety: thread-safe; requests are answered in order, one at a time.
#ifndef KVTIER_CLIENT_REGION_CHANNEL_H_
#define KVTIER_CLIENT_REGION_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

class RegionChannel {
 public:
  struct Registration {
    uint64_t region_id = 0;
    uint64_t token = 0;
    uint64_t bytes = 0;
  };

  // Connects to the socket `name` ("@abstract" or a path) and checks that the daemon
  // behind it has `instance_id` (that it is the daemon the gRPC channel reaches).
  // Each request waits at most `timeout` for its answer (and for room to send it).
  // Returns: Ok, Unavailable (no such socket: another host, or the daemon has none),
  // FailedPrecondition (a different daemon answers), PermissionDenied (not admitted),
  // DeadlineExceeded (no answer to the hello).
  static absl::StatusOr<std::shared_ptr<RegionChannel>> Connect(
      const std::string& name, uint64_t instance_id, absl::Duration timeout = absl::Seconds(30));
  ~RegionChannel();
  RegionChannel(const RegionChannel&) = delete;
  RegionChannel& operator=(const RegionChannel&) = delete;

  // Registers memfd `fd` of `bytes` bytes (the daemon checks its seals and size).
  // Returns the daemon's status otherwise (InvalidArgument, ResourceExhausted, ...).
  absl::StatusOr<Registration> Add(int fd, uint64_t bytes);
  // Registers `bytes` of GPU memory from the start of the allocation whose CUDA IPC
  // handle (cudaIpcGetMemHandle, 64 bytes) is `ipc_handle`, on a daemon with a GPU
  // (DataPlaneResponse.device_memory). Get then copies chunks straight into it.
  // Returns: Ok, FailedPrecondition (the daemon has no GPU), InvalidArgument (a stale
  // or foreign handle, or an allocation smaller than `bytes`), ResourceExhausted.
  // `event_handles`: cudaIpcGetEventHandle of interprocess events, for Gets with
  // RegionTarget.record_events (at most 512).
  absl::StatusOr<Registration> AddDevice(absl::string_view ipc_handle, uint64_t bytes,
                                         absl::Span<const std::string> event_handles = {});
  // Unregisters a region. The daemon refuses (FailedPrecondition) while a call uses
  // the region, and lets go of it a moment after each call ends (after the caller saw
  // its status), so a refusal is retried, backing off, for up to `wait_for_calls`; past
  // it the refusal is returned (a call still running, such as a Prefill session writing
  // into the region). Returns: Ok (the daemon will not touch the memory again),
  // NotFound, FailedPrecondition, or the socket's error.
  absl::Status Remove(uint64_t region_id, absl::Duration wait_for_calls = absl::Seconds(5));
  // Whether a request went unanswered (the channel is closed; the daemon forgot its
  // regions).
  bool broken() const;
  // Whether the daemon's end is closed (it exited or restarted): a non-blocking peek, so
  // a client can tell a daemon that went away before it names regions the new one never
  // saw. False while an answer is in flight; true once closed.
  bool PeerGone() const;
  // Closes the connection now, once no request is in flight (the descriptors are
  // released; a client retires the channel of a daemon that went away, while buffers and
  // calls may still hold it). Every later request fails at once (Unavailable).
  void Close();

  // Sends `request` with `fd` attached (-1: none) and reads the answer. For tests that
  // send what Add never would.
  absl::StatusOr<v1::RegionSocketResponse> Call(const v1::RegionSocketRequest& request, int fd);

 private:
  RegionChannel(int fd, int wake_fd, absl::Duration timeout)
      : fd_(fd), wake_fd_(wake_fd), timeout_(timeout) {}
  enum class WaitResult { kReady, kCancelled, kTimedOut };
  // Waits for an answer on fd_ for at most timeout_, or until `cancelled` is set (its
  // Hook writes wake_fd_ to end the wait).
  WaitResult WaitReadable(const std::atomic<bool>& cancelled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Registration> Register(const v1::RegionSocketRequest& req, int fd);
  // -1 once closed. Atomic: PeerGone reads it without mu_.
  std::atomic<int> fd_;
  int wake_fd_ ABSL_GUARDED_BY(mu_);  // An eventfd: a cancelled caller's wait ends on it.
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;  // One request in flight.
  // A request went unanswered within the timeout. Atomic: read without mu_, which a
  // request holds while it waits.
  std::atomic<bool> broken_{false};
  // Answers owed to requests whose callers cancelled while waiting; the next request
  // reads and drops them first.
  int owed_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // Close()
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_REGION_CHANNEL_H_
