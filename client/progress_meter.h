// ProgressMeter: the CLI's progress line for long transfers. On a terminal it redraws
// one line on stderr in place ("put  45%  36.0 / 80.0 MiB  123.4 MiB/s"); elsewhere it
// stays silent, so logs get only the command's final summary.
//
// Thread-safety: not thread-safe; driven by the thread running the transfer (the
// client calls progress callbacks on the calling thread).
#ifndef KVTIER_CLIENT_PROGRESS_METER_H_
#define KVTIER_CLIENT_PROGRESS_METER_H_

#include <cstdint>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtier {

class ProgressMeter {
 public:
  // Transfers up to this size finish too fast for a progress line to help.
  static constexpr uint64_t kMinBytes = uint64_t{8} << 20;

  // `label` starts the line ("put", "get"). The clock starts now.
  explicit ProgressMeter(std::string label);
  ProgressMeter(const ProgressMeter&) = delete;
  ProgressMeter& operator=(const ProgressMeter&) = delete;
  ~ProgressMeter();  // Erases the line if Finish() was not called.

  // Redraws at most 10 times a second, and only once `total` exceeds kMinBytes.
  void Update(uint64_t done, uint64_t total);
  // Erases the line (if one was drawn) so the summary can follow on a clean line.
  void Finish();

  absl::Duration Elapsed() const { return absl::Now() - start_; }

  // "12.0 MiB in 0.52 s (23.1 MiB/s)".
  static std::string Summary(uint64_t bytes, absl::Duration elapsed);
  // Human-readable IEC size: "512 B", "1.5 KiB", "12.0 MiB", "3.2 GiB".
  static std::string Bytes(uint64_t bytes);

 private:
  const std::string label_;
  const bool tty_;
  const absl::Time start_;
  absl::Time last_draw_ = absl::InfinitePast();
  bool drawn_ = false;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_PROGRESS_METER_H_
