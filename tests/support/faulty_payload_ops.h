// FaultyPayloadOps: the payload files' system calls, with faults a test switches on: a
// full disk (writes fail with ENOSPC), corrupted reads (one byte of every read flipped,
// the bytes on disk left intact), reads that fail with an errno (EIO: a bad sector), and
// failing syncs, of files or of the directory, and a file system with little free space
// (StatVfs reports what the test says). A fake, not a mock: with no fault
// on it does the real I/O.
#ifndef KVTIER_TESTS_SUPPORT_FAULTY_PAYLOAD_OPS_H_
#define KVTIER_TESTS_SUPPORT_FAULTY_PAYLOAD_OPS_H_

#include <cerrno>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "storage/payload_log.h"

namespace kvtier::testing {

class FaultyPayloadOps : public PayloadFileOps {
 public:
  void SetNoSpace(bool on) { no_space_.store(on); }
  // Writes fail with ENOSPC once this many more bytes were written (each write is
  // allowed whole or refused whole).
  void FailWritesAfter(uint64_t bytes) { budget_.store(static_cast<int64_t>(bytes)); }
  void SetCorruptReads(bool on) { corrupt_reads_.store(on); }
  // The next read only is corrupted, and `before` (may be null) runs first, on the
  // reading thread, before the bytes are read: a test's way to change the store under a
  // read in flight.
  void CorruptNextRead(std::function<void()> before) {
    absl::MutexLock lock(&hook_mu_);
    next_read_hook_ = std::move(before);
    corrupt_next_ = true;
  }
  // `before` runs on the reading thread before the next read's bytes are read, which is
  // not corrupted: a test's way to race the store against a read in flight.
  void BeforeNextRead(std::function<void()> before) {
    absl::MutexLock lock(&hook_mu_);
    next_read_hook_ = std::move(before);
  }
  // `before` runs on the writing thread before the next write's bytes are written: a
  // test's way to hold one write (by blocking in it) while others go ahead.
  void BeforeNextWrite(std::function<void()> before) {
    absl::MutexLock lock(&hook_mu_);
    next_write_hook_ = std::move(before);
  }
  void SetFailSync(bool on) { fail_sync_.store(on); }
  // Reads fail with this errno; 0 turns it off.
  void SetReadError(int err) { read_error_.store(err); }
  void SetFailSyncDir(bool on) { fail_sync_dir_.store(on); }
  // Unlinks fail with EIO while on.
  void SetFailUnlink(bool on) { fail_unlink_.store(on); }
  // StatVfs reports this many bytes free (nullopt, the default: the real figure).
  void SetFreeBytes(std::optional<uint64_t> bytes) {
    absl::MutexLock lock(&hook_mu_);
    free_bytes_ = bytes;
  }
  // StatVfs reports a file system of `bytes` holding only the files under `dir` (their
  // real sizes, summed at each call): a small disk the store fills itself. nullopt: off.
  void SetDiskOf(const std::string& dir, std::optional<uint64_t> bytes) {
    absl::MutexLock lock(&hook_mu_);
    disk_dir_ = dir;
    disk_bytes_ = bytes;
  }
  uint64_t dir_syncs() const { return dir_syncs_.load(); }
  uint64_t no_space_errors() const { return no_space_errors_.load(); }
  uint64_t corrupted_reads() const { return corrupted_reads_.load(); }
  uint64_t bytes_written() const { return bytes_written_.load(); }
  // While held, writes wait (in PWrite) until ReleaseWrites; held_bytes() is what they
  // carry. For tests that need writes to be in flight at once.
  void HoldWrites() {
    absl::MutexLock lock(&hold_mu_);
    hold_ = true;
  }
  void ReleaseWrites() {
    absl::MutexLock lock(&hold_mu_);
    hold_ = false;
  }
  // Blocks until writes waiting in PWrite carry at least `bytes`; false if that has not
  // happened within a minute (a test's failure, not its timing).
  bool WaitForHeldBytes(uint64_t bytes) {
    absl::MutexLock lock(&hold_mu_);
    const auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hold_mu_) { return held_ >= bytes; };
    return hold_mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Minutes(1));
  }

  ssize_t PWrite(int fd, const void* buf, size_t n, off_t offset) override {
    std::function<void()> before;
    {
      absl::MutexLock lock(&hook_mu_);
      before = std::exchange(next_write_hook_, nullptr);
    }
    if (before) before();
    {
      absl::MutexLock lock(&hold_mu_);
      held_ += n;
      const auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hold_mu_) { return !hold_; };
      hold_mu_.Await(absl::Condition(&released));
      held_ -= n;
    }
    if (no_space_.load() || budget_.fetch_sub(static_cast<int64_t>(n)) < static_cast<int64_t>(n)) {
      no_space_errors_.fetch_add(1);
      errno = ENOSPC;
      return -1;
    }
    const ssize_t w = PayloadFileOps::PWrite(fd, buf, n, offset);
    if (w > 0) bytes_written_.fetch_add(static_cast<uint64_t>(w));
    return w;
  }
  ssize_t PRead(int fd, void* buf, size_t n, off_t offset) override {
    if (const int err = read_error_.load(); err != 0) {
      errno = err;
      return -1;
    }
    bool corrupt_this = false;
    std::function<void()> before;
    {
      absl::MutexLock lock(&hook_mu_);
      corrupt_this = std::exchange(corrupt_next_, false);
      before = std::exchange(next_read_hook_, nullptr);
    }
    if (before) before();
    const ssize_t r = PayloadFileOps::PRead(fd, buf, n, offset);
    if (r > 0 && (corrupt_reads_.load() || corrupt_this)) {
      static_cast<char*>(buf)[r / 2] ^= 0x5a;
      corrupted_reads_.fetch_add(1);
    }
    return r;
  }
  int DataSync(int fd) override {
    if (fail_sync_.load()) {
      errno = EIO;
      return -1;
    }
    return PayloadFileOps::DataSync(fd);
  }
  int Unlink(const std::string& path) override {
    if (fail_unlink_.load()) {
      errno = EIO;
      return -1;
    }
    return PayloadFileOps::Unlink(path);
  }
  int SyncDir(const std::string& dir) override {
    if (fail_sync_dir_.load()) {
      errno = EIO;
      return -1;
    }
    const int r = PayloadFileOps::SyncDir(dir);
    if (r == 0) dir_syncs_.fetch_add(1);
    return r;
  }
  int StatVfs(const std::string& path, struct statvfs* out) override {
    const int r = PayloadFileOps::StatVfs(path, out);
    absl::MutexLock lock(&hook_mu_);
    if (r == 0 && free_bytes_.has_value()) {
      out->f_frsize = 4096;
      out->f_bavail = *free_bytes_ / 4096;
    }
    if (r == 0 && disk_bytes_.has_value()) {
      uint64_t used = 0;
      std::error_code ec;
      for (auto it = std::filesystem::recursive_directory_iterator(disk_dir_, ec);
           !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
        std::error_code size_ec;  // A file deleted meanwhile counts nothing.
        if (it->is_regular_file(size_ec)) {
          const uintmax_t n = it->file_size(size_ec);
          if (!size_ec) used += n;
        }
      }
      out->f_frsize = 1;
      out->f_bavail = *disk_bytes_ > used ? *disk_bytes_ - used : 0;
    }
    return r;
  }

 private:
  absl::Mutex hook_mu_;
  bool corrupt_next_ ABSL_GUARDED_BY(hook_mu_) = false;
  std::function<void()> next_read_hook_ ABSL_GUARDED_BY(hook_mu_);
  std::function<void()> next_write_hook_ ABSL_GUARDED_BY(hook_mu_);
  std::optional<uint64_t> free_bytes_ ABSL_GUARDED_BY(hook_mu_);
  std::string disk_dir_ ABSL_GUARDED_BY(hook_mu_);
  std::optional<uint64_t> disk_bytes_ ABSL_GUARDED_BY(hook_mu_);
  absl::Mutex hold_mu_;
  bool hold_ ABSL_GUARDED_BY(hold_mu_) = false;
  uint64_t held_ ABSL_GUARDED_BY(hold_mu_) = 0;
  std::atomic<bool> no_space_{false};
  std::atomic<int64_t> budget_{INT64_MAX / 2};
  std::atomic<bool> corrupt_reads_{false};
  std::atomic<bool> fail_sync_{false};
  std::atomic<int> read_error_{0};
  std::atomic<bool> fail_sync_dir_{false};
  std::atomic<bool> fail_unlink_{false};
  std::atomic<uint64_t> dir_syncs_{0};
  std::atomic<uint64_t> no_space_errors_{0};
  std::atomic<uint64_t> corrupted_reads_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_FAULTY_PAYLOAD_OPS_H_
