// What /proc says about a process, for the benchmarks that report a daemon's (or their
// own) CPU time beside its throughput. Standard library only.
#ifndef KVTIER_BENCH_PROC_STAT_H_
#define KVTIER_BENCH_PROC_STAT_H_

#include <sys/types.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace kvtier::bench {

// User + system CPU seconds of process `pid` so far (/proc/PID/stat); 0 if unreadable.
inline double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command (field 2) is in parentheses and may hold spaces: count from the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 1));
  std::string field;
  // Fields 3 (state) to 13, then utime (14) and stime (15), in clock ticks.
  for (int i = 3; i <= 13; ++i) {
    if (!(rest >> field)) return 0;
  }
  unsigned long long utime = 0, stime = 0;
  if (!(rest >> utime >> stime)) return 0;
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_PROC_STAT_H_
