#include "storage/cuda/cuda_device_backend.h"

#include <cuda.h>  // CUdeviceptr, CUresult: the one driver call, made through the runtime.

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "storage/crc32c_gf2.h"
#include "storage/cuda/cuda_raii.h"
#include "storage/log.h"
#ifdef KVTIER_HAVE_CUDA_KERNELS
#include "storage/cuda/crc32c_kernels.h"
#endif

namespace kvtier {
namespace {

static_assert(DeviceBackend::kDeviceCrcBlockBytes == crc32c_gf2::kBlockBytes);

// The CRC32C tables a lane's checks read: on the host (to finish a result) and on the
// device (for the kernels). Null: no checks on the device.
struct CrcTables {
  const crc32c_gf2::Tables* host = nullptr;
  const crc32c_gf2::Tables* device = nullptr;
};

using CopyDone = std::function<void(DeviceBackend::CopiedAndChecked)>;

// One copy stream and the thread that completes its submissions in order. A
// submission may end with a CRC32C check on the stream (two kernels, then the 4-byte
// result copied into a page-locked slot of this lane), read once the event is reached.
class CopyLane {
 public:
  CopyLane(int device, CudaStream stream, CrcTables crc)
      : device_(device), stream_(std::move(stream)) {
    if (crc.device != nullptr) SetUpChecks(crc);
    thread_ = std::thread([this] { Loop(); });
  }
  ~CopyLane() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  // `check`: the bytes to check after the copies (unset: none).
  struct Check {
    DevicePtr at = 0;
    uint64_t bytes = 0;
  };
  void Submit(std::vector<DeviceCopy> copies, std::optional<Check> check, CopyDone done) {
    Pending p;
    p.done = std::move(done);
    // Enqueueing and queueing for completion under one lock keeps the completion queue
    // in stream order.
    absl::MutexLock lock(&mu_);
    cudaSetDevice(device_);
    p.status = Enqueue(copies);
    bool work = !copies.empty();
    if (check.has_value() && p.status.ok()) work = EnqueueCheck(*check, &p) || work;
    if (work) {
      // Even when enqueueing failed partway, the copies already queued must finish
      // before `done` hears of it: the caller frees their memory on an error.
      absl::StatusOr<CudaEvent> ev = TakeEvent();
      if (ev.ok() && cudaEventRecord(ev->get(), stream_.get()) == cudaSuccess) {
        p.event = *std::move(ev);
      } else {
        if (ev.ok()) spare_events_.push_back(*std::move(ev));
        p.sync_stream = true;
      }
    }
    queue_.push_back(std::move(p));
  }

 private:
  struct Pending {
    std::optional<CudaEvent> event;  // Unset: nothing to wait for (error or no copies).
    bool sync_stream = false;        // No event could be recorded: wait for the stream.
    absl::Status status;             // An error from enqueueing, reported after the wait.
    int crc_slot = -1;               // The check's result slot, or -1: no check.
    uint64_t crc_bytes = 0;
    CopyDone done;
  };

  // Room for the checks' results (one slot per check in flight) and the first kernel's
  // per-64-KiB results (one check at a time: the stream orders them).
  static constexpr int kCrcSlots = 1024;
  static constexpr uint64_t kScratchWords = 1 << 20;  // Chunks up to 64 GiB.

  void SetUpChecks(CrcTables crc) {
    auto scratch = CudaDeviceMemory::Create(kScratchWords * sizeof(uint32_t));
    auto results = CudaDeviceMemory::Create(kCrcSlots * sizeof(uint32_t));
    // Pages of its own: page-locking a range that shares a page with another lane's
    // fails (cudaErrorHostMemoryAlreadyRegistered), as a heap allocation may.
    static_assert(kCrcSlots * sizeof(uint32_t) % 4096 == 0);
    results_host_.reset(static_cast<uint32_t*>(
        std::aligned_alloc(4096, kCrcSlots * sizeof(uint32_t))));
    if (results_host_ == nullptr) return;
    auto pinned = CudaPinnedRange::Create(results_host_.get(), kCrcSlots * sizeof(uint32_t));
    if (!scratch.ok() || !results.ok() || !pinned.ok()) {  // No checks on this lane.
      LogWarning("GPU CRC32C checks: a copy stream has no room for them: ",
                 !scratch.ok() ? scratch.status().message()
                 : !results.ok() ? results.status().message()
                                 : pinned.status().message());
      return;
    }
    scratch_ = *std::move(scratch);
    results_dev_ = *std::move(results);
    results_pinned_ = *std::move(pinned);
    absl::MutexLock lock(&mu_);  // Before the thread starts, but the analysis cannot tell.
    for (int i = kCrcSlots; i-- > 0;) free_slots_.push_back(i);
    crc_ = crc;
  }

  // Enqueues the check of `check` after the copies; false when it could not (no
  // device tables, no free slot, too large, or the launch failed).
  bool EnqueueCheck(const Check& check, Pending* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
#ifdef KVTIER_HAVE_CUDA_KERNELS
    if (crc_.device == nullptr || free_slots_.empty() ||
        check.bytes / crc32c_gf2::kBlockBytes > kScratchWords) {
      return false;
    }
    const int slot = free_slots_.back();
    uint32_t* result = static_cast<uint32_t*>(results_dev_->get()) + slot;
    cudaError_t e = cuda::EnqueueRawCrc32c(stream_.get(), crc_.device,
                                           reinterpret_cast<const void*>(check.at), check.bytes,
                                           static_cast<uint32_t*>(scratch_->get()), result);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(&results_host_[slot], result, sizeof(uint32_t),
                          cudaMemcpyDeviceToHost, stream_.get());
    }
    if (e != cudaSuccess) {
      cudaGetLastError();  // A launch error is not sticky: the copies stand.
      return false;
    }
    free_slots_.pop_back();
    p->crc_slot = slot;
    p->crc_bytes = check.bytes;
    return true;
#else
    return false;
#endif
  }

  // The copies in order, as batches between event records.
  absl::Status Enqueue(const std::vector<DeviceCopy>& copies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t begin = 0;
    while (begin < copies.size()) {
      size_t end = begin;
      while (end < copies.size() && copies[end].kind != CopyKind::kRecordEvent) ++end;
      if (absl::Status s = EnqueueCopies(absl::MakeConstSpan(copies).subspan(begin, end - begin));
          !s.ok()) {
        return s;
      }
      if (end < copies.size()) {
        cudaEvent_t ev = reinterpret_cast<cudaEvent_t>(copies[end].dst);
        if (cudaError_t e = cudaEventRecord(ev, stream_.get()); e != cudaSuccess) {
          return CudaError(e, "cudaEventRecord (a worker's IPC event)");
        }
        ++end;
      }
      begin = end;
    }
    return absl::OkStatus();
  }

  absl::Status EnqueueCopies(absl::Span<const DeviceCopy> copies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (copies.empty()) return absl::OkStatus();
#if CUDART_VERSION >= 13000  // The batch call's signature from CUDA 13 on.
    if (copies.size() > 1 && batch_supported_) {
      std::vector<void*> dsts;
      std::vector<const void*> srcs;
      std::vector<size_t> sizes;
      for (const DeviceCopy& c : copies) {
        dsts.push_back(reinterpret_cast<void*>(c.dst));
        srcs.push_back(reinterpret_cast<const void*>(c.src));
        sizes.push_back(c.bytes);
      }
      cudaMemcpyAttributes attr;
      std::memset(&attr, 0, sizeof(attr));
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
      cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                           copies.size(), &attr, &attr_index, 1,
                                           stream_.get());
      if (e == cudaSuccess) return absl::OkStatus();
      // Not supported (older driver), or a combination the batch call refuses (pageable
      // memory with this access order): one copy at a time, which reports a genuinely
      // bad pointer itself.
      if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) {
        return CudaError(e, "cudaMemcpyBatchAsync");
      }
      cudaGetLastError();  // Clears the non-sticky error.
      if (e == cudaErrorNotSupported) batch_supported_ = false;
    }
#endif
    for (const DeviceCopy& c : copies) {
      cudaError_t e = cudaMemcpyAsync(reinterpret_cast<void*>(c.dst),
                                      reinterpret_cast<const void*>(c.src), c.bytes,
                                      cudaMemcpyDefault, stream_.get());
      if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<CudaEvent> TakeEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!spare_events_.empty()) {
      CudaEvent ev = std::move(spare_events_.back());
      spare_events_.pop_back();
      return ev;
    }
    return CudaEvent::Create();
  }

  void Loop() {
    cudaSetDevice(device_);
    for (;;) {
      Pending p;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](CopyLane* l) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return l->stopping_ || !l->queue_.empty();
            },
            this));
        if (queue_.empty()) return;
        p = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status waited;
      if (p.event) {
        // Blocks this thread only: submissions keep being enqueued meanwhile.
        waited = CudaError(cudaEventSynchronize(p.event->get()), "copy");
        absl::MutexLock lock(&mu_);
        spare_events_.push_back(*std::move(p.event));
      } else if (p.sync_stream) {
        waited = CudaError(cudaStreamSynchronize(stream_.get()), "copy");
      }
      if (p.status.ok()) p.status = waited;
      DeviceBackend::CopiedAndChecked result{std::move(p.status), std::nullopt};
      if (p.crc_slot >= 0) {
        if (result.copy.ok()) {
          result.crc32c = crc32c_gf2::StandardFromRaw(*crc_.host, results_host_[p.crc_slot],
                                                      p.crc_bytes);
        }
        absl::MutexLock lock(&mu_);
        free_slots_.push_back(p.crc_slot);
      }
      p.done(std::move(result));
    }
  }

  const int device_;
  absl::Mutex mu_;
  const CudaStream stream_;  // Fixed for the lane's life.
  bool batch_supported_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<CudaEvent> spare_events_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Checks on the device (set up before the thread starts, fixed after).
  CrcTables crc_;
  std::optional<CudaDeviceMemory> scratch_;
  std::optional<CudaDeviceMemory> results_dev_;
  struct Free {
    void operator()(uint32_t* p) const { std::free(p); }
  };
  // Slot i: written by the stream, read by Loop. Declared before its page-locking.
  std::unique_ptr<uint32_t[], Free> results_host_;
  std::optional<CudaPinnedRange> results_pinned_;
  std::vector<int> free_slots_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // Last: started once the state above exists.
};

class CudaDeviceBackend final : public DeviceBackend {
 public:
  CudaDeviceBackend(int device, std::string description)
      : device_(device), description_(std::move(description)) {}
  ~CudaDeviceBackend() override {
    lanes_.clear();  // Completes every submission first.
    cudaSetDevice(device_);
  }

  // cuMemGetAddressRange, through the runtime's driver entry points (the driver library
  // is loaded by the runtime; kvtier does not link it).
  void LoadDriverCalls() {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      get_address_range_ = reinterpret_cast<GetAddressRange>(fn);
    }
  }

  // The CRC32C tables, on the host and in device memory, for the lanes added after.
  // False: no checks on the device (no kernels in this build, or no memory for them).
  bool SetUpCrcTables() {
#ifdef KVTIER_HAVE_CUDA_KERNELS
    crc_host_ = std::make_unique<crc32c_gf2::Tables>();
    crc32c_gf2::MakeTables(crc_host_.get());
    auto dev = CudaDeviceMemory::Create(sizeof(crc32c_gf2::Tables));
    if (!dev.ok()) {
      crc_unavailable_ = absl::StrCat("no device memory for its tables: ", dev.status().message());
      return false;
    }
    if (cudaError_t e = cudaMemcpy(dev->get(), crc_host_.get(), sizeof(crc32c_gf2::Tables),
                                   cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      crc_unavailable_ = absl::StrCat("copying its tables failed: ", cudaGetErrorString(e));
      return false;
    }
    crc_dev_ = *std::move(dev);
    return true;
#else
    return false;
#endif
  }

  absl::Status AddLane() {
    cudaSetDevice(device_);
    absl::StatusOr<CudaStream> stream = CudaStream::Create();
    if (!stream.ok()) return stream.status();
    CrcTables crc;
    if (crc_dev_.has_value()) {
      crc.host = crc_host_.get();
      crc.device = static_cast<const crc32c_gf2::Tables*>(crc_dev_->get());
    }
    lanes_.push_back(std::make_unique<CopyLane>(device_, *std::move(stream), crc));
    return absl::OkStatus();
  }

  // Checks on the device only once they give the CPU's answer on this GPU: 3 x 64 KiB
  // of a pattern, copied in and checked on every lane. Says once which it is.
  void SelfTestCrc() {
    if (!crc_dev_.has_value()) {
      LogInfo("GPU CRC32C checks: on the CPU (", crc_unavailable_, ")");
      return;
    }
    const uint64_t bytes = 3 * kDeviceCrcBlockBytes;
    std::vector<uint8_t> pattern(bytes);
    for (uint64_t i = 0; i < bytes; ++i) pattern[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
    uint32_t want = 0xffffffffu;
    want = crc32c_gf2::RawExtend(want, pattern.data(), bytes, crc_host_->table) ^ 0xffffffffu;
    absl::StatusOr<DevicePtr> buf = Allocate(bytes);
    if (!buf.ok()) {
      LogWarning("GPU CRC32C checks: on the CPU (no memory to test them: ", buf.status().message(), ")");
      return;
    }
    bool ok = true;
    std::string why;
    for (auto& lane : lanes_) {
      absl::Mutex mu;
      bool done = false;
      CopiedAndChecked got;
      lane->Submit({DeviceCopy::HostToDevice(*buf, pattern.data(), bytes)},
                   CopyLane::Check{*buf, bytes}, [&](CopiedAndChecked r) {
                     absl::MutexLock lock(&mu);
                     got = std::move(r);
                     done = true;
                   });
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&done));
      if (!got.copy.ok() || !got.crc32c.has_value() || *got.crc32c != want) {
        ok = false;
        why = !got.copy.ok() ? std::string(got.copy.message())
              : !got.crc32c.has_value() ? std::string("the check did not run")
                                        : absl::StrFormat("got %08x, want %08x", *got.crc32c, want);
      }
    }
    Free(*buf);
    checks_crc_ = ok;
    if (ok) {
      LogInfo("GPU CRC32C checks: on the GPU (deliveries check what landed)");
    } else {
      LogWarning("GPU CRC32C checks: on the CPU (the GPU's self-test failed: ", why, ")");
    }
  }

  bool ChecksCrc32c() const override { return checks_crc_; }

  void SubmitAndCrc32c(std::vector<DeviceCopy> copies, DevicePtr at, uint64_t bytes,
                       std::function<void(CopiedAndChecked)> done) override {
    const size_t lane = next_lane_.fetch_add(1, std::memory_order_relaxed) % lanes_.size();
    std::optional<CopyLane::Check> check;
    if (checks_crc_) check = CopyLane::Check{at, bytes};
    lanes_[lane]->Submit(std::move(copies), check, std::move(done));
  }

  std::string Describe() const override { return description_; }

  absl::StatusOr<DevicePtr> Allocate(uint64_t bytes) override {
    cudaSetDevice(device_);
    absl::StatusOr<CudaDeviceMemory> mem = CudaDeviceMemory::Create(bytes);
    if (!mem.ok()) return mem.status();
    const DevicePtr p = reinterpret_cast<DevicePtr>(mem->get());
    absl::MutexLock lock(&mu_);
    memory_.emplace(p, *std::move(mem));
    return p;
  }

  void Free(DevicePtr ptr) override {
    cudaSetDevice(device_);
    absl::MutexLock lock(&mu_);
    memory_.erase(ptr);
  }

  absl::Status PinHost(void* p, uint64_t bytes) override {
    cudaSetDevice(device_);
    absl::StatusOr<CudaPinnedRange> pinned = CudaPinnedRange::Create(p, bytes);
    if (!pinned.ok()) return pinned.status();
    absl::MutexLock lock(&mu_);
    pinned_.emplace(p, *std::move(pinned));
    return absl::OkStatus();
  }

  void UnpinHost(void* p) override {
    cudaSetDevice(device_);
    absl::MutexLock lock(&mu_);
    pinned_.erase(p);
  }

  void Submit(std::vector<DeviceCopy> copies, std::function<void(absl::Status)> done) override {
    const size_t lane = next_lane_.fetch_add(1, std::memory_order_relaxed) % lanes_.size();
    lanes_[lane]->Submit(std::move(copies), std::nullopt,
                         [done = std::move(done)](CopiedAndChecked r) { done(std::move(r.copy)); });
  }

  absl::StatusOr<IpcMemory> OpenIpcMemory(absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("an IPC memory handle is ",
                                                     sizeof(cudaIpcMemHandle_t),
                                                     " bytes, got ", handle.size()));
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaSetDevice(device_);
    absl::StatusOr<CudaIpcMapping> mapping = CudaIpcMapping::Open(h);
    if (!mapping.ok()) return mapping.status();
    const DevicePtr p = reinterpret_cast<DevicePtr>(mapping->get());
    // The allocation's real size, from the driver (the runtime has no call for it).
    CUdeviceptr base = 0;
    size_t size = 0;
    if (get_address_range_ == nullptr) {
      return absl::UnavailableError("cuMemGetAddressRange is not available from the driver");
    }
    if (CUresult r = get_address_range_(&base, &size, static_cast<CUdeviceptr>(p));
        r != CUDA_SUCCESS || base != p) {
      return absl::InvalidArgumentError(absl::StrCat(
          "IPC memory: cannot tell the mapped allocation's size (CUresult ", r,
          "), or the handle is not of an allocation's start"));
    }
    absl::MutexLock lock(&mu_);
    // Opening a handle this context already opened returns the same address (CUDA counts
    // the opens): keep every open, and close one per CloseIpcMemory.
    ipc_[p].push_back(*std::move(mapping));
    return IpcMemory{p, size};
  }

  void CloseIpcMemory(DevicePtr base) override {
    cudaSetDevice(device_);
    absl::MutexLock lock(&mu_);
    auto it = ipc_.find(base);
    if (it == ipc_.end()) return;
    it->second.pop_back();
    if (it->second.empty()) ipc_.erase(it);
  }

  absl::StatusOr<uint64_t> OpenIpcEvent(absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("an IPC event handle is ",
                                                     sizeof(cudaIpcEventHandle_t),
                                                     " bytes, got ", handle.size()));
    }
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaSetDevice(device_);
    absl::StatusOr<CudaEvent> ev = CudaEvent::OpenIpc(h);
    if (!ev.ok()) return ev.status();
    const uint64_t id = reinterpret_cast<uint64_t>(ev->get());
    absl::MutexLock lock(&mu_);
    events_[id].push_back(*std::move(ev));
    return id;
  }

  void CloseIpcEvent(uint64_t event) override {
    cudaSetDevice(device_);
    absl::MutexLock lock(&mu_);
    auto it = events_.find(event);
    if (it == events_.end()) return;
    it->second.pop_back();
    if (it->second.empty()) events_.erase(it);
  }

 private:
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

  const int device_;
  const std::string description_;
  GetAddressRange get_address_range_ = nullptr;  // Set once, before the backend is shared.
  // The CRC32C tables (before the lanes, which read them, and outliving them).
  std::unique_ptr<crc32c_gf2::Tables> crc_host_;
  std::optional<CudaDeviceMemory> crc_dev_;
  bool checks_crc_ = false;  // Set once by SelfTestCrc, before the backend is shared.
  std::string crc_unavailable_ = "this build has no GPU kernels";  // Why not, if not.
  std::vector<std::unique_ptr<CopyLane>> lanes_;  // Fixed after OpenCudaBackend.
  std::atomic<uint64_t> next_lane_{0};
  absl::Mutex mu_;
  absl::flat_hash_map<DevicePtr, CudaDeviceMemory> memory_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, CudaPinnedRange> pinned_ ABSL_GUARDED_BY(mu_);
  // Every open of each base address (the same handle opened twice maps once).
  absl::flat_hash_map<DevicePtr, std::vector<CudaIpcMapping>> ipc_ ABSL_GUARDED_BY(mu_);
  // Workers' events by id (their address here), every open of each, as ipc_.
  absl::flat_hash_map<uint64_t, std::vector<CudaEvent>> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status CudaBackendOptions::Validate() const {
  if (device < 0) return absl::InvalidArgumentError("gpu device must be >= 0");
  if (copy_streams < 1) return absl::InvalidArgumentError("gpu copy_streams must be >= 1");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> OpenCudaBackend(const CudaBackendOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return CudaError(e, "cudaGetDeviceCount");
  }
  if (options.device >= count) {
    return absl::NotFoundError(absl::StrCat("no CUDA device ", options.device, " (", count,
                                            " present)"));
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return CudaError(e, "cudaSetDevice");
  }
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, options.device); e != cudaSuccess) {
    return CudaError(e, "cudaGetDeviceProperties");
  }
  auto backend = std::make_unique<CudaDeviceBackend>(
      options.device, absl::StrFormat("%s (device %d, %.1f GiB)", prop.name, options.device,
                                      prop.totalGlobalMem / double(1ull << 30)));
  backend->LoadDriverCalls();
  backend->SetUpCrcTables();
  for (int i = 0; i < options.copy_streams; ++i) {
    if (absl::Status s = backend->AddLane(); !s.ok()) return s;
  }
  backend->SelfTestCrc();
  return backend;
}

}  // namespace kvtier
