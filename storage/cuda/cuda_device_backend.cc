#include "storage/cuda/cuda_device_backend.h"

#include <cuda.h>  // CUdeviceptr, CUresult: the one driver call, made through the runtime.

#include <atomic>
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
#include "storage/cuda/cuda_raii.h"

namespace kvtier {
namespace {

// One copy stream and the thread that completes its submissions in order.
class CopyLane {
 public:
  CopyLane(int device, CudaStream stream) : device_(device), stream_(std::move(stream)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~CopyLane() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  void Submit(std::vector<DeviceCopy> copies, std::function<void(absl::Status)> done) {
    Pending p;
    p.done = std::move(done);
    // Enqueueing and queueing for completion under one lock keeps the completion queue
    // in stream order.
    absl::MutexLock lock(&mu_);
    cudaSetDevice(device_);
    p.status = Enqueue(copies);
    if (!copies.empty()) {
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
    std::function<void(absl::Status)> done;
  };

  absl::Status Enqueue(const std::vector<DeviceCopy>& copies)
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
      p.done(std::move(p.status));
    }
  }

  const int device_;
  absl::Mutex mu_;
  const CudaStream stream_;  // Fixed for the lane's life.
  bool batch_supported_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<CudaEvent> spare_events_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
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

  absl::Status AddLane() {
    cudaSetDevice(device_);
    absl::StatusOr<CudaStream> stream = CudaStream::Create();
    if (!stream.ok()) return stream.status();
    lanes_.push_back(std::make_unique<CopyLane>(device_, *std::move(stream)));
    return absl::OkStatus();
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
    lanes_[lane]->Submit(std::move(copies), std::move(done));
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

 private:
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

  const int device_;
  const std::string description_;
  GetAddressRange get_address_range_ = nullptr;  // Set once, before the backend is shared.
  std::vector<std::unique_ptr<CopyLane>> lanes_;  // Fixed after OpenCudaBackend.
  std::atomic<uint64_t> next_lane_{0};
  absl::Mutex mu_;
  absl::flat_hash_map<DevicePtr, CudaDeviceMemory> memory_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, CudaPinnedRange> pinned_ ABSL_GUARDED_BY(mu_);
  // Every open of each base address (the same handle opened twice maps once).
  absl::flat_hash_map<DevicePtr, std::vector<CudaIpcMapping>> ipc_ ABSL_GUARDED_BY(mu_);
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
  for (int i = 0; i < options.copy_streams; ++i) {
    if (absl::Status s = backend->AddLane(); !s.ok()) return s;
  }
  return backend;
}

}  // namespace kvtier
