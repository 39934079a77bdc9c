#include "tests/support/fake_device_backend.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

constexpr absl::string_view kHandleMagic = "kvtier-fake-ipc:";
constexpr absl::string_view kEventMagic = "kvtier-fake-event:";

}  // namespace

FakeDeviceBackend::FakeDeviceBackend(FakeDeviceOptions options)
    : options_(options), crc_tables_(std::make_unique<crc32c_gf2::Tables>()) {
  crc32c_gf2::MakeTables(crc_tables_.get());
  if (!options_.hold_copies) thread_ = std::thread([this] { Loop(); });
}

FakeDeviceBackend::~FakeDeviceBackend() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<DevicePtr> FakeDeviceBackend::Allocate(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes == 0) return absl::InvalidArgumentError("zero-byte device allocation");
  if (allocated_ + bytes > options_.memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of device memory: ", bytes, " bytes wanted, ",
        options_.memory_bytes - allocated_, " free"));
  }
  auto block = std::make_unique<char[]>(bytes);
  const DevicePtr p = reinterpret_cast<DevicePtr>(block.get());
  blocks_.emplace(p, std::move(block));
  block_bytes_.emplace(p, bytes);
  allocated_ += bytes;
  return p;
}

void FakeDeviceBackend::Free(DevicePtr ptr) {
  absl::MutexLock lock(&mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) {
    misuse_.push_back(absl::StrCat("free of unknown device pointer ", ptr));
    return;
  }
  allocated_ -= block_bytes_.at(ptr);
  block_bytes_.erase(ptr);
  blocks_.erase(it);
}

absl::Status FakeDeviceBackend::PinHost(void* p, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!pin_failure_.ok()) return std::exchange(pin_failure_, absl::OkStatus());
  if (!pinned_.emplace(p, bytes).second) {
    misuse_.push_back("host range pinned twice");
  }
  return absl::OkStatus();
}

void FakeDeviceBackend::UnpinHost(void* p) {
  absl::MutexLock lock(&mu_);
  if (pinned_.erase(p) == 0) misuse_.push_back("unpin of host memory never pinned");
}

absl::Status FakeDeviceBackend::CheckDeviceRange(uint64_t addr, uint64_t bytes) const {
  auto it = block_bytes_.upper_bound(addr);
  if (it != block_bytes_.begin()) {
    --it;
    const uint64_t base = it->first;
    if (addr - base <= it->second && bytes <= it->second - (addr - base)) {
      // Memory another process exported is addressable only through an open mapping.
      bool foreign = false;
      for (const auto& [handle, p] : exported_) foreign |= (p == base);
      auto m = open_mappings_.find(base);
      const bool mapped = m != open_mappings_.end() && m->second > 0;
      if ((foreign || m != open_mappings_.end()) && !mapped) {
        return absl::InvalidArgumentError(
            absl::StrCat("device address ", addr, " is another process's memory, not mapped"));
      }
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device range [", addr, ", +", bytes, ") is not allocated"));
}

absl::Status FakeDeviceBackend::Check(const DeviceCopy& c) const {
  if (c.kind == CopyKind::kRecordEvent) {
    if (!open_events_.contains(c.dst)) {
      return absl::InvalidArgumentError(absl::StrCat("event ", c.dst, " is not open"));
    }
    return absl::OkStatus();
  }
  if (c.kind != CopyKind::kHostToDevice) {
    if (absl::Status s = CheckDeviceRange(c.src, c.bytes); !s.ok()) return s;
  } else if (c.src == 0) {
    return absl::InvalidArgumentError("null host source");
  }
  if (c.kind != CopyKind::kDeviceToHost) {
    if (absl::Status s = CheckDeviceRange(c.dst, c.bytes); !s.ok()) return s;
  } else if (c.dst == 0) {
    return absl::InvalidArgumentError("null host destination");
  }
  return absl::OkStatus();
}

void FakeDeviceBackend::Submit(std::vector<DeviceCopy> copies,
                               std::function<void(absl::Status)> done) {
  Enqueue(Job{std::move(copies),
              [done = std::move(done)](CopiedAndChecked r) { done(std::move(r.copy)); },
              absl::OkStatus(), std::nullopt});
}

void FakeDeviceBackend::SubmitAndCrc32c(std::vector<DeviceCopy> copies, DevicePtr at,
                                        uint64_t bytes,
                                        std::function<void(CopiedAndChecked)> done) {
  std::optional<std::pair<DevicePtr, uint64_t>> check;
  if (options_.checks_crc32c) check.emplace(at, bytes);
  Enqueue(Job{std::move(copies), std::move(done), absl::OkStatus(), check});
}

void FakeDeviceBackend::SkipNextCheck() {
  absl::MutexLock lock(&mu_);
  skip_next_check_ = true;
}

void FakeDeviceBackend::ChangeTargetBeforeNextCheck() {
  absl::MutexLock lock(&mu_);
  change_before_next_check_ = true;
}

uint64_t FakeDeviceBackend::checks_run() const {
  absl::MutexLock lock(&mu_);
  return checks_run_;
}

void FakeDeviceBackend::Enqueue(Job job) {
  absl::MutexLock lock(&mu_);
  if (job.check.has_value() && skip_next_check_) {
    skip_next_check_ = false;
    job.check.reset();
  }
  if (!job.copies.empty()) {
    ++submissions_;
    if (fail_in_ > 0 && --fail_in_ == 0) job.fail = fail_status_;
  }
  queue_.push_back(std::move(job));
}

void FakeDeviceBackend::Run(Job job) {
  absl::Status status;
  for (size_t i = 0; i < job.copies.size(); ++i) {
    const DeviceCopy& c = job.copies[i];
    {
      // Checked when the copy runs, as the device would fault: memory freed between
      // submission and execution is a use after free.
      absl::MutexLock lock(&mu_);
      status = Check(c);
      if (status.ok() && c.kind == CopyKind::kRecordEvent) {
        ++events_[open_events_.at(c.dst)].reached;
        continue;
      }
      if (status.ok()) ++copies_run_;
    }
    if (!status.ok()) break;
    std::memcpy(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src), c.bytes);
    if (!job.fail.ok()) {
      status = job.fail;
      break;
    }
  }
  CopiedAndChecked result{status, std::nullopt};
  if (status.ok() && job.check.has_value()) {
    const auto [at, bytes] = *job.check;
    bool change = false;
    {
      absl::MutexLock lock(&mu_);
      status = CheckDeviceRange(at, bytes);
      change = std::exchange(change_before_next_check_, false);
    }
    if (!status.ok() || at % 16 != 0 || bytes == 0 || bytes % crc32c_gf2::kBlockBytes != 0) {
      absl::MutexLock lock(&mu_);
      misuse_.push_back(absl::StrCat("a check of [", at, ", +", bytes, ") the device refuses"));
    } else {
      if (change) HostView(at)[bytes / 2] ^= 0x20;
      {
        absl::MutexLock lock(&mu_);
        ++checks_run_;
      }
      const uint32_t raw = crc32c_gf2::RawCrcLikeTheGpu(
          *crc_tables_, reinterpret_cast<const uint8_t*>(at), bytes);
      result.crc32c = crc32c_gf2::StandardFromRaw(*crc_tables_, raw, bytes);
    }
  }
  job.done(std::move(result));
}

void FakeDeviceBackend::Loop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](FakeDeviceBackend* b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return b->stopping_ || !b->queue_.empty();
          },
          this));
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    Run(std::move(job));
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

size_t FakeDeviceBackend::RunPending() {
  size_t n = 0;
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      if (queue_.empty()) return n;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(std::move(job));
    ++n;
  }
}

bool FakeDeviceBackend::RunNewest() {
  Job job;
  {
    absl::MutexLock lock(&mu_);
    if (queue_.empty()) return false;
    job = std::move(queue_.back());
    queue_.pop_back();
  }
  Run(std::move(job));
  return true;
}

size_t FakeDeviceBackend::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void FakeDeviceBackend::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](FakeDeviceBackend* b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return b->queue_.empty() && b->running_ == 0;
      },
      this));
}

absl::StatusOr<std::string> FakeDeviceBackend::ExportIpcMemory(DevicePtr base) {
  absl::MutexLock lock(&mu_);
  if (!blocks_.contains(base)) return absl::InvalidArgumentError("not an allocation's base");
  std::string handle = absl::StrCat(kHandleMagic, next_handle_++);
  handle.resize(kIpcHandleBytes, '\0');
  exported_.emplace(handle, base);
  return handle;
}

void FakeDeviceBackend::RevokeIpcMemory(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  exported_.erase(handle);
}

absl::StatusOr<DeviceBackend::IpcMemory> FakeDeviceBackend::OpenIpcMemory(
    absl::string_view handle) {
  absl::MutexLock lock(&mu_);
  if (handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("an IPC memory handle is ", kIpcHandleBytes,
                                                   " bytes, got ", handle.size()));
  }
  auto it = exported_.find(std::string(handle));
  if (it == exported_.end()) {
    return absl::InvalidArgumentError("stale or foreign IPC memory handle");
  }
  ++open_mappings_[it->second];
  return IpcMemory{it->second, block_bytes_.at(it->second)};
}

void FakeDeviceBackend::CloseIpcMemory(DevicePtr base) {
  absl::MutexLock lock(&mu_);
  auto it = open_mappings_.find(base);
  if (it == open_mappings_.end() || it->second == 0) {
    misuse_.push_back(absl::StrCat("close of unmapped IPC memory ", base));
    return;
  }
  --it->second;
}

std::string FakeDeviceBackend::ExportIpcEvent() {
  absl::MutexLock lock(&mu_);
  std::string handle = absl::StrCat(kEventMagic, next_handle_++);
  handle.resize(kIpcHandleBytes, '\0');
  events_.emplace(handle, FakeEvent{});
  return handle;
}

void FakeDeviceBackend::RevokeIpcEvent(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  auto it = events_.find(handle);
  if (it != events_.end()) it->second.exported = false;
}

uint64_t FakeDeviceBackend::event_reached(const std::string& handle) const {
  absl::MutexLock lock(&mu_);
  auto it = events_.find(handle);
  return it == events_.end() ? 0 : it->second.reached;
}

size_t FakeDeviceBackend::open_ipc_events() const {
  absl::MutexLock lock(&mu_);
  return open_events_.size();
}

absl::StatusOr<uint64_t> FakeDeviceBackend::OpenIpcEvent(absl::string_view handle) {
  absl::MutexLock lock(&mu_);
  if (handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("an IPC event handle is ", kIpcHandleBytes,
                                                   " bytes, got ", handle.size()));
  }
  auto it = events_.find(std::string(handle));
  if (it == events_.end() || !it->second.exported) {
    return absl::InvalidArgumentError("stale or foreign IPC event handle");
  }
  const uint64_t id = next_event_id_++;
  open_events_.emplace(id, it->first);
  return id;
}

void FakeDeviceBackend::CloseIpcEvent(uint64_t event) {
  absl::MutexLock lock(&mu_);
  if (open_events_.erase(event) == 0) {
    misuse_.push_back(absl::StrCat("close of unopened IPC event ", event));
  }
}

void FakeDeviceBackend::FailNextPin(absl::Status s) {
  absl::MutexLock lock(&mu_);
  pin_failure_ = std::move(s);
}

void FakeDeviceBackend::FailSubmission(int n, absl::Status s) {
  absl::MutexLock lock(&mu_);
  fail_in_ = n;
  fail_status_ = std::move(s);
}

size_t FakeDeviceBackend::live_allocations() const {
  absl::MutexLock lock(&mu_);
  return blocks_.size();
}

uint64_t FakeDeviceBackend::allocated_bytes() const {
  absl::MutexLock lock(&mu_);
  return allocated_;
}

size_t FakeDeviceBackend::pinned_ranges() const {
  absl::MutexLock lock(&mu_);
  return pinned_.size();
}

size_t FakeDeviceBackend::open_ipc_mappings() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [base, count] : open_mappings_) n += count;
  return n;
}

uint64_t FakeDeviceBackend::copies_run() const {
  absl::MutexLock lock(&mu_);
  return copies_run_;
}

uint64_t FakeDeviceBackend::submissions() const {
  absl::MutexLock lock(&mu_);
  return submissions_;
}

std::vector<std::string> FakeDeviceBackend::misuse() const {
  absl::MutexLock lock(&mu_);
  return misuse_;
}

}  // namespace kvtier
