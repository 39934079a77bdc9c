// RocksDbLogger: RocksDB's info log, sent to the daemon's log (stderr, the journal)
// instead of a LOG file in the data directory.
//
// A LOG file shares the disk with the index: when the disk fills, its writer fails
// once and RocksDB's (assertion-enabled) writer then aborts the process on the next
// line it logs, which after a full disk is the line saying the error cleared. Warnings
// and errors are also what an operator wants in the journal, next to the daemon's own.
// Lines below `level` are dropped; at most one line a second of each kind (format
// string) goes out (LogLimiter), saying how many were held back, so a RocksDB retrying a
// failed write cannot flood the journal, and the first line of a new kind always shows.
//
// Thread-safety: thread-safe (RocksDB logs from its background threads).
#ifndef KVTIER_STORAGE_ROCKSDB_LOGGER_H_
#define KVTIER_STORAGE_ROCKSDB_LOGGER_H_

#include <rocksdb/env.h>

#include <cstdarg>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/log_limiter.h"

namespace kvtier {

class RocksDbLogger final : public rocksdb::Logger {
 public:
  explicit RocksDbLogger(rocksdb::InfoLogLevel level = rocksdb::InfoLogLevel::WARN_LEVEL,
                         std::function<absl::Time()> now = [] { return absl::Now(); });

  using rocksdb::Logger::Logv;
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override;
  // RocksDB's lines without a level are informational.
  void Logv(const char* format, va_list ap) override;

 private:
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  // One per format string RocksDB logged with (a static string: a bounded set).
  absl::flat_hash_map<const char*, std::unique_ptr<LogLimiter>> limiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_ROCKSDB_LOGGER_H_
