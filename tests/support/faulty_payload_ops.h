// FaultyPayloadOps: the payload files' system calls, with faults a test switches on: a
// full disk (writes fail with ENOSPC), corrupted reads (one byte of every read flipped,
// the bytes on disk left intact), and failing syncs. A fake, not a mock: with no fault
// on it does the real I/O.
#ifndef KVTIER_TESTS_SUPPORT_FAULTY_PAYLOAD_OPS_H_
#define KVTIER_TESTS_SUPPORT_FAULTY_PAYLOAD_OPS_H_

#include <cerrno>
#include <atomic>
#include <cstdint>

#include "storage/payload_log.h"

namespace kvtier::testing {

class FaultyPayloadOps : public PayloadFileOps {
 public:
  void SetNoSpace(bool on) { no_space_.store(on); }
  // Writes fail with ENOSPC once this many more bytes were written (each write is
  // allowed whole or refused whole).
  void FailWritesAfter(uint64_t bytes) { budget_.store(static_cast<int64_t>(bytes)); }
  void SetCorruptReads(bool on) { corrupt_reads_.store(on); }
  void SetFailSync(bool on) { fail_sync_.store(on); }
  uint64_t no_space_errors() const { return no_space_errors_.load(); }
  uint64_t corrupted_reads() const { return corrupted_reads_.load(); }
  uint64_t bytes_written() const { return bytes_written_.load(); }

  ssize_t PWrite(int fd, const void* buf, size_t n, off_t offset) override {
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
    const ssize_t r = PayloadFileOps::PRead(fd, buf, n, offset);
    if (r > 0 && corrupt_reads_.load()) {
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

 private:
  std::atomic<bool> no_space_{false};
  std::atomic<int64_t> budget_{INT64_MAX / 2};
  std::atomic<bool> corrupt_reads_{false};
  std::atomic<bool> fail_sync_{false};
  std::atomic<uint64_t> no_space_errors_{0};
  std::atomic<uint64_t> corrupted_reads_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_FAULTY_PAYLOAD_OPS_H_
