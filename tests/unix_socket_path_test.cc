// ClaimSocketPath on real Unix sockets in a temp directory: only a socket nobody listens
// on is removed.
#include "server/unix_socket_path.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

class ClaimSocketPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvtier-claim-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/s.sock";
  }
  void TearDown() override {
    for (int fd : fds_) close(fd);
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }

  // A socket of `type` bound at path_; listening when `listen` is set.
  int Bind(int type, bool listen) {
    const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.data(), path_.size());
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    if (listen) {
      EXPECT_EQ(::listen(fd, 4), 0);
    }
    fds_.push_back(fd);
    return fd;
  }

  bool Exists() const {
    struct stat st {};
    return lstat(path_.c_str(), &st) == 0;
  }

  std::string dir_, path_;
  std::vector<int> fds_;
};

TEST_F(ClaimSocketPathTest, NothingThereIsFree) {
  EXPECT_TRUE(ClaimSocketPath(path_, SOCK_STREAM, "listen_unix").ok());
}

TEST_F(ClaimSocketPathTest, AStaleSocketIsRemoved) {
  close(Bind(SOCK_STREAM, /*listen=*/false));  // The file stays; nobody listens.
  fds_.clear();
  ASSERT_TRUE(Exists());
  EXPECT_TRUE(ClaimSocketPath(path_, SOCK_STREAM, "listen_unix").ok());
  EXPECT_FALSE(Exists());
}

TEST_F(ClaimSocketPathTest, ALiveSocketOfTheSameTypeIsKept) {
  Bind(SOCK_STREAM, /*listen=*/true);
  const absl::Status s = ClaimSocketPath(path_, SOCK_STREAM, "listen_unix");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Exists());
}

// listen_unix claiming the path of a live region socket (SOCK_SEQPACKET): connect()
// fails with EPROTOTYPE, which once counted as stale, and the region socket was unlinked
// from under its daemon.
TEST_F(ClaimSocketPathTest, ALiveSocketOfAnotherTypeIsKept) {
  Bind(SOCK_SEQPACKET, /*listen=*/true);
  const absl::Status s = ClaimSocketPath(path_, SOCK_STREAM, "listen_unix");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("option listen_unix: " + path_), std::string::npos) << s;
  EXPECT_NE(s.message().find("another type"), std::string::npos) << s;
  EXPECT_TRUE(Exists());
}

// A live socket this user may not connect to (EACCES) is not taken for a stale one.
// Root connects to anything, so as root the claim runs in a child that drops to nobody.
TEST_F(ClaimSocketPathTest, ASocketThisUserCannotConnectToIsKept) {
  Bind(SOCK_STREAM, /*listen=*/true);
  ASSERT_EQ(chmod(path_.c_str(), 0), 0);
  if (geteuid() != 0) {
    const absl::Status s = ClaimSocketPath(path_, SOCK_STREAM, "listen_unix");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  } else {
    ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
      const absl::Status s = ClaimSocketPath(path_, SOCK_STREAM, "listen_unix");
      _exit(s.code() == absl::StatusCode::kFailedPrecondition ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not refused, 2: could not drop to nobody";
  }
  EXPECT_TRUE(Exists());
}

TEST_F(ClaimSocketPathTest, AFileThatIsNotASocketIsKept) {
  FILE* f = std::fopen(path_.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_EQ(ClaimSocketPath(path_, SOCK_STREAM, "listen_unix").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Exists());
}

}  // namespace
}  // namespace kvtier
