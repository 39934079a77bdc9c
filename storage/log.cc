#include "storage/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtier {
namespace {

std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
const bool kUnderJournal = std::getenv("JOURNAL_STREAM") != nullptr;

}  // namespace

void SetMinLogLevel(LogLevel level) { min_level.store(static_cast<int>(level)); }

void LogLine(LogLevel level, absl::string_view message) {
  if (static_cast<int>(level) < min_level.load(std::memory_order_relaxed)) return;
  static constexpr const char* kNames[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  static constexpr const char* kPrefixes[] = {"<7>", "<6>", "<4>", "<3>"};
  const int i = static_cast<int>(level);
  std::string line;
  if (kUnderJournal) {
    line = absl::StrCat(kPrefixes[i], kNames[i], " ", message, "\n");
  } else {
    line = absl::StrCat(kNames[i], " ",
                        absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                         absl::UTCTimeZone()),
                        " ", message, "\n");
  }
  // One write keeps concurrent lines whole. A failed log write has nowhere to go.
  ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace kvtier
