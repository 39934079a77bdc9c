// tls_ceiling_bench: how fast this machine moves bulk bytes over loopback TCP with and
// without TLS when nothing else is in the way: no gRPC, no daemon, one sender process
// and one receiver process, each writing or reading 32 MiB messages as fast as the
// kernel and OpenSSL allow. It bounds what any TLS data path could reach here (a data
// connection outside gRPC's secure endpoint, the candidate for issue 13's TLS target),
// as a ratio against plain TCP measured in the same run.
//
//   tls_ceiling_bench --tls-dir=DIR [--rounds=3] [--mib=1024] [--message-mib=32]
//                     [--json=FILE]
//
// DIR holds tests/tls/make_test_certs.sh's certificates (server.pem, server.key, ca.pem).
// Variants, interleaved round by round: tcp (plain sockets), tls-aes256 (TLS 1.3,
// TLS_AES_256_GCM_SHA384, what kvtierd's gRPC negotiates) and tls-aes128
// (TLS_AES_128_GCM_SHA256). Each prints GB/s (10^9 bytes/s over the transfer, handshake
// excluded) and each side's CPU seconds (user + system) per GB; --json appends one line
// per run ({"kind": "tls_ceiling", ...}) for bench/report.py.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_flags.h"

namespace {

using kvtier::bench::Flag;
using kvtier::bench::StrFlag;

struct Variant {
  const char* name;
  const char* suite;  // TLS 1.3 cipher suite; null: plain TCP.
};
constexpr Variant kVariants[] = {{"tcp", nullptr},
                                 {"tls-aes256", "TLS_AES_256_GCM_SHA384"},
                                 {"tls-aes128", "TLS_AES_128_GCM_SHA256"}};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tls_ceiling_bench: %s\n", what.c_str());
  ERR_print_errors_fp(stderr);
  std::exit(1);
}

double CpuSeconds(const rusage& u) {
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec / 1e6;
}

SSL_CTX* MakeContext(bool server, const Variant& v, const std::string& dir) {
  SSL_CTX* ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) Die("SSL_CTX_new");
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1) Die("TLS 1.3");
  if (SSL_CTX_set_ciphersuites(ctx, v.suite) != 1) Die(std::string("cipher suite ") + v.suite);
  if (server) {
    if (SSL_CTX_use_certificate_chain_file(ctx, (dir + "/server.pem").c_str()) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, (dir + "/server.key").c_str(), SSL_FILETYPE_PEM) != 1) {
      Die("server certificate or key in " + dir);
    }
  } else {
    if (SSL_CTX_load_verify_locations(ctx, (dir + "/ca.pem").c_str(), nullptr) != 1) {
      Die("ca.pem in " + dir);
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  }
  return ctx;
}

// Moves `total` bytes over socket `s` (through `ssl` unless null) in messages of
// `message` bytes, each from or into `buf`: written when `sending`, else read.
void Transfer(SSL* ssl, int s, bool sending, char* buf, uint64_t total, uint64_t message) {
  for (uint64_t done = 0; done < total;) {
    const uint64_t n = std::min(message, total - done);
    for (uint64_t off = 0; off < n;) {
      const int want = static_cast<int>(std::min<uint64_t>(n - off, 1 << 30));
      int moved;
      if (ssl != nullptr) {
        moved = sending ? SSL_write(ssl, buf + off, want) : SSL_read(ssl, buf + off, want);
      } else {
        moved = static_cast<int>(sending ? write(s, buf + off, want) : read(s, buf + off, want));
      }
      if (moved <= 0) Die(sending ? "write" : "read");
      off += static_cast<uint64_t>(moved);
    }
    done += n;
  }
}

// The sender: accepts one connection on `listener`, sends `total` bytes in messages of
// `message` bytes, and exits. Runs in the child process.
[[noreturn]] void Send(int listener, const Variant& v, const std::string& dir, uint64_t total,
                       uint64_t message) {
  int s = accept(listener, nullptr, nullptr);
  if (s < 0) Die("accept");
  std::vector<char> buf(message, 'k');
  SSL* ssl = nullptr;
  if (v.suite != nullptr) {
    ssl = SSL_new(MakeContext(true, v, dir));
    SSL_set_fd(ssl, s);
    if (SSL_accept(ssl) != 1) Die("SSL_accept");
  }
  // The receiver's clock starts first; its one byte says so.
  char go = 0;
  Transfer(ssl, s, /*sending=*/false, &go, 1, 1);
  Transfer(ssl, s, /*sending=*/true, buf.data(), total, message);
  if (ssl != nullptr) SSL_shutdown(ssl);
  close(s);
  std::_Exit(0);
}

struct Run {
  double gbps = 0;
  double send_cpu_per_gb = 0;
  double recv_cpu_per_gb = 0;
};

Run Measure(const Variant& v, const std::string& dir, uint64_t total, uint64_t message) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die("listen on 127.0.0.1");
  }
  const pid_t child = fork();
  if (child < 0) Die("fork");
  if (child == 0) Send(listener, v, dir, total, message);
  close(listener);
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) Die("connect");
  SSL* ssl = nullptr;
  SSL_CTX* ctx = nullptr;
  if (v.suite != nullptr) {
    ctx = MakeContext(false, v, dir);
    ssl = SSL_new(ctx);
    SSL_set_fd(ssl, s);
    if (SSL_set1_host(ssl, "localhost") != 1) Die("SSL_set1_host");
    if (SSL_connect(ssl) != 1) Die("SSL_connect");
  }
  std::vector<char> dst(message);
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  const auto t0 = std::chrono::steady_clock::now();
  char go = 'g';
  Transfer(ssl, s, /*sending=*/true, &go, 1, 1);
  Transfer(ssl, s, /*sending=*/false, dst.data(), total, message);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  int status = 0;
  rusage child_usage{};
  if (wait4(child, &status, 0, &child_usage) != child || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0) {
    Die(std::string("sender failed (") + v.name + ")");
  }
  if (ssl != nullptr) {
    SSL_free(ssl);
    SSL_CTX_free(ctx);
  }
  close(s);
  const double gb = total / 1e9;
  // The sender's handshake is in its figure too: a few milliseconds of a second or more.
  return Run{gb / secs, CpuSeconds(child_usage) / gb,
             (CpuSeconds(after) - CpuSeconds(before)) / gb};
}

double Median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const size_t n = xs.size();
  return n % 2 ? xs[n / 2] : (xs[n / 2 - 1] + xs[n / 2]) / 2;
}

constexpr char kUsage[] =
    "usage: tls_ceiling_bench --tls-dir=DIR [--rounds=3] [--mib=1024] [--message-mib=32]\n"
    "                         [--json=FILE]\n"
    "Loopback TCP against TLS 1.3 (OpenSSL, AES-256-GCM and AES-128-GCM) between two\n"
    "processes, no gRPC: the ceiling of any TLS data path on this machine. DIR holds\n"
    "tests/tls/make_test_certs.sh's certificates.\n";

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  kvtier::bench::InitFlags(argc, argv);
  const std::string dir = StrFlag("tls-dir", "");
  if (dir.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const int rounds = static_cast<int>(Flag("rounds", 3));
  const uint64_t total = static_cast<uint64_t>(Flag("mib", 1024)) << 20;
  const uint64_t message = static_cast<uint64_t>(Flag("message-mib", 32)) << 20;
  if (rounds < 1 || total == 0 || message == 0) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string json = StrFlag("json", "");
  FILE* out = json.empty() ? nullptr : std::fopen(json.c_str(), "a");
  if (!json.empty() && out == nullptr) Die("cannot open " + json);
  std::map<std::string, std::vector<Run>> runs;
  for (int r = 0; r < rounds; ++r) {
    for (const Variant& v : kVariants) {
      const Run run = Measure(v, dir, total, message);
      runs[v.name].push_back(run);
      if (out != nullptr) {
        std::fprintf(out,
                     "{\"kind\": \"tls_ceiling\", \"variant\": \"%s\", \"round\": %d, "
                     "\"bytes\": %llu, \"message_bytes\": %llu, \"gbps\": %.4f, "
                     "\"send_cpu_s_per_gb\": %.4f, \"recv_cpu_s_per_gb\": %.4f}\n",
                     v.name, r + 1, static_cast<unsigned long long>(total),
                     static_cast<unsigned long long>(message), run.gbps, run.send_cpu_per_gb,
                     run.recv_cpu_per_gb);
        std::fflush(out);
      }
    }
  }
  if (out != nullptr) std::fclose(out);
  std::printf("| variant | GB/s (median of %d) | / tcp | sender CPU s/GB | receiver CPU s/GB |\n",
              rounds);
  std::printf("|---|---|---|---|---|\n");
  const auto median_of = [&](const std::string& name, double Run::*field) {
    std::vector<double> xs;
    for (const Run& run : runs[name]) xs.push_back(run.*field);
    return Median(xs);
  };
  const double tcp = median_of("tcp", &Run::gbps);
  for (const Variant& v : kVariants) {
    const double g = median_of(v.name, &Run::gbps);
    std::printf("| %s | %.3f | %.2f | %.2f | %.2f |\n", v.name, g, g / tcp,
                median_of(v.name, &Run::send_cpu_per_gb),
                median_of(v.name, &Run::recv_cpu_per_gb));
  }
  return 0;
}
