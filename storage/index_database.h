// IndexDatabase: the SSD tier's RocksDB (its index rows and layouts), closed and opened
// again after a failed WAL write.
//
// RocksDB 7.8 (Debian's) keeps the WAL writer whose append failed (a full disk): once
// its background error is cleared (Resume, or its own recovery when the disk has room
// again) with empty memtables, it writes to that writer again, and the write fails
// "Writer has previous error" for good or, in a build with assertions such as Debian's,
// aborts the process. So a failed WAL write stops writes here (RocksDB's automatic
// recovery is turned off for it) until the database is closed and opened again, which
// replays the WAL and starts a new one. That is tried at the next write, at most once
// per `retry_interval`; until it succeeds writes fail with the write's own error or
// Unavailable. Other write errors (a flush that hit a full disk) are left to RocksDB's
// recovery, helped by a Resume after each failed write.
//
//   auto failures = IndexDatabase::WatchWalFailures(&db_options);  // Before DB::Open.
//   ... DB::Open(db_options, path, families, &handles, &raw) ...
//   IndexDatabase index(std::unique_ptr<rocksdb::DB>(raw), handles, db_options, families,
//                       path, failures, now);
//   index.Write(wo, [&](rocksdb::WriteBatch& b, const IndexDatabase::Families& f) {
//     b.Delete(f.meta, key);
//   });
//
// Thread-safety: thread-safe. Writes run concurrently; a reopen waits for them to end.
#ifndef KVTIER_STORAGE_INDEX_DATABASE_H_
#define KVTIER_STORAGE_INDEX_DATABASE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace kvtier {

class IndexDatabase {
 public:
  // Set by a listener when a write to the WAL failed.
  struct WalFailures {
    std::atomic<uint64_t> count{0};
  };
  // The column families a write or a scan names. Valid only inside the call that passes
  // them: a reopen replaces them.
  struct Families {
    rocksdb::ColumnFamilyHandle* meta;
    rocksdb::ColumnFamilyHandle* layouts;
  };

  // Adds to `options` the listener that notes failed WAL writes and turns RocksDB's
  // automatic recovery off for them. Call before opening the database.
  static std::shared_ptr<WalFailures> WatchWalFailures(rocksdb::DBOptions* options);

  // Takes an open database whose `handles` are default, meta, layouts (`families`, in
  // that order, describe them for a reopen). `options` must be the ones it was opened
  // with (WatchWalFailures applied).
  IndexDatabase(std::unique_ptr<rocksdb::DB> db, std::vector<rocksdb::ColumnFamilyHandle*> handles,
                rocksdb::DBOptions options, std::vector<rocksdb::ColumnFamilyDescriptor> families,
                std::string path, std::shared_ptr<WalFailures> failures,
                std::function<absl::Time()> now,
                absl::Duration retry_interval = absl::Seconds(1));
  ~IndexDatabase();
  IndexDatabase(const IndexDatabase&) = delete;
  IndexDatabase& operator=(const IndexDatabase&) = delete;

  // Writes the batch `fill` builds (reopening the database first after a failed WAL
  // write). RocksDB's status; Unavailable while the database is closed between tries.
  rocksdb::Status Write(const rocksdb::WriteOptions& options,
                        absl::FunctionRef<void(rocksdb::WriteBatch&, const Families&)> fill);
  // Every row of a family, in key order; stops early when `row` returns false.
  rocksdb::Status Scan(bool layouts,
                       absl::FunctionRef<bool(const rocksdb::Slice&, const rocksdb::Slice&)> row);
  // Flushes every memtable, waiting for it.
  rocksdb::Status Flush();

  // How many times the database was reopened after a failed WAL write.
  uint64_t reopens() const;

 private:
  // Closes and opens the database if a WAL write failed since it was opened, at most
  // once per retry_interval_. Returns the reason writes cannot go on, or Ok.
  rocksdb::Status ReopenIfBroken() ABSL_LOCKS_EXCLUDED(mu_);
  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const rocksdb::DBOptions options_;
  const std::vector<rocksdb::ColumnFamilyDescriptor> families_;
  const std::string path_;
  const std::shared_ptr<WalFailures> failures_;
  const std::function<absl::Time()> now_;
  const absl::Duration retry_interval_;

  // Shared by writes and scans; exclusive for a reopen.
  mutable absl::Mutex mu_;
  std::unique_ptr<rocksdb::DB> db_ ABSL_GUARDED_BY(mu_);  // Null: closed, reopen failed.
  std::vector<rocksdb::ColumnFamilyHandle*> handles_ ABSL_GUARDED_BY(mu_);
  // failures_->count when the database was last opened: more means its WAL is broken.
  uint64_t failures_seen_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_try_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  rocksdb::Status last_error_ ABSL_GUARDED_BY(mu_);
  uint64_t reopens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_INDEX_DATABASE_H_
