// FaultInjectionFs: a rocksdb::FileSystem over the real one that injects the failures
// the SSD tier must survive, for tests only (production targets never link it).
//
//  - SetNoSpace(true): every write (Append / PositionedAppend on any writable file,
//    including files opened before the fault was armed) and every attempt to create a
//    writable file fails with IOStatus::NoSpace(), and GetFreeSpace reports 0 bytes,
//    as on a full disk. Disarming it makes the disk "free" again; files stay as they
//    were.
//  - SetCorruptReads(true): every Read / MultiRead of a blob file (name ends in
//    ".blob") returns its data with one byte flipped, as a failing SSD would. The byte
//    and the flip are drawn from a generator seeded at construction, so a failing run
//    can be replayed. Non-blob files (SST, WAL, MANIFEST) are left alone so the
//    database itself stays readable.
//  - SetWalWriteDelay(d): every Append to a WAL file (name ends in ".log") sleeps `d`
//    first, as on a slow disk, and wal_appends_in_flight() tells how many are inside
//    that sleep right now. A test uses it to hold a foreground write (a write-back
//    flush, say) in the middle while it does something else, with no fixed sleeps.
//
// Pass it as SsdTierOptions::file_system. Counters tell a test that a fault really fired.
//
// Thread-safety: all methods are thread-safe; RocksDB calls the files from its own
// threads while a test arms and disarms faults. The switches are relaxed atomics: they
// order nothing else, and need not, because a test arms a fault and then calls into
// RocksDB, whose own locks hand the work to whichever thread does the I/O.
// The file wrappers share State with the file system, so a file may outlive it.
#ifndef KVTIER_TESTS_SUPPORT_FAULT_INJECTION_FS_H_
#define KVTIER_TESTS_SUPPORT_FAULT_INJECTION_FS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rocksdb/file_system.h"

namespace kvtier::testing {

class FaultInjectionFs : public rocksdb::FileSystemWrapper {
 public:
  // Shared with the file wrappers, which may outlive a reference to the file system
  // held by the test.
  struct State {
    explicit State(uint64_t seed) : rng(seed) {}
    std::atomic<bool> no_space{false};
    std::atomic<bool> corrupt_reads{false};
    std::atomic<uint64_t> no_space_errors{0};
    std::atomic<uint64_t> corrupted_reads{0};
    std::atomic<int64_t> wal_delay_us{0};
    std::atomic<int64_t> wal_appends_in_flight{0};
    absl::Mutex rng_mu;
    std::mt19937_64 rng ABSL_GUARDED_BY(rng_mu);
  };

  // Wraps rocksdb::FileSystem::Default().
  explicit FaultInjectionFs(uint64_t seed = 0x6b76746965720001ull);

  static const char* kClassName() { return "KvtierFaultInjectionFs"; }
  const char* Name() const override { return kClassName(); }

  void SetNoSpace(bool on) { state_->no_space.store(on, std::memory_order_relaxed); }
  void SetCorruptReads(bool on) { state_->corrupt_reads.store(on, std::memory_order_relaxed); }
  void SetWalWriteDelay(absl::Duration d) {
    state_->wal_delay_us.store(absl::ToInt64Microseconds(d), std::memory_order_relaxed);
  }
  // WAL appends currently sleeping in the delay (0 when no delay is set).
  int64_t wal_appends_in_flight() const {
    return state_->wal_appends_in_flight.load(std::memory_order_acquire);
  }
  // Writes and file creations refused with NoSpace so far.
  uint64_t no_space_errors() const {
    return state_->no_space_errors.load(std::memory_order_relaxed);
  }
  // Blob-file reads returned with a flipped byte so far.
  uint64_t corrupted_reads() const {
    return state_->corrupted_reads.load(std::memory_order_relaxed);
  }

  rocksdb::IOStatus NewWritableFile(const std::string& fname, const rocksdb::FileOptions& file_opts,
                                    std::unique_ptr<rocksdb::FSWritableFile>* result,
                                    rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReopenWritableFile(const std::string& fname,
                                       const rocksdb::FileOptions& file_opts,
                                       std::unique_ptr<rocksdb::FSWritableFile>* result,
                                       rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReuseWritableFile(const std::string& fname, const std::string& old_fname,
                                      const rocksdb::FileOptions& file_opts,
                                      std::unique_ptr<rocksdb::FSWritableFile>* result,
                                      rocksdb::IODebugContext* dbg) override;
  // Reports no free space while the disk is "full", as a real full disk would; RocksDB
  // polls this before it retries recovery from a no-space error.
  rocksdb::IOStatus GetFreeSpace(const std::string& path, const rocksdb::IOOptions& options,
                                 uint64_t* diskfree, rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewRandomAccessFile(const std::string& fname,
                                        const rocksdb::FileOptions& file_opts,
                                        std::unique_ptr<rocksdb::FSRandomAccessFile>* result,
                                        rocksdb::IODebugContext* dbg) override;

 private:
  // NoSpace (and counts it) when the fault is armed; OK otherwise.
  rocksdb::IOStatus CheckCreate(const std::string& fname);

  const std::shared_ptr<State> state_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_FAULT_INJECTION_FS_H_
