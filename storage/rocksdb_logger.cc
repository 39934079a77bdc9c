#include "storage/rocksdb_logger.h"

#include <cstdio>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "storage/log.h"

namespace kvtier {

RocksDbLogger::RocksDbLogger(rocksdb::InfoLogLevel level, std::function<absl::Time()> now)
    : rocksdb::Logger(level), now_(std::move(now)) {}

void RocksDbLogger::Logv(const char* format, va_list ap) {
  Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
}

void RocksDbLogger::Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) {
  if (level < GetInfoLogLevel() || level == rocksdb::InfoLogLevel::HEADER_LEVEL) return;
  char buf[1024];
  const int n = std::vsnprintf(buf, sizeof(buf), format, ap);
  if (n < 0) return;
  LogLimiter* limiter;
  {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<LogLimiter>& l = limiters_[format];
    if (l == nullptr) l = std::make_unique<LogLimiter>(absl::Seconds(1));
    limiter = l.get();  // Never erased: valid for the logger's life.
  }
  std::optional<uint64_t> held = limiter->Allow(now_());
  if (!held.has_value()) return;
  std::string line = absl::StrCat("rocksdb: ", absl::StripTrailingAsciiWhitespace(buf));
  if (static_cast<size_t>(n) >= sizeof(buf)) line += "...";
  if (*held > 0) absl::StrAppend(&line, " (and ", *held, " more RocksDB lines held back)");
  LogLine(level >= rocksdb::InfoLogLevel::ERROR_LEVEL ? LogLevel::kError
          : level >= rocksdb::InfoLogLevel::WARN_LEVEL ? LogLevel::kWarning
                                                        : LogLevel::kInfo,
          line);
}

}  // namespace kvtier
