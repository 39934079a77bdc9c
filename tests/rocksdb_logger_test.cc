// RocksDbLogger: RocksDB's lines at or above its level reach the daemon's log, one a
// second of each kind on the injected clock, saying how many it held back.
#include "storage/rocksdb_logger.h"

#include <gtest/gtest.h>

#include <string>

#include "storage/log.h"
#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

int Count(const std::string& log, const std::string& what) {
  int n = 0;
  for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
  return n;
}

TEST(RocksDbLoggerTest, WarningsAndErrorsReachTheLogOneASecondOfEachKind) {
  testing::FakeClock clock;
  RocksDbLogger logger(rocksdb::InfoLogLevel::WARN_LEVEL, clock.AsFunction());
  SetMinLogLevel(LogLevel::kInfo);
  ::testing::internal::CaptureStderr();
  rocksdb::Log(rocksdb::InfoLogLevel::INFO_LEVEL, &logger, "an info line %d", 1);
  for (int i = 0; i < 5; ++i) {
    rocksdb::Log(rocksdb::InfoLogLevel::ERROR_LEVEL, &logger, "background error %d\n", i);
  }
  rocksdb::Log(rocksdb::InfoLogLevel::WARN_LEVEL, &logger, "another kind %s", "x");
  clock.Advance(absl::Seconds(1));
  rocksdb::Log(rocksdb::InfoLogLevel::ERROR_LEVEL, &logger, "background error %d\n", 9);
  const std::string log = ::testing::internal::GetCapturedStderr();
  SetMinLogLevel(LogLevel::kWarning);
  EXPECT_EQ(Count(log, "an info line"), 0) << log;
  EXPECT_EQ(Count(log, "ERROR"), 2) << log;
  EXPECT_EQ(Count(log, "rocksdb: background error 0\n"), 1) << log;
  EXPECT_EQ(Count(log, "rocksdb: background error 9 (and 4 more RocksDB lines held back)"), 1)
      << log;
  EXPECT_EQ(Count(log, "WARN"), 1) << log;
  EXPECT_EQ(Count(log, "rocksdb: another kind x"), 1) << log;
}

}  // namespace
}  // namespace kvtier
