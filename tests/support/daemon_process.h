// DaemonProcess: runs a real kvtierd for integration tests: port 0, a temp data dir,
// waits for the port file, and stops it with SIGTERM or SIGKILL.
//
// Thread-safety: not thread-safe; owned by one test.
#ifndef KVTIER_TESTS_SUPPORT_DAEMON_PROCESS_H_
#define KVTIER_TESTS_SUPPORT_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier::testing {

// A fresh empty directory under the test temp dir.
std::string MakeTempDir(const std::string& prefix);

class DaemonProcess {
 public:
  // Starts kvtierd with --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0
  // --data-dir=<data_dir> --port-file=... --shm-socket=off and `extra_args` (pass
  // --shm-socket=auto for the same-host data plane), and waits (up to 30 s) until
  // it serves. The binary is the one this tree built, or $KVTIERD_BINARY if set (for
  // A/B benchmarks of two versions). Its stderr goes to
  // <data_dir>.log. Errors: Unavailable (exited or did not come up).
  static absl::StatusOr<DaemonProcess> Start(const std::string& data_dir,
                                             std::vector<std::string> extra_args = {});
  DaemonProcess(DaemonProcess&& other) noexcept;
  DaemonProcess& operator=(DaemonProcess&& other) noexcept;
  ~DaemonProcess();  // SIGKILLs a daemon still running.

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  std::string ReadLog() const;

  // SIGTERM and wait; returns the exit code (or 128+signal). Errors: DeadlineExceeded.
  absl::StatusOr<int> Terminate(int timeout_seconds = 60);
  // SIGKILL and reap.
  void Kill();
  // Resident set size now, and the peak, from /proc/<pid>/status (bytes).
  absl::StatusOr<uint64_t> ResidentBytes() const;
  absl::StatusOr<uint64_t> PeakResidentBytes() const;

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string log_path_;
};

// A plain HTTP/1.1 GET to 127.0.0.1:`port`. Errors: Unavailable.
struct HttpResponse {
  int status = 0;
  std::string headers;  // The status line and headers, as sent.
  std::string body;
};
absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path);
// `method` `path` on 127.0.0.1:`port`; a reply slower than `timeout` is Unavailable.
absl::StatusOr<HttpResponse> HttpRequest(int port, const std::string& method,
                                         const std::string& path,
                                         absl::Duration timeout = absl::InfiniteDuration());

// The value of `series` (a metric name with its labels, as exposed) in a /metrics
// text, or -1 if it is not there.
double SeriesValue(const std::string& text, const std::string& series);

// Polls `cond` every 10 ms for up to 30 s, for tests that wait on a daemon's own
// progress (its threads, not the test's). Returns whether it came true.
bool Eventually(const std::function<bool()>& cond);

// A free TCP port on 127.0.0.1 (bound and released; racy, but fine for tests).
int FreePort();

// Runs a command (argv[0] is the path), returning exit code and combined output.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult RunCommand(const std::vector<std::string>& argv);

// Flips 64 bytes at each of `offsets(size)` in every SSD payload file (*.kvp) below
// `dir`, where chunk payloads live; the daemon must be stopped. Returns the number of
// files changed.
int CorruptPayloadFiles(const std::string& dir,
                     const std::function<std::vector<uint64_t>(uint64_t size)>& offsets);

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_DAEMON_PROCESS_H_
