#include "tests/support/fault_injection_fs.h"

#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/time/clock.h"

namespace kvtier::testing {
namespace {

using rocksdb::IODebugContext;
using rocksdb::IOOptions;
using rocksdb::IOStatus;
using rocksdb::Slice;

IOStatus NoSpace(FaultInjectionFs::State& state, const char* what) {
  state.no_space_errors.fetch_add(1, std::memory_order_relaxed);
  return IOStatus::NoSpace(what, "injected by FaultInjectionFs");
}

// Writes fail while the file system's no-space fault is armed, whenever the file was
// opened.
class FaultWritableFile : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  FaultWritableFile(std::unique_ptr<rocksdb::FSWritableFile> target,
                    std::shared_ptr<FaultInjectionFs::State> state, bool is_wal)
      : FSWritableFileOwnerWrapper(std::move(target)), state_(std::move(state)), is_wal_(is_wal) {}

  IOStatus Append(const Slice& data, const IOOptions& options, IODebugContext* dbg) override {
    MaybeDelay();
    if (Full()) return NoSpace(*state_, "Append");
    return FSWritableFileOwnerWrapper::Append(data, options, dbg);
  }
  IOStatus Append(const Slice& data, const IOOptions& options,
                  const rocksdb::DataVerificationInfo& info, IODebugContext* dbg) override {
    MaybeDelay();
    if (Full()) return NoSpace(*state_, "Append");
    return FSWritableFileOwnerWrapper::Append(data, options, info, dbg);
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            IODebugContext* dbg) override {
    if (Full()) return NoSpace(*state_, "PositionedAppend");
    return FSWritableFileOwnerWrapper::PositionedAppend(data, offset, options, dbg);
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            const rocksdb::DataVerificationInfo& info,
                            IODebugContext* dbg) override {
    if (Full()) return NoSpace(*state_, "PositionedAppend");
    return FSWritableFileOwnerWrapper::PositionedAppend(data, offset, options, info, dbg);
  }

 private:
  bool Full() const { return state_->no_space.load(std::memory_order_relaxed); }
  void MaybeDelay() {
    if (!is_wal_) return;
    const int64_t us = state_->wal_delay_us.load(std::memory_order_relaxed);
    if (us <= 0) return;
    state_->wal_appends_in_flight.fetch_add(1, std::memory_order_release);
    absl::SleepFor(absl::Microseconds(us));
    state_->wal_appends_in_flight.fetch_sub(1, std::memory_order_release);
  }

  const std::shared_ptr<FaultInjectionFs::State> state_;
  const bool is_wal_;
};

// Reads of a blob file come back with one byte flipped while the corrupt-reads fault is
// armed.
class FaultRandomAccessFile : public rocksdb::FSRandomAccessFileOwnerWrapper {
 public:
  FaultRandomAccessFile(std::unique_ptr<rocksdb::FSRandomAccessFile> target,
                        std::shared_ptr<FaultInjectionFs::State> state)
      : FSRandomAccessFileOwnerWrapper(std::move(target)), state_(std::move(state)) {}

  IOStatus Read(uint64_t offset, size_t n, const IOOptions& options, Slice* result, char* scratch,
                IODebugContext* dbg) const override {
    IOStatus s = FSRandomAccessFileOwnerWrapper::Read(offset, n, options, result, scratch, dbg);
    if (s.ok()) MaybeCorrupt(*result, scratch);
    return s;
  }

  IOStatus MultiRead(rocksdb::FSReadRequest* reqs, size_t num_reqs, const IOOptions& options,
                     IODebugContext* dbg) override {
    IOStatus s = FSRandomAccessFileOwnerWrapper::MultiRead(reqs, num_reqs, options, dbg);
    if (!s.ok()) return s;
    for (size_t i = 0; i < num_reqs; ++i) {
      if (reqs[i].status.ok()) MaybeCorrupt(reqs[i].result, reqs[i].scratch);
    }
    return s;
  }

  // The wrapper would forward to the target's ReadAsync and bypass Read; read
  // synchronously through Read instead so async reads are corrupted too.
  IOStatus ReadAsync(rocksdb::FSReadRequest& req, const IOOptions& opts,
                     std::function<void(const rocksdb::FSReadRequest&, void*)> cb, void* cb_arg,
                     void** /*io_handle*/, rocksdb::IOHandleDeleter* /*del_fn*/,
                     IODebugContext* dbg) override {
    req.status = Read(req.offset, req.len, opts, &req.result, req.scratch, dbg);
    cb(req, cb_arg);
    return IOStatus::OK();
  }

 private:
  void MaybeCorrupt(Slice& result, char* scratch) const {
    if (!state_->corrupt_reads.load(std::memory_order_relaxed) || result.empty() ||
        scratch == nullptr) {
      return;
    }
    // The result may point into the file's own buffer (mmap reads); flip the byte in a
    // copy in the caller's scratch, which is at least n bytes.
    if (result.data() != scratch) {
      std::memmove(scratch, result.data(), result.size());
      result = Slice(scratch, result.size());
    }
    size_t at;
    uint8_t mask;
    {
      absl::MutexLock lock(&state_->rng_mu);
      at = static_cast<size_t>(state_->rng() % result.size());
      mask = static_cast<uint8_t>(1u << (state_->rng() % 8));
    }
    scratch[at] = static_cast<char>(static_cast<uint8_t>(scratch[at]) ^ mask);
    state_->corrupted_reads.fetch_add(1, std::memory_order_relaxed);
  }

  const std::shared_ptr<FaultInjectionFs::State> state_;
};

bool IsWal(const std::string& fname) { return absl::EndsWith(fname, ".log"); }

}  // namespace

FaultInjectionFs::FaultInjectionFs(uint64_t seed)
    : FileSystemWrapper(rocksdb::FileSystem::Default()), state_(std::make_shared<State>(seed)) {}

IOStatus FaultInjectionFs::CheckCreate(const std::string& fname) {
  if (state_->no_space.load(std::memory_order_relaxed)) {
    return NoSpace(*state_, fname.c_str());
  }
  return IOStatus::OK();
}

IOStatus FaultInjectionFs::NewWritableFile(const std::string& fname,
                                           const rocksdb::FileOptions& file_opts,
                                           std::unique_ptr<rocksdb::FSWritableFile>* result,
                                           IODebugContext* dbg) {
  if (IOStatus s = CheckCreate(fname); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  IOStatus s = target()->NewWritableFile(fname, file_opts, &file, dbg);
  if (s.ok()) *result = std::make_unique<FaultWritableFile>(std::move(file), state_, IsWal(fname));
  return s;
}

IOStatus FaultInjectionFs::ReopenWritableFile(const std::string& fname,
                                              const rocksdb::FileOptions& file_opts,
                                              std::unique_ptr<rocksdb::FSWritableFile>* result,
                                              IODebugContext* dbg) {
  if (IOStatus s = CheckCreate(fname); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  IOStatus s = target()->ReopenWritableFile(fname, file_opts, &file, dbg);
  if (s.ok()) *result = std::make_unique<FaultWritableFile>(std::move(file), state_, IsWal(fname));
  return s;
}

IOStatus FaultInjectionFs::ReuseWritableFile(const std::string& fname, const std::string& old_fname,
                                             const rocksdb::FileOptions& file_opts,
                                             std::unique_ptr<rocksdb::FSWritableFile>* result,
                                             IODebugContext* dbg) {
  if (IOStatus s = CheckCreate(fname); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  IOStatus s = target()->ReuseWritableFile(fname, old_fname, file_opts, &file, dbg);
  if (s.ok()) *result = std::make_unique<FaultWritableFile>(std::move(file), state_, IsWal(fname));
  return s;
}

IOStatus FaultInjectionFs::GetFreeSpace(const std::string& path, const IOOptions& options,
                                        uint64_t* diskfree, IODebugContext* dbg) {
  if (state_->no_space.load(std::memory_order_relaxed)) {
    *diskfree = 0;
    return IOStatus::OK();
  }
  return target()->GetFreeSpace(path, options, diskfree, dbg);
}

IOStatus FaultInjectionFs::NewRandomAccessFile(const std::string& fname,
                                               const rocksdb::FileOptions& file_opts,
                                               std::unique_ptr<rocksdb::FSRandomAccessFile>* result,
                                               IODebugContext* dbg) {
  std::unique_ptr<rocksdb::FSRandomAccessFile> file;
  IOStatus s = target()->NewRandomAccessFile(fname, file_opts, &file, dbg);
  if (!s.ok()) return s;
  if (absl::EndsWith(fname, ".blob")) {
    *result = std::make_unique<FaultRandomAccessFile>(std::move(file), state_);
  } else {
    *result = std::move(file);
  }
  return s;
}

}  // namespace kvtier::testing
