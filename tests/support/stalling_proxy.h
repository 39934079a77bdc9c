// StallingProxy: a TCP proxy on 127.0.0.1 for tests that need a client whose bytes stop
// moving, as a hung or frozen worker's would. A client connects to port() and each of
// its connections is forwarded to 127.0.0.1:upstream_port. PauseDownstream() stops
// reading what the daemon sends, so the daemon's socket buffers fill and its writes
// block exactly as they would against a client process that stopped reading; what the
// client sends keeps flowing. An in-process gRPC client cannot play that part: its
// transport reads the socket whether or not the application reads the call.
#ifndef KVTIER_TESTS_SUPPORT_STALLING_PROXY_H_
#define KVTIER_TESTS_SUPPORT_STALLING_PROXY_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::testing {

class StallingProxy {
 public:
  static absl::StatusOr<std::unique_ptr<StallingProxy>> Start(int upstream_port);
  ~StallingProxy();
  StallingProxy(const StallingProxy&) = delete;
  StallingProxy& operator=(const StallingProxy&) = delete;

  int port() const { return port_; }
  std::string target() const;
  // From now on no byte the daemon sends is read (one read already under way may
  // still complete and be forwarded).
  void PauseDownstream();

 private:
  StallingProxy(int listen_fd, int port, int upstream_port);
  void AcceptLoop();
  // Copies bytes from `from` to `to` until either side closes.
  void Pump(int from, int to, bool downstream);

  const int listen_fd_;
  const int port_;
  const int upstream_port_;
  absl::Mutex mu_;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_STALLING_PROXY_H_
