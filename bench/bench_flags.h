// Command-line flags (--name=value) and percentiles shared by the benchmark binaries.
// Standard library only, so that redis_bench stays free of the project's libraries.
#ifndef KVTIER_BENCH_BENCH_FLAGS_H_
#define KVTIER_BENCH_BENCH_FLAGS_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::bench {

// The program's arguments; call once from main before reading any flag.
inline int& FlagArgc() {
  static int argc = 0;
  return argc;
}
inline char**& FlagArgv() {
  static char** argv = nullptr;
  return argv;
}
inline void InitFlags(int argc, char** argv) { FlagArgc() = argc, FlagArgv() = argv; }

// True when the arguments ask for help (--help or -h): the caller prints its usage and
// exits before it starts any daemon.
inline bool HelpRequested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a(argv[i]);
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

// The value of --name=VALUE, or `def` when absent.
inline std::string StrFlag(std::string_view name, std::string def) {
  std::string prefix = "--";
  prefix.append(name).push_back('=');
  for (int i = 1; i < FlagArgc(); ++i) {
    const std::string_view a(FlagArgv()[i]);
    if (a.substr(0, prefix.size()) == prefix) return std::string(a.substr(prefix.size()));
  }
  return def;
}

// An unsigned integer flag; `def` when absent or not a number.
inline uint64_t Flag(std::string_view name, uint64_t def) {
  const std::string s = StrFlag(name, "");
  char* end = nullptr;
  const uint64_t v = std::strtoull(s.c_str(), &end, 10);
  return !s.empty() && end != nullptr && *end == '\0' ? v : def;
}

// A floating-point flag; `def` when absent or not a number.
inline double DFlag(std::string_view name, double def) {
  const std::string s = StrFlag(name, "");
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  return !s.empty() && end != nullptr && *end == '\0' ? v : def;
}

// A comma-separated list of unsigned integers (empty items skipped).
inline std::vector<uint64_t> ListFlag(std::string_view name, const std::string& def) {
  std::vector<uint64_t> out;
  std::stringstream ss(StrFlag(name, def));
  for (std::string t; std::getline(ss, t, ',');) {
    if (!t.empty()) out.push_back(std::strtoull(t.c_str(), nullptr, 10));
  }
  return out;
}

// The p-quantile (0..1) of `v`, nearest rank; 0 for no samples.
inline double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_BENCH_FLAGS_H_
