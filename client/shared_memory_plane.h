// SharedMemoryPlane: a client's same-host data plane to one kvtierd. It holds the region
// socket connection, the buffers the application allocated (AllocateShared: transfers
// from and into them are the daemon's one copy), and a pool of staging buffers for
// transfers from and into the application's own memory (one more copy, by the client).
//
// Staging memory is bounded: at most `staging_bytes` in all, reused across calls;
// a call that would need more streams instead.
//
// Thread-safety: thread-safe (one mutex over the lists, never held during a copy or a
// round trip to the daemon).
#ifndef KVTIER_CLIENT_SHARED_MEMORY_PLANE_H_
#define KVTIER_CLIENT_SHARED_MEMORY_PLANE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/region_channel.h"
#include "client/shared_buffer.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

class SharedMemoryPlane {
 public:
  // Connects to the region socket `info` names; each request on it waits at most
  // `timeout` (RegionChannel). Returns: Ok, and Connect's errors (Unavailable: not this
  // host; FailedPrecondition: another daemon; PermissionDenied; DeadlineExceeded).
  static absl::StatusOr<std::unique_ptr<SharedMemoryPlane>> Open(
      const v1::DataPlaneResponse& info, uint64_t staging_bytes, absl::Duration timeout);

  // A registered buffer of at least `bytes`, remembered (weakly) so that Put and Get
  // recognise spans inside it.
  absl::StatusOr<std::shared_ptr<SharedBuffer>> Allocate(uint64_t bytes);
  // The allocated buffer holding [p, p + n), or null. Every buffer it looks at is
  // destroyed, if its reference was the last, after mu_ is released (~SharedBuffer
  // unregisters: a round trip to the daemon).
  std::shared_ptr<SharedBuffer> Find(const void* p, uint64_t n);
  // For tests: `hook` runs under mu_ with each live buffer Find looks at, before it is
  // compared (a test drops its own reference there, leaving Find's the last).
  void SetFindHookForTest(std::function<void(const SharedBuffer&)> hook);

  // A staging buffer of at least `bytes`, or null when the staging budget cannot hold
  // it (or registering one failed): the caller streams. Give it back with Release.
  std::shared_ptr<SharedBuffer> AcquireStaging(uint64_t bytes);
  void ReleaseStaging(std::shared_ptr<SharedBuffer> buffer);
  // Gives back a staging buffer that a failed or cancelled transfer used: the daemon may
  // still be finishing a copy into it, so it is never reused, and unregistered at the
  // next ReleaseStaging, or by an AcquireStaging that needs its room (without waiting on
  // the daemon now); its bytes count against staging_bytes until then.
  void DiscardStaging(std::shared_ptr<SharedBuffer> buffer);
  // Unmaps the staging buffers not lent out (free and discarded): for a plane whose
  // daemon has gone.
  void DropStaging();

  const std::string& socket() const { return socket_; }
  RegionChannel& channel() { return *channel_; }

 private:
  SharedMemoryPlane(std::shared_ptr<RegionChannel> channel, std::string socket,
                    uint64_t staging_bytes)
      : channel_(std::move(channel)), socket_(std::move(socket)), staging_bytes_(staging_bytes) {}

  const std::shared_ptr<RegionChannel> channel_;
  const std::string socket_;
  const uint64_t staging_bytes_;
  absl::Mutex mu_;
  std::vector<std::weak_ptr<SharedBuffer>> allocated_ ABSL_GUARDED_BY(mu_);
  std::function<void(const SharedBuffer&)> find_hook_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<SharedBuffer>> free_staging_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<SharedBuffer>> discarded_ ABSL_GUARDED_BY(mu_);
  uint64_t staging_total_ ABSL_GUARDED_BY(mu_) = 0;  // Free and lent staging bytes.
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_SHARED_MEMORY_PLANE_H_
