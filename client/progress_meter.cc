#include "client/progress_meter.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_format.h"

namespace kvtier {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr absl::Duration kRedrawInterval = absl::Milliseconds(100);

double MiBPerSecond(uint64_t bytes, absl::Duration elapsed) {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0 ? bytes / kMiB / seconds : 0.0;
}

}  // namespace

ProgressMeter::ProgressMeter(std::string label)
    : label_(std::move(label)), tty_(isatty(STDERR_FILENO) == 1), start_(absl::Now()) {}

ProgressMeter::~ProgressMeter() { Finish(); }

void ProgressMeter::Update(uint64_t done, uint64_t total) {
  if (!tty_ || total <= kMinBytes) return;
  const absl::Time now = absl::Now();
  if (done < total && now - last_draw_ < kRedrawInterval) return;
  last_draw_ = now;
  const double percent = total > 0 ? 100.0 * static_cast<double>(done) / total : 100.0;
  // \r returns to the line's start, \x1b[K erases what a longer previous draw left.
  std::fprintf(stderr, "\r%s %3.0f%%  %.1f / %.1f MiB  %.1f MiB/s\x1b[K", label_.c_str(),
               percent, done / kMiB, total / kMiB, MiBPerSecond(done, now - start_));
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressMeter::Finish() {
  if (!drawn_) return;
  std::fputs("\r\x1b[K", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

std::string ProgressMeter::Summary(uint64_t bytes, absl::Duration elapsed) {
  return absl::StrFormat("%s in %.2f s (%.1f MiB/s)", Bytes(bytes),
                         absl::ToDoubleSeconds(elapsed), MiBPerSecond(bytes, elapsed));
}

std::string ProgressMeter::Bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrFormat("%u B", bytes);
  double v = bytes / 1024.0;
  int unit = 0;
  while (v >= 1024.0 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    v /= 1024.0;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", v, kUnits[unit]);
}

}  // namespace kvtier
