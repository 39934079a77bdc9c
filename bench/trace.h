// The Mooncake-format trace the benchmarks replay: one JSON object per line with a
// "timestamp" (ms) and "hash_ids" (the request's chunk ids, prefix-chained: a request
// that shares a prefix with another shares its leading ids).
#ifndef KVTIER_BENCH_TRACE_H_
#define KVTIER_BENCH_TRACE_H_

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvtier::bench {

struct TraceReq {
  double ts_ms = 0;
  std::vector<uint64_t> ids;
};

// The first `limit` requests of the trace at `path` (empty if unreadable).
inline std::vector<TraceReq> LoadTrace(const std::string& path, uint64_t limit) {
  std::vector<TraceReq> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line) && out.size() < limit) {
    TraceReq r;
    if (size_t p = line.find("\"timestamp\""); p != std::string::npos) {
      p = line.find(':', p) + 1;
      r.ts_ms = std::strtod(line.c_str() + p, nullptr);
    }
    size_t p = line.find("\"hash_ids\"");
    if (p == std::string::npos) continue;
    p = line.find('[', p) + 1;
    const size_t e = line.find(']', p);
    for (absl::string_view s : absl::StrSplit(absl::string_view(line).substr(p, e - p), ',',
                                               absl::SkipWhitespace())) {
      uint64_t v;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(s), &v)) r.ids.push_back(v);
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_TRACE_H_
