// DaemonProcess (the test and benchmark harness): a kvtierd started from a process's
// main thread dies with that process, so a benchmark or test killed by a signal or a
// CTest timeout leaves no daemon running. The only test in its binary: it forks before
// any thread exists.
#include "tests/support/daemon_process.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "tests/support/test_data.h"

namespace kvtier {
namespace {

TEST(DaemonProcessTest, TheDaemonDiesWithTheProcessThatStartedIt) {
  const std::string dir = testing::MakeTempDir("kvtierd-orphan");
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t harness = fork();
  ASSERT_GE(harness, 0);
  if (harness == 0) {  // A benchmark, in short: start a daemon, then wait to be killed.
    close(fds[0]);
    auto d = testing::DaemonProcess::Start(dir, {});
    const pid_t daemon = d.ok() ? d->pid() : -1;
    if (write(fds[1], &daemon, sizeof daemon) != sizeof daemon) _exit(2);
    for (;;) pause();
  }
  close(fds[1]);
  pid_t daemon = -1;
  ASSERT_EQ(read(fds[0], &daemon, sizeof daemon), static_cast<ssize_t>(sizeof daemon));
  close(fds[0]);
  ASSERT_GT(daemon, 0) << "the harness could not start kvtierd";
  // A pidfd names this daemon even if its pid were reused later.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, daemon, 0));
  ASSERT_GE(pidfd, 0) << "the daemon was not running: " << std::strerror(errno);
  ASSERT_EQ(kill(harness, SIGKILL), 0);
  int status;
  ASSERT_EQ(waitpid(harness, &status, 0), harness);
  // The pidfd turns readable when the daemon exits; without PR_SET_PDEATHSIG it never
  // would, and the poll runs out.
  pollfd p{pidfd, POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 60'000), 1) << "kvtierd outlived the process that started it";
  close(pidfd);
  if (p.revents == 0) kill(daemon, SIGKILL);
}

}  // namespace
}  // namespace kvtier
