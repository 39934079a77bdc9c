#include "storage/index_database.h"

#include <utility>

#include "rocksdb/listener.h"
#include "storage/log.h"

namespace kvtier {
namespace {

class WalFailureListener : public rocksdb::EventListener {
 public:
  explicit WalFailureListener(std::shared_ptr<IndexDatabase::WalFailures> failures)
      : failures_(std::move(failures)) {}
  const char* Name() const override { return "KvtierWalFailureListener"; }
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason, rocksdb::Status*) override {
    if (reason == rocksdb::BackgroundErrorReason::kWriteCallback) failures_->count.fetch_add(1);
  }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason reason, rocksdb::Status,
                            bool* auto_recovery) override {
    // Recovery would clear the error and write to the broken WAL writer (see the header).
    if (reason == rocksdb::BackgroundErrorReason::kWriteCallback) *auto_recovery = false;
  }

 private:
  const std::shared_ptr<IndexDatabase::WalFailures> failures_;
};

}  // namespace

std::shared_ptr<IndexDatabase::WalFailures> IndexDatabase::WatchWalFailures(
    rocksdb::DBOptions* options) {
  auto failures = std::make_shared<WalFailures>();
  options->listeners.push_back(std::make_shared<WalFailureListener>(failures));
  return failures;
}

IndexDatabase::IndexDatabase(std::unique_ptr<rocksdb::DB> db,
                             std::vector<rocksdb::ColumnFamilyHandle*> handles,
                             rocksdb::DBOptions options,
                             std::vector<rocksdb::ColumnFamilyDescriptor> families,
                             std::string path, std::shared_ptr<WalFailures> failures,
                             std::function<absl::Time()> now, absl::Duration retry_interval)
    : options_(std::move(options)),
      families_(std::move(families)),
      path_(std::move(path)),
      failures_(std::move(failures)),
      now_(std::move(now)),
      retry_interval_(retry_interval),
      db_(std::move(db)),
      handles_(std::move(handles)) {
  absl::MutexLock lock(&mu_);
  failures_seen_ = failures_->count.load();
}

IndexDatabase::~IndexDatabase() {
  absl::MutexLock lock(&mu_);
  CloseLocked();
}

void IndexDatabase::CloseLocked() {
  if (db_ == nullptr) return;
  for (auto* h : handles_) {
    // Destroying a handle only fails for a null handle; nothing to do about it here.
    db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  }
  handles_.clear();
  rocksdb::Status s = db_->Close();
  if (!s.ok()) LogWarning("SSD tier: closing RocksDB: ", s.ToString());
  db_.reset();
}

rocksdb::Status IndexDatabase::ReopenIfBroken() {
  {
    absl::ReaderMutexLock lock(&mu_);
    if (db_ != nullptr && failures_->count.load() == failures_seen_) return rocksdb::Status::OK();
  }
  absl::MutexLock lock(&mu_);
  if (db_ != nullptr && failures_->count.load() == failures_seen_) return rocksdb::Status::OK();
  const absl::Time now = now_();
  if (now < next_try_) {
    // The database stays as it is (refusing writes with its error) or closed.
    return db_ != nullptr ? rocksdb::Status::OK() : last_error_;
  }
  next_try_ = now + retry_interval_;
  CloseLocked();
  const uint64_t failures = failures_->count.load();
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options_, path_, families_, &handles, &raw);
  if (!s.ok()) {
    last_error_ = s;
    LogWarning("SSD tier: reopening the index after a failed WAL write: ", s.ToString(),
               "; tried again at the next write");
    return s;
  }
  db_.reset(raw);
  handles_ = std::move(handles);
  failures_seen_ = failures;
  ++reopens_;
  LogInfo("SSD tier: the index was reopened after a failed WAL write");
  return rocksdb::Status::OK();
}

rocksdb::Status IndexDatabase::Write(
    const rocksdb::WriteOptions& options,
    absl::FunctionRef<void(rocksdb::WriteBatch&, const Families&)> fill) {
  if (rocksdb::Status s = ReopenIfBroken(); !s.ok()) return s;
  absl::ReaderMutexLock lock(&mu_);
  if (db_ == nullptr) return last_error_;
  rocksdb::WriteBatch batch;
  fill(batch, Families{handles_[1], handles_[2]});
  if (batch.Count() == 0) return rocksdb::Status::OK();
  rocksdb::Status s = db_->Write(options, &batch);
  if (!s.ok() && failures_->count.load() == failures_seen_) {
    // A refusal after a failed flush or compaction: Resume clears it once the cause is
    // gone (while the disk is still full it fails, and the next write tries again).
    // Not after a failed WAL write: that takes a reopen (above).
    db_->Resume().PermitUncheckedError();
  }
  return s;
}

rocksdb::Status IndexDatabase::Scan(
    bool layouts, absl::FunctionRef<bool(const rocksdb::Slice&, const rocksdb::Slice&)> row) {
  absl::ReaderMutexLock lock(&mu_);
  if (db_ == nullptr) return last_error_;
  std::unique_ptr<rocksdb::Iterator> it(
      db_->NewIterator(rocksdb::ReadOptions(), handles_[layouts ? 2 : 1]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (!row(it->key(), it->value())) break;
  }
  return it->status();
}

rocksdb::Status IndexDatabase::Flush() {
  if (rocksdb::Status s = ReopenIfBroken(); !s.ok()) return s;
  absl::ReaderMutexLock lock(&mu_);
  if (db_ == nullptr) return last_error_;
  rocksdb::FlushOptions fo;
  fo.wait = true;
  return db_->Flush(fo, handles_);
}

uint64_t IndexDatabase::reopens() const {
  absl::ReaderMutexLock lock(&mu_);
  return reopens_;
}

}  // namespace kvtier
