#include "tests/support/daemon_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::testing {
namespace {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<uint64_t> ProcStatusKb(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      absl::string_view v(line);
      v.remove_prefix(field.size() + 1);
      v = absl::StripAsciiWhitespace(v);
      absl::ConsumeSuffix(&v, " kB");
      uint64_t kb;
      if (absl::SimpleAtoi(v, &kb)) return kb * 1024;
    }
  }
  return absl::NotFoundError(absl::StrCat(field, " not in /proc/", pid, "/status"));
}

}  // namespace

namespace {

// Directories MakeTempDir made, removed when the process exits normally (a daemon's data
// dir is hundreds of MiB: thousands of test runs filled a disk). KVTIER_KEEP_TEST_DIRS=1
// keeps them, for reading a failed test's daemon log.
std::vector<std::string>& TempDirs() {
  static auto* dirs = new std::vector<std::string>();
  return *dirs;
}

void RemoveTempDirs() {
  if (const char* keep = std::getenv("KVTIER_KEEP_TEST_DIRS"); keep && *keep == '1') return;
  for (const std::string& d : TempDirs()) {
    std::error_code ec;
    std::filesystem::remove_all(d, ec);
    std::filesystem::remove(d + ".log", ec);  // A daemon started on the dir itself.
  }
}

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  static const bool registered = std::atexit(RemoveTempDirs) == 0;
  (void)registered;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string root = base ? base : std::filesystem::temp_directory_path().string();
  std::string templ = absl::StrCat(root, "/", prefix, "-", getpid(), "-", counter++, "-XXXXXX");
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return "";
  static absl::Mutex mu(absl::kConstInit);
  absl::MutexLock lock(&mu);
  TempDirs().push_back(buf.data());
  return std::string(buf.data());
}

absl::StatusOr<DaemonProcess> DaemonProcess::Start(const std::string& data_dir,
                                                   std::vector<std::string> extra_args) {
  std::filesystem::create_directories(data_dir);
  const std::string port_file = data_dir + "/kvtierd.port";
  std::filesystem::remove(port_file);
  DaemonProcess d;
  d.log_path_ = data_dir + ".log";
  // KVTIERD_BINARY runs another build (A/B benchmarks of two versions).
  const char* binary = std::getenv("KVTIERD_BINARY");
  std::vector<std::string> args = {binary != nullptr ? binary : KVTIERD_PATH,
                                   "--listen=127.0.0.1:0",
                                   "--metrics-listen=127.0.0.1:0", "--data-dir=" + data_dir,
                                   "--port-file=" + port_file,
                                   // Clients stream unless a test asks for shared memory
                                   // (a later --shm-socket overrides this one).
                                   "--shm-socket=off",
                                   // Test daemons live for seconds: faulting their pool
                                   // in would only take CPU from the tests (benchmarks
                                   // and the prefault test turn it back on).
                                   "--ram-prefault=false"};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  // The daemon dies with the process that started it (a benchmark or test killed by a
  // signal or a timeout leaves no kvtierd behind). The kernel signals on the exit of
  // the forking *thread*, so only a fork from the main thread, whose end is the
  // process's, asks for it.
  const pid_t parent = getpid();
  const bool from_main_thread = static_cast<pid_t>(syscall(SYS_gettid)) == parent;
  pid_t pid = fork();
  if (pid < 0) return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    if (from_main_thread) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // The parent died before the prctl.
    }
    int fd = open(d.log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDERR_FILENO);
      dup2(fd, STDOUT_FILENO);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  d.pid_ = pid;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      d.pid_ = -1;
      return absl::UnavailableError(absl::StrCat("kvtierd exited during start-up (status ",
                                                 status, "): ", ReadWholeFile(d.log_path_)));
    }
    // The file is renamed into place whole: line 1 the gRPC port, line 2 metrics.
    std::vector<std::string> lines = absl::StrSplit(ReadWholeFile(port_file), '\n');
    int port, metrics_port;
    if (lines.size() >= 2 && absl::SimpleAtoi(lines[0], &port) && port > 0 &&
        absl::SimpleAtoi(lines[1], &metrics_port)) {
      d.port_ = port;
      d.metrics_port_ = metrics_port;
      return d;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::UnavailableError("kvtierd did not write its port file within 30 s: " +
                                ReadWholeFile(d.log_path_));
}

DaemonProcess::DaemonProcess(DaemonProcess&& other) noexcept
    : pid_(other.pid_),
      port_(other.port_),
      metrics_port_(other.metrics_port_),
      log_path_(std::move(other.log_path_)) {
  other.pid_ = -1;
}

DaemonProcess& DaemonProcess::operator=(DaemonProcess&& other) noexcept {
  if (this != &other) {
    Kill();
    pid_ = other.pid_;
    port_ = other.port_;
    metrics_port_ = other.metrics_port_;
    log_path_ = std::move(other.log_path_);
    other.pid_ = -1;
  }
  return *this;
}

DaemonProcess::~DaemonProcess() { Kill(); }

std::string DaemonProcess::ReadLog() const { return ReadWholeFile(log_path_); }

absl::StatusOr<int> DaemonProcess::Terminate(int timeout_seconds) {
  if (pid_ < 0) return absl::FailedPreconditionError("not running");
  kill(pid_, SIGTERM);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError("kvtierd did not exit after SIGTERM");
}

void DaemonProcess::Kill() {
  if (pid_ < 0) return;
  kill(pid_, SIGKILL);
  int status;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

absl::StatusOr<uint64_t> DaemonProcess::ResidentBytes() const {
  return ProcStatusKb(pid_, "VmRSS");
}
absl::StatusOr<uint64_t> DaemonProcess::PeakResidentBytes() const {
  return ProcStatusKb(pid_, "VmHWM");
}

double SeriesValue(const std::string& text, const std::string& series) {
  size_t at = 0;
  while ((at = text.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') {
      const size_t end = text.find('\n', at);
      double v;
      if (absl::SimpleAtod(text.substr(at + series.size() + 1, end - at - series.size() - 1), &v)) {
        return v;
      }
    }
    at += series.size();
  }
  return -1;
}

bool Eventually(const std::function<bool()>& cond) {
  for (int i = 0; i < 3000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path) {
  return HttpRequest(port, "GET", path);
}

absl::StatusOr<HttpResponse> HttpRequest(int port, const std::string& method,
                                         const std::string& path, absl::Duration timeout) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::UnavailableError("socket");
  if (timeout != absl::InfiniteDuration()) {
    const timeval tv = absl::ToTimeval(timeout);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ", std::strerror(errno)));
  }
  const std::string req = absl::StrCat(method, " ", path,
                                       " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                       "Content-Length: 0\r\n\r\n");
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("short write");
  }
  std::string raw;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) raw.append(buf, n);
  const int read_errno = errno;
  close(fd);
  if (n < 0) {
    return absl::UnavailableError(absl::StrCat(method, " ", path, ": ", std::strerror(read_errno),
                                               " after ", raw.size(), " bytes"));
  }
  HttpResponse r;
  const size_t sp = raw.find(' ');
  const size_t body = raw.find("\r\n\r\n");
  if (sp == std::string::npos || body == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(raw).substr(sp + 1, 3), &r.status)) {
    return absl::UnavailableError("malformed HTTP response: " + raw.substr(0, 200));
  }
  r.headers = raw.substr(0, body);
  r.body = raw.substr(body + 4);
  return r;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

CommandResult RunCommand(const std::vector<std::string>& argv) {
  CommandResult result;
  int pipefd[2];
  if (pipe(pipefd) != 0) return result;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipefd[1], STDOUT_FILENO);
    dup2(pipefd[1], STDERR_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(pipefd[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof buf)) > 0) result.output.append(buf, n);
  close(pipefd[0]);
  int status;
  waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

int CorruptPayloadFiles(const std::string& dir,
                     const std::function<std::vector<uint64_t>(uint64_t size)>& offsets) {
  int corrupted = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().extension() != ".kvp") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    for (uint64_t at : offsets(std::filesystem::file_size(e.path()))) {
      for (uint64_t off = at; off < at + 64; ++off) {
        f.seekg(off);
        char ch;
        f.get(ch);
        f.seekp(off);
        f.put(static_cast<char>(ch ^ 0x5a));
      }
    }
    ++corrupted;
  }
  return corrupted;
}

}  // namespace kvtier::testing
