// Operator logs: one line per event on stderr, "LEVEL time message". Under systemd
// (JOURNAL_STREAM set) each line starts with the syslog priority prefix ("<4>") so the
// journal records the right level. Logs are for start-up, degraded modes and recovery,
// never per request.
//
// Thread-safety: thread-safe; each line is written with one write(2).
#ifndef KVTIER_STORAGE_LOG_H_
#define KVTIER_STORAGE_LOG_H_

#include "absl/strings/string_view.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetMinLogLevel(LogLevel level);
void LogLine(LogLevel level, absl::string_view message);

template <typename... Args>
void LogInfo(const Args&... args) { LogLine(LogLevel::kInfo, absl::StrCat(args...)); }
template <typename... Args>
void LogWarning(const Args&... args) { LogLine(LogLevel::kWarning, absl::StrCat(args...)); }
template <typename... Args>
void LogError(const Args&... args) { LogLine(LogLevel::kError, absl::StrCat(args...)); }

}  // namespace kvtier

#endif  // KVTIER_STORAGE_LOG_H_
