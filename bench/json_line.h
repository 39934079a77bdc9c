// One flat JSON object per line (numbers, strings and arrays of numbers), appended to --json=FILE and
// echoed to stderr: the raw results bench/report.py and bench/plot.py read.
// Standard library only.
#ifndef KVTIER_BENCH_JSON_LINE_H_
#define KVTIER_BENCH_JSON_LINE_H_

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench/bench_flags.h"

namespace kvtier::bench {

class JsonLine {
 public:
  JsonLine& S(const std::string& k, const std::string& v) {
    Sep();
    s_ += "\"" + k + "\": \"" + v + "\"";
    return *this;
  }
  JsonLine& N(const std::string& k, double v) {
    Sep();
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    s_ += "\"" + k + "\": " + buf;
    return *this;
  }
  JsonLine& V(const std::string& k, const std::vector<double>& v) {
    Sep();
    s_ += "\"" + k + "\": [";
    for (size_t i = 0; i < v.size(); ++i) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s%.6g", i ? ", " : "", v[i]);
      s_ += buf;
    }
    s_ += "]";
    return *this;
  }
  void Emit() {
    s_ += "}";
    const std::string path = StrFlag("json", "");
    if (!path.empty()) {
      std::ofstream f(path, std::ios::app);
      f << s_ << "\n";
    }
    std::fprintf(stderr, "%s\n", s_.c_str());
  }

 private:
  void Sep() { s_ += s_.size() > 1 ? ", " : ""; }
  std::string s_ = "{";
};

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_JSON_LINE_H_
