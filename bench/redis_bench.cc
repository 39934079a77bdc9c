// Redis baseline for bench/run.sh: the same chunk puts (SET) and gets (GET) as kv_bench's
// RAM-tier grid, against a redis-server on a loopback port (persistence off).
//
// The client speaks RESP directly over one TCP connection per client thread: a SET is
// written with writev straight from one shared payload buffer, and a GET reply's bytes are
// read into a 1 MiB per-thread scratch buffer and discarded. That mirrors kv_bench
// (shared put payload, GetStream callback that discards). hiredis would copy every SET
// argument into a command buffer and every GET reply into a reply object: 2 x 8 GiB of
// client memory at 128 MiB x 64 clients on this machine, which would measure the
// allocator, not Redis.
//
// usage: redis_bench --port=P [--chunks=2,32,128] [--clients=1,4,16,64]
//                    [--budget-mib=2048] [--hot-mib=1024] [--json=FILE]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_flags.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvtier::bench::Flag;
using kvtier::bench::ListFlag;
using kvtier::bench::Pct;
using kvtier::bench::StrFlag;

class Conn {
 public:
  explicit Conn(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      std::perror("connect");
      std::exit(1);
    }
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~Conn() { close(fd_); }

  bool Set(const std::string& key, const char* data, size_t n) {
    std::string head = "*3\r\n$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + key +
                       "\r\n$" + std::to_string(n) + "\r\n";
    iovec iov[3] = {{head.data(), head.size()}, {const_cast<char*>(data), n},
                    {const_cast<char*>("\r\n"), 2}};
    if (!WriteAll(iov, 3)) return false;
    std::string line = ReadLine();
    return line == "+OK";
  }
  // Returns the value's length (-1: error or nil); the bytes are discarded.
  int64_t Get(const std::string& key) {
    std::string cmd = "*2\r\n$3\r\nGET\r\n$" + std::to_string(key.size()) + "\r\n" + key + "\r\n";
    iovec iov[1] = {{cmd.data(), cmd.size()}};
    if (!WriteAll(iov, 1)) return -1;
    std::string line = ReadLine();
    if (line.empty() || line[0] != '$') return -1;
    const int64_t n = std::strtoll(line.c_str() + 1, nullptr, 10);
    if (n < 0) return -1;
    if (!Discard(n + 2)) return -1;
    return n;
  }
  bool Command(const std::vector<std::string>& args) {
    std::string cmd = "*" + std::to_string(args.size()) + "\r\n";
    for (auto& a : args) cmd += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
    iovec iov[1] = {{cmd.data(), cmd.size()}};
    return WriteAll(iov, 1) && !ReadLine().empty();
  }

 private:
  bool WriteAll(iovec* iov, int cnt) {
    while (cnt > 0) {
      ssize_t w = writev(fd_, iov, cnt);
      if (w <= 0) return false;
      while (cnt > 0 && static_cast<size_t>(w) >= iov->iov_len) w -= iov->iov_len, ++iov, --cnt;
      if (cnt > 0) iov->iov_base = static_cast<char*>(iov->iov_base) + w, iov->iov_len -= w;
    }
    return true;
  }
  bool Fill() {
    if (pos_ == len_) pos_ = len_ = 0;
    ssize_t r = read(fd_, buf_.data() + len_, buf_.size() - len_);
    if (r <= 0) return false;
    len_ += r;
    return true;
  }
  std::string ReadLine() {
    std::string out;
    for (;;) {
      for (; pos_ < len_; ++pos_) {
        if (buf_[pos_] == '\n') {
          ++pos_;
          if (!out.empty() && out.back() == '\r') out.pop_back();
          return out;
        }
        out.push_back(buf_[pos_]);
      }
      if (!Fill()) return "";
    }
  }
  bool Discard(int64_t n) {
    while (n > 0) {
      if (pos_ == len_ && !Fill()) return false;
      const int64_t k = std::min<int64_t>(n, len_ - pos_);
      pos_ += k, n -= k;
    }
    return true;
  }
  int fd_ = -1;
  std::vector<char> buf_ = std::vector<char>(1 << 20);
  size_t pos_ = 0, len_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  kvtier::bench::InitFlags(argc, argv);
  const int port = static_cast<int>(Flag("port", 6379));
  const uint64_t budget = Flag("budget-mib", 2048) << 20;
  const uint64_t hot = Flag("hot-mib", 1024) << 20;
  const std::string json = StrFlag("json", "");
  std::printf("| system | op | chunk | clients | ops | GB/s | p50 ms | p99 ms | errors |\n|---|---|---|---|---|---|---|---|---|\n");
  for (uint64_t cmib : ListFlag("chunks", "2,32,128")) {
    const uint64_t cb = cmib << 20;
    std::string payload(cb, '\0');
    for (size_t i = 0; i < cb; i += 8) std::memcpy(&payload[i], &i, std::min<size_t>(8, cb - i));
    const uint64_t nkeys = std::max<uint64_t>(1, hot / cb);
    auto key = [&](uint64_t i) { return "c" + std::to_string(cmib) + ":" + std::to_string(i % nkeys); };
    Conn(port).Command({"FLUSHALL"});
    for (const char* op : {"put", "get"}) {
      for (uint64_t clients : ListFlag("clients", "1,4,16,64")) {
        const uint64_t ops = std::max(clients, budget / cb);
        std::atomic<uint64_t> next{0}, bytes{0}, errors{0};
        std::vector<double> lat;
        std::mutex mu;
        std::vector<std::thread> ts;
        std::vector<std::unique_ptr<Conn>> conns;
        for (uint64_t w = 0; w < clients; ++w) conns.push_back(std::make_unique<Conn>(port));
        // Warm-up, as kv_bench does: before a cell's clock starts, each connection moves
        // one chunk of this size the way the cell will (puts it, or gets it).
        if (Flag("warm", 1) != 0) {
          const bool put = std::strcmp(op, "put") == 0;
          const std::string warm_key = "warm:" + std::to_string(cmib);
          if (!put) conns[0]->Set(warm_key, payload.data(), cb);
          std::vector<std::thread> warmers;
          for (uint64_t w = 0; w < clients; ++w) {
            warmers.emplace_back([&, w] {
              if (put) {
                conns[w]->Set(warm_key, payload.data(), cb);
              } else {
                conns[w]->Get(warm_key);
              }
            });
          }
          for (auto& t : warmers) t.join();
        }
        const auto t0 = Clock::now();
        for (uint64_t w = 0; w < clients; ++w) {
          ts.emplace_back([&, w] {
            std::vector<double> mine;
            for (uint64_t i; (i = next.fetch_add(1)) < ops;) {
              const auto a = Clock::now();
              int64_t n = std::strcmp(op, "put") == 0
                              ? (conns[w]->Set(key(i), payload.data(), cb) ? int64_t(cb) : -1)
                              : conns[w]->Get(key(i));
              mine.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
              if (n < 0) errors++; else bytes += n;
            }
            std::lock_guard<std::mutex> l(mu);
            lat.insert(lat.end(), mine.begin(), mine.end());
          });
        }
        for (auto& t : ts) t.join();
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        const double gbps = bytes / secs / 1e9;
        std::printf("| redis | %s | %lu MiB | %lu | %lu | %.3f | %.2f | %.2f | %lu |\n", op, cmib,
                    clients, ops, gbps, Pct(lat, 0.5), Pct(lat, 0.99), errors.load());
        std::fflush(stdout);
        if (!json.empty()) {
          std::ofstream f(json, std::ios::app);
          char line[512];
          std::snprintf(line, sizeof line,
                        "{\"kind\": \"cell\", \"tier\": \"redis\", \"op\": \"%s\", \"chunk_mib\": %lu, "
                        "\"clients\": %lu, \"ops\": %lu, \"bytes\": %lu, \"secs\": %.6g, \"gbps\": %.6g, "
                        "\"p50_ms\": %.6g, \"p99_ms\": %.6g, \"errors\": %lu}\n",
                        op, cmib, clients, ops, bytes.load(), secs, gbps, Pct(lat, 0.5),
                        Pct(lat, 0.99), errors.load());
          f << line;
        }
      }
    }
  }
  Conn(port).Command({"FLUSHALL"});
  return 0;
}
