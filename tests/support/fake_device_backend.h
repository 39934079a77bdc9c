// FakeDeviceBackend: a GPU made of host memory, for testing the GPU tier's logic on
// machines without one. Device allocations are heap blocks (so a test can read what
// landed, and a DevicePtr is their address), copies are memcpy, and every device
// address a copy names is checked against the live allocations and IPC mappings, as
// CUDA would reject it. It counts what is allocated, pinned and mapped, so tests can
// assert that nothing leaks, and injects the faults a real device has: out of memory,
// a failed pin, a copy that fails midway, a stale or foreign IPC handle.
//
// Copies run on one completion thread in submission order, or, with hold_copies, only
// when the test calls RunPending: a test can then look at the state while a copy is in
// flight, deterministically.
//
// Thread-safety: thread-safe.
#ifndef KVTIER_TESTS_SUPPORT_FAKE_DEVICE_BACKEND_H_
#define KVTIER_TESTS_SUPPORT_FAKE_DEVICE_BACKEND_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "storage/crc32c_gf2.h"
#include "storage/device_backend.h"

namespace kvtier {

struct FakeDeviceOptions {
  uint64_t memory_bytes = 1ull << 30;  // Device memory; Allocate beyond it fails.
  bool hold_copies = false;            // Copies wait for RunPending.
  // Checks CRC32Cs "on the device" (SubmitAndCrc32c), by the GPU kernels' own
  // arithmetic (crc32c_gf2::RawCrcLikeTheGpu) over the fake's memory.
  bool checks_crc32c = false;
};

class FakeDeviceBackend final : public DeviceBackend {
 public:
  explicit FakeDeviceBackend(FakeDeviceOptions options = {});
  ~FakeDeviceBackend() override;

  std::string Describe() const override { return "fake device"; }
  absl::StatusOr<DevicePtr> Allocate(uint64_t bytes) override;
  void Free(DevicePtr ptr) override;
  absl::Status PinHost(void* p, uint64_t bytes) override;
  void UnpinHost(void* p) override;
  void Submit(std::vector<DeviceCopy> copies, std::function<void(absl::Status)> done) override;
  bool ChecksCrc32c() const override { return options_.checks_crc32c; }
  void SubmitAndCrc32c(std::vector<DeviceCopy> copies, DevicePtr at, uint64_t bytes,
                       std::function<void(CopiedAndChecked)> done) override;
  absl::StatusOr<IpcMemory> OpenIpcMemory(absl::string_view handle) override;
  void CloseIpcMemory(DevicePtr base) override;
  absl::StatusOr<uint64_t> OpenIpcEvent(absl::string_view handle) override;
  void CloseIpcEvent(uint64_t event) override;

  // What a worker process does: allocates device memory and exports its IPC handle.
  // The memory counts against memory_bytes like any allocation.
  absl::StatusOr<std::string> ExportIpcMemory(DevicePtr base);
  // The exporting worker exited: its handle becomes stale (new opens fail); mappings
  // already open stay valid until closed, as with CUDA.
  void RevokeIpcMemory(const std::string& handle);
  // A worker's interprocess event, and its IPC handle. Revoking makes the handle stale.
  std::string ExportIpcEvent();
  void RevokeIpcEvent(const std::string& handle);
  // How often the event behind `handle` was reached on the device: a record of it ran
  // after every copy submitted before it in its list.
  uint64_t event_reached(const std::string& handle) const;
  size_t open_ipc_events() const;

  // Faults. The next PinHost returns `s`.
  void FailNextPin(absl::Status s);
  // The `n`-th submission from now (1 = the next one that copies anything) runs its
  // first copy, then fails with `s`: a device error midway through a transfer.
  void FailSubmission(int n, absl::Status s);
  // The next check on the device does not run (as when its result slots are all in
  // use): the copies complete and the caller gets no CRC32C.
  void SkipNextCheck();
  // Between the next check's copies and the check itself, a byte of the checked range
  // changes: another writer into the same memory (a worker computing the chunk there).
  void ChangeTargetBeforeNextCheck();

  // hold_copies: runs the held submissions in order on this thread; returns how many.
  size_t RunPending();
  // hold_copies: runs only the most recently submitted held submission, as a later
  // copy on another stream can finish first. False if none is held.
  bool RunNewest();
  size_t pending() const;
  // Waits until every submission so far has completed (without hold_copies).
  void Drain();

  // Leak and misuse accounting.
  size_t live_allocations() const;
  uint64_t allocated_bytes() const;
  size_t pinned_ranges() const;
  size_t open_ipc_mappings() const;
  uint64_t copies_run() const;
  uint64_t submissions() const;
  uint64_t checks_run() const;  // CRC32C checks run "on the device".
  // Frees of unknown pointers, unpins of unpinned memory, closes of unknown mappings.
  std::vector<std::string> misuse() const;

  // A device allocation's bytes, for checking what landed (test thread only, while no
  // copy into them is in flight).
  char* HostView(DevicePtr p) const { return reinterpret_cast<char*>(p); }

 private:
  struct Job {
    std::vector<DeviceCopy> copies;
    std::function<void(CopiedAndChecked)> done;
    absl::Status fail;  // Injected: fails after the first copy.
    std::optional<std::pair<DevicePtr, uint64_t>> check;  // After the copies.
  };
  void Enqueue(Job job);
  absl::Status CheckDeviceRange(uint64_t addr, uint64_t bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status Check(const DeviceCopy& c) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Run(Job job);
  void Loop();

  const FakeDeviceOptions options_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::unique_ptr<char[]>> blocks_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> block_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<void*, uint64_t> pinned_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, DevicePtr> exported_ ABSL_GUARDED_BY(mu_);
  std::map<DevicePtr, int> open_mappings_ ABSL_GUARDED_BY(mu_);
  struct FakeEvent {
    bool exported = true;  // False once revoked.
    uint64_t reached = 0;
  };
  std::map<std::string, FakeEvent> events_ ABSL_GUARDED_BY(mu_);  // By handle.
  // Open ids (each open a new id) -> handle.
  std::map<uint64_t, std::string> open_events_ ABSL_GUARDED_BY(mu_);
  uint64_t next_event_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Status pin_failure_ ABSL_GUARDED_BY(mu_);
  int fail_in_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fail_status_ ABSL_GUARDED_BY(mu_);
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t copies_run_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t submissions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t checks_run_ ABSL_GUARDED_BY(mu_) = 0;
  bool skip_next_check_ ABSL_GUARDED_BY(mu_) = false;
  bool change_before_next_check_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<crc32c_gf2::Tables> crc_tables_;  // Fixed at construction.
  std::vector<std::string> misuse_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // Last: started once the state above exists.
};

}  // namespace kvtier

#endif  // KVTIER_TESTS_SUPPORT_FAKE_DEVICE_BACKEND_H_
