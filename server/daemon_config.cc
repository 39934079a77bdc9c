#include "server/daemon_config.h"

#include <algorithm>

#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string_view>
#include <thread>
#include <utility>

#include <toml++/toml.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "storage/redis/redis_tls_context.h"

namespace kvtier {
namespace {

struct Option {
  const char* name;
  const char* help;
  bool is_bool;
  std::function<absl::Status(DaemonConfig&, absl::string_view)> set;
  std::function<std::string(const DaemonConfig&)> get;
};

absl::Status BadValue(absl::string_view name, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("option ", name, ": bad value '", value, "': ", why));
}

Option SizeOption(const char* name, const char* help, uint64_t DaemonConfig::*field) {
  return {name, help, false,
          [name, field](DaemonConfig& c, absl::string_view v) -> absl::Status {
            auto bytes = ParseByteSize(v);
            if (!bytes.ok()) return BadValue(name, v, bytes.status().message());
            c.*field = *bytes;
            return absl::OkStatus();
          },
          [field](const DaemonConfig& c) { return FormatBytes(c.*field); }};
}

Option StringOption(const char* name, const char* help, std::string DaemonConfig::*field) {
  return {name, help, false,
          [field](DaemonConfig& c, absl::string_view v) {
            c.*field = std::string(v);
            return absl::OkStatus();
          },
          [field](const DaemonConfig& c) { return c.*field; }};
}

Option BoolOption(const char* name, const char* help, bool DaemonConfig::*field) {
  return {name, help, true,
          [name, field](DaemonConfig& c, absl::string_view v) -> absl::Status {
            if (!absl::SimpleAtob(v, &(c.*field))) return BadValue(name, v, "not a boolean");
            return absl::OkStatus();
          },
          [field](const DaemonConfig& c) { return std::string(c.*field ? "true" : "false"); }};
}

Option UintOption(const char* name, const char* help, uint32_t DaemonConfig::*field) {
  return {name, help, false,
          [name, field](DaemonConfig& c, absl::string_view v) -> absl::Status {
            if (!absl::SimpleAtoi(v, &(c.*field))) return BadValue(name, v, "not an unsigned integer");
            return absl::OkStatus();
          },
          [field](const DaemonConfig& c) { return absl::StrCat(c.*field); }};
}

Option DoubleOption(const char* name, const char* help, double DaemonConfig::*field) {
  return {name, help, false,
          [name, field](DaemonConfig& c, absl::string_view v) -> absl::Status {
            if (!absl::SimpleAtod(v, &(c.*field))) return BadValue(name, v, "not a number");
            return absl::OkStatus();
          },
          [field](const DaemonConfig& c) { return absl::StrCat(c.*field); }};
}

constexpr absl::Duration kMaxDuration = absl::Hours(24 * 3650);
// Threads are started as they are needed, but each costs a stack; past this a
// systemd task limit would abort the daemon at the first burst.
constexpr uint32_t kMaxRpcThreads = 8192;

Option DurationOption(const char* name, const char* help, absl::Duration DaemonConfig::*field) {
  return {name, help, false,
          [name, field](DaemonConfig& c, absl::string_view v) -> absl::Status {
            absl::Duration d;
            if (!absl::ParseDuration(v, &d)) {
              return BadValue(name, v, "not a duration (e.g. 30s, 5m, 24h, 0)");
            }
            // Infinite or decades long overflows where it meets a clock (a deadline of
            // now + d) or a protocol (Redis PX).
            if (d < -kMaxDuration || d > kMaxDuration) {
              return BadValue(name, v, "longer than 10 years (0 turns off what can be off)");
            }
            c.*field = d;
            return absl::OkStatus();
          },
          [field](const DaemonConfig& c) { return absl::FormatDuration(c.*field); }};
}

const std::vector<Option>& Options() {
  static const auto* options = new std::vector<Option>{
      StringOption("listen", "gRPC listen address host:port (port 0 picks a free one)",
                   &DaemonConfig::listen),
      StringOption("tls_cert_file", "TLS: the server's certificate chain (PEM); with tls_key_file",
                   &DaemonConfig::tls_cert_file),
      StringOption("tls_key_file", "TLS: the server's private key (PEM)",
                   &DaemonConfig::tls_key_file),
      StringOption("tls_client_ca_file",
                   "mutual TLS: CA certificates (PEM) client certificates must chain to",
                   &DaemonConfig::tls_client_ca_file),
      DurationOption("tls_reload_interval",
                     "how often the TLS files are re-read (rotation without a restart)",
                     &DaemonConfig::tls_reload_interval),
      BoolOption("allow_insecure_remote",
                 "serve plaintext gRPC on a non-loopback address (refused otherwise)",
                 &DaemonConfig::allow_insecure_remote),
      BoolOption("grpc_reflection",
                 "serve gRPC server reflection (grpcurl); off on a daemon exposed to "
                 "untrusted peers: each reflection stream holds a gRPC thread",
                 &DaemonConfig::grpc_reflection),
      StringOption("listen_unix",
                   "also serve gRPC on this Unix socket path; the peer uid is its identity",
                   &DaemonConfig::listen_unix),
      StringOption("tenants_file",
                   "tenants, credentials, roles and rates; empty: one implicit tenant",
                   &DaemonConfig::tenants_file),
      UintOption("max_streams",
                 "streaming calls (Put, Get, Prefill, Events) open at once; more: RESOURCE_EXHAUSTED",
                 &DaemonConfig::max_streams),
      UintOption("max_streams_per_connection", "HTTP/2 streams one client connection may open",
                 &DaemonConfig::max_streams_per_connection),
      UintOption("max_rpc_threads",
                 "threads for unary calls and Prefill sessions (max_prefill_sessions of "
                 "them; the rest run unary calls, 1024 more may wait); more: "
                 "RESOURCE_EXHAUSTED",
                 &DaemonConfig::max_rpc_threads),
      UintOption("max_prefill_sessions",
                 "Prefill sessions open at once (each holds a gRPC thread); 0: half of "
                 "max_rpc_threads; more: RESOURCE_EXHAUSTED",
                 &DaemonConfig::max_prefill_sessions),
      DurationOption("client_idle_timeout",
                     "cancel a Put, Get, Prefill or Events call whose client sends nothing "
                     "(Put, a Prefill's open) or reads nothing (Get, Prefill, Events) for "
                     "this long; 0: never",
                     &DaemonConfig::client_idle_timeout),
      DurationOption("put_place_idle",
                     "cancel a Put holding a place within max_put_buffer that completes no "
                     "frame for this long while other Puts wait in line; 0: "
                     "client_idle_timeout only",
                     &DaemonConfig::put_place_idle),
      StringOption("data_dir", "data directory; RocksDB lives in <data_dir>/ssd",
                   &DaemonConfig::data_dir),
      SizeOption("ram_capacity", "host-RAM pool size", &DaemonConfig::ram_capacity),
      SizeOption("ram_slot_size", "host-RAM pool slot size (multiple of 4KiB)",
                 &DaemonConfig::ram_slot_size),
      BoolOption("lock_memory", "mlock the host-RAM pool", &DaemonConfig::lock_memory),
      BoolOption("ram_prefault",
                 "fault the host-RAM pool's pages in at start-up, in the background",
                 &DaemonConfig::ram_prefault),
      BoolOption("ram_huge_pages",
                 "ask for transparent huge pages on the host-RAM pool (MADV_HUGEPAGE)",
                 &DaemonConfig::ram_huge_pages),
      DoubleOption("max_pinned_fraction", "largest share of the RAM pool pinned chunks may hold",
                   &DaemonConfig::max_pinned_fraction),
      SizeOption("ssd_capacity", "SSD tier capacity (chunk bytes, each rounded up to 4 KiB)",
                 &DaemonConfig::ssd_capacity),
      DurationOption("ssd_ttl", "drop SSD chunks older than this; 0 keeps them",
                     &DaemonConfig::ssd_ttl),
      BoolOption("ssd_sync_writes", "fdatasync the payload and the index row on every put",
                 &DaemonConfig::ssd_sync_writes),
      SizeOption("ssd_write_buffer", "RocksDB memtable budget (SSD index rows)", &DaemonConfig::ssd_write_buffer),
      SizeOption("ssd_stream_buffer",
                 "memory for SSD chunks streamed a frame at a time when RAM has no room",
                 &DaemonConfig::ssd_stream_buffer),
      StringOption("write_mode", "write-back | write-through | ram-only",
                   &DaemonConfig::write_mode),
      SizeOption("max_frame_size", "largest data field of one Put/Get frame",
                 &DaemonConfig::max_frame_size),
      SizeOption("stream_window",
                 "HTTP/2 receive window per stream: put bytes buffered ahead of the pool",
                 &DaemonConfig::stream_window),
      SizeOption("http2_max_frame",
                 "largest HTTP/2 DATA frame clients may send (gRPC's default: 16KiB)",
                 &DaemonConfig::http2_max_frame),
      SizeOption("max_put_buffer",
                 "bytes gRPC may buffer for open Put streams outside the pool (each counts "
                 "stream_window + max_frame_size); 0: ram_capacity / 8, at most 8 streams "
                 "per CPU, at least 64MiB",
                 &DaemonConfig::max_put_buffer),
      UintOption("max_put_waiters",
                 "Put streams that may wait in line (up to put_wait each) for a place within "
                 "max_put_buffer before new ones are refused; 0: none wait",
                 &DaemonConfig::max_put_waiters),
      UintOption("get_send_turns",
                 "Get calls sending RAM chunks at once; the others wait their turn, a chunk "
                 "each; 0: 2 per CPU, at least 4",
                 &DaemonConfig::get_send_turns),
      SizeOption("grpc_memory",
                 "memory gRPC may hold for received bytes on all connections (its resource "
                 "quota; bounds oversized messages); 0: half the memory beside ram_capacity, "
                 "at least twice max_put_buffer",
                 &DaemonConfig::grpc_memory),
      UintOption("max_keys_per_request", "most keys in one Lookup/Get/Pin/Unpin/Delete/Prefill",
                 &DaemonConfig::max_keys_per_request),
      UintOption("max_leases", "most Lookup leases live at once",
                 &DaemonConfig::max_leases),
      UintOption("max_lease_seconds", "longest Lookup lease; longer requests are cut to it",
                 &DaemonConfig::max_lease_seconds),
      SizeOption("max_lease_bytes",
                 "RAM-tier chunk bytes all Lookup leases may hold (0: half the RAM pool)",
                 &DaemonConfig::max_lease_bytes),
      SizeOption("max_chunk_size", "largest chunk a registered layout may have",
                 &DaemonConfig::max_chunk_size),
      DurationOption("put_wait",
                     "how long a put waits, in arrival order, for room in the RAM pool (and, in line, "
                     "for a place within max_put_buffer)",
                     &DaemonConfig::put_wait),
      DurationOption("shutdown_grace", "time in-flight RPCs get at shutdown",
                     &DaemonConfig::shutdown_grace),
      StringOption("log_level", "debug | info | warn | error", &DaemonConfig::log_level),
      SizeOption("prefill_bandwidth_limit",
                 "daemon-wide cap on Prefill streaming, bytes per second (0: none)",
                 &DaemonConfig::prefill_bandwidth_limit),
      StringOption("shm_socket",
                   "region socket for same-host shared memory: auto | off | /path | @name",
                   &DaemonConfig::shm_socket),
      StringOption("shm_allowed_group",
                   "group (name or gid) whose members may register memory, besides the "
                   "daemon's user and root",
                   &DaemonConfig::shm_allowed_group),
      UintOption("shm_max_regions", "shared-memory regions mapped at once, all clients",
                 &DaemonConfig::shm_max_regions),
      SizeOption("shm_max_region_bytes", "largest shared-memory region a client may register",
                 &DaemonConfig::shm_max_region_bytes),
      UintOption("shm_copy_threads",
                 "threads one shared-memory copy may use, the RPC's own included "
                 "(0: one per core, at most 8; 1: no helpers)",
                 &DaemonConfig::shm_copy_threads),
      UintOption("prefill_prefetch_window", "chunks a Prefill session reads ahead",
                 &DaemonConfig::prefill_prefetch_window),
      UintOption("prefill_ssd_reads",
                 "SSD chunk reads into RAM in flight across all Prefill sessions",
                 &DaemonConfig::prefill_ssd_reads),
      UintOption("writeback_threads",
                 "write-back: threads writing dirty chunks to SSD, one chunk each at a time",
                 &DaemonConfig::writeback_threads),
      SizeOption("writeback_max_dirty",
                 "write-back: bytes not yet on SSD (in RAM, and of puts admitted and still "
                 "arriving) before puts wait for the flushers (0: half of ram_capacity)",
                 &DaemonConfig::writeback_max_dirty),
      StringOption("eviction_policy", "RAM and SSD eviction: lru | prefix-lru | prefix-cost",
                   &DaemonConfig::eviction_policy),
      DoubleOption("eviction_cost_slope",
                   "prefix-cost: recomputing chunk i costs 1 + slope * i times chunk 0",
                   &DaemonConfig::eviction_cost_slope),
      DoubleOption("eviction_cost_weight",
                   "prefix-cost: recency (inserts and accesses) one unit of cost is worth",
                   &DaemonConfig::eviction_cost_weight),
      DoubleOption("hint_window_fraction",
                   "share of the RAM pool that hinted chunks (Hint) may hold and prefetch into",
                   &DaemonConfig::hint_window_fraction),
      UintOption("max_hint_keys", "most keys one client's Hint may name; more are cut",
                 &DaemonConfig::max_hint_keys),
      UintOption("max_hint_clients", "most clients with a live Hint",
                 &DaemonConfig::max_hint_clients),
      UintOption("max_layouts",
                 "most layouts registered (kept until the data directory is cleared); a "
                 "tenant's share is an equal part unless the tenants file sets max_layouts",
                 &DaemonConfig::max_layouts),
      DurationOption("hint_ttl", "a client's Hint not renewed for this long is dropped",
                     &DaemonConfig::hint_ttl),
      UintOption("event_buffer", "chunk events kept for Events subscribers",
                 &DaemonConfig::event_buffer),
      StringOption("gpu", "GPU for the staging tier: auto | off | device ordinal",
                   &DaemonConfig::gpu),
      SizeOption("gpu_staging_size", "GPU staging buffers (device memory); 0: none",
                 &DaemonConfig::gpu_staging_size),
      UintOption("gpu_copy_streams", "CUDA streams the GPU tier's copies are spread over",
                 &DaemonConfig::gpu_copy_streams),
      UintOption("gpu_crc_threads",
                 "threads checking a GPU delivery's CRC32C beside its own; 0: half the cores",
                 &DaemonConfig::gpu_crc_threads),
      StringOption("remote_seeds",
                   "shared tier: Redis Cluster seed nodes, host:port[,host:port...]; empty: none",
                   &DaemonConfig::remote_seeds),
      StringOption("remote_user", "shared tier: Redis ACL user (with remote_password_file)",
                   &DaemonConfig::remote_user),
      StringOption("remote_password_file",
                   "shared tier: file holding the Redis password (AUTH); empty: none",
                   &DaemonConfig::remote_password_file),
      StringOption("remote_key_prefix", "shared tier: prefix of every key kvtier writes",
                   &DaemonConfig::remote_key_prefix),
      DurationOption("remote_ttl", "shared tier: chunks expire this long after written",
                     &DaemonConfig::remote_ttl),
      SizeOption("remote_segment_size",
                 "shared tier: chunks are split into segments of this size over the slots",
                 &DaemonConfig::remote_segment_size),
      SizeOption("remote_max_pending",
                 "shared tier: chunk bytes queued for writing at most (more are not "
                 "shared); 0: ram_capacity / 8, at most 256MiB",
                 &DaemonConfig::remote_max_pending),
      UintOption("remote_connections_per_node", "shared tier: connections to each Redis node",
                 &DaemonConfig::remote_connections_per_node),
      DurationOption("remote_timeout",
                     "shared tier: a Redis connect, read or write taking longer fails",
                     &DaemonConfig::remote_timeout),
      BoolOption("remote_tls", "shared tier: connect to the Redis nodes over TLS",
                 &DaemonConfig::remote_tls),
      StringOption("remote_tls_ca_file",
                   "shared tier: CA certificates (PEM) the Redis servers' certificates are "
                   "verified with; empty: the system trust store",
                   &DaemonConfig::remote_tls_ca_file),
      StringOption("remote_tls_cert_file",
                   "shared tier: client certificate chain (PEM) for Redis mutual TLS; with "
                   "remote_tls_key_file",
                   &DaemonConfig::remote_tls_cert_file),
      StringOption("remote_tls_key_file", "shared tier: the client certificate's private key (PEM)",
                   &DaemonConfig::remote_tls_key_file),
      StringOption("remote_tls_server_name",
                   "shared tier: the name every Redis certificate must carry; empty: the "
                   "host each node is reached at",
                   &DaemonConfig::remote_tls_server_name),
      StringOption("metrics_listen",
                   "HTTP address of /metrics and /healthz, host:port; empty turns it off",
                   &DaemonConfig::metrics_listen),
      StringOption("port_file",
                   "write the bound gRPC port (line 1) and metrics port (line 2) here",
                   &DaemonConfig::port_file),
  };
  return *options;
}

const Option* FindOption(absl::string_view name) {
  const std::string normalized = absl::StrReplaceAll(name, {{"-", "_"}});
  for (const Option& o : Options()) {
    if (normalized == o.name) return &o;
  }
  return nullptr;
}

RedisTls RemoteTlsOf(const DaemonConfig& c) {
  RedisTls tls;
  tls.enabled = c.remote_tls;
  tls.ca_file = c.remote_tls_ca_file;
  tls.cert_file = c.remote_tls_cert_file;
  tls.key_file = c.remote_tls_key_file;
  tls.server_name = c.remote_tls_server_name;
  return tls;
}

// The remote_tls_* options agree with each other, and their files can be used (the
// context is built here and dropped; the store builds its own at open).
absl::Status ValidateRemoteTls(const DaemonConfig& c) {
  if (!c.remote_tls) {
    const std::pair<const char*, const std::string*> fields[] = {
        {"remote_tls_ca_file", &c.remote_tls_ca_file},
        {"remote_tls_cert_file", &c.remote_tls_cert_file},
        {"remote_tls_key_file", &c.remote_tls_key_file},
        {"remote_tls_server_name", &c.remote_tls_server_name}};
    for (const auto& [name, value] : fields) {
      if (!value->empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "option ", name, ": set, but remote_tls is false (set remote_tls = true for TLS "
            "to Redis)"));
      }
    }
    return absl::OkStatus();
  }
  if (c.remote_tls_cert_file.empty() != c.remote_tls_key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option ", c.remote_tls_cert_file.empty() ? "remote_tls_cert_file" : "remote_tls_key_file",
        ": a client certificate needs both remote_tls_cert_file and remote_tls_key_file"));
  }
  auto context = RedisTlsContext::Create(RemoteTlsOf(c));
  if (context.ok()) return absl::OkStatus();
  // Create's messages start with the RedisTls field: "ca_file: '/x': cannot read: ...".
  if (context.status().code() == absl::StatusCode::kInvalidArgument) {
    return absl::InvalidArgumentError(absl::StrCat("option remote_tls_", context.status().message()));
  }
  return absl::InvalidArgumentError(absl::StrCat("option remote_tls: ", context.status().message()));
}

// A config file: a regular file (not a directory, which reads as empty, nor a FIFO or
// /dev/zero, which never end) of at most 1 MiB (the whole option table is a few KiB).
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  constexpr int64_t kMaxBytes = 1 << 20;
  const auto bad = [&path](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("option config: '", path, "': ", what));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return bad(absl::StrCat("cannot read: ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return bad("is not a regular file");
  }
  if (st.st_size > kMaxBytes) {
    ::close(fd);
    return bad("is larger than 1 MiB; not a kvtierd config");
  }
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return bad(absl::StrCat("cannot read: ", std::strerror(err)));
    }
    out.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(out.size()) > kMaxBytes) break;  // Grew while read.
  }
  ::close(fd);
  if (static_cast<int64_t>(out.size()) > kMaxBytes) return bad("is larger than 1 MiB");
  return out;
}

// toml++ parses a dotted key or table header recursively, a stack frame per level: tens
// of thousands of levels overflow the stack. kvtierd's options are flat, so anything
// nested past a few levels is refused before parsing, naming the line.
absl::Status CheckKeyDepth(absl::string_view text, absl::string_view source_name) {
  constexpr int kMaxDots = 16;
  int line_no = 0;
  bool in_multiline = false;  // Inside a """ or ''' string spanning lines.
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const int quotes = [&] {
      int n = 0;
      for (size_t at = 0; (at = line.find("\"\"\"", at)) != absl::string_view::npos; at += 3) ++n;
      for (size_t at = 0; (at = line.find("'''", at)) != absl::string_view::npos; at += 3) ++n;
      return n;
    }();
    const bool was_in = in_multiline;
    if (quotes % 2 == 1) in_multiline = !in_multiline;
    if (was_in) continue;
    // The key part: up to the first '=' outside quotes for a key/value line (a quoted
    // key may hold '='), the whole line for a header.
    int dots = 0;
    char quote = 0;
    for (char c : line) {
      if (quote != 0) {
        if (c == quote) quote = 0;
      } else if (c == '"' || c == '\'') {
        quote = c;
      } else if (c == '#' || c == '=') {
        break;
      } else if (c == '.') {
        ++dots;
      }
    }
    if (dots > kMaxDots) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "config %s: line %d: a key nested %d levels deep; kvtierd's options are flat",
          source_name, line_no, dots + 1));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  size_t split = 0;
  while (split < s.size() && (absl::ascii_isdigit(s[split]) || s[split] == '.')) ++split;
  double value;
  if (split == 0 || !absl::SimpleAtod(s.substr(0, split), &value)) {
    return absl::InvalidArgumentError("expected a size like 512MiB, 4GiB or 1048576");
  }
  std::string unit(absl::StripAsciiWhitespace(s.substr(split)));
  static const std::pair<const char*, uint64_t> kUnits[] = {
      {"", 1},           {"b", 1},
      {"k", 1ull << 10}, {"kb", 1000},          {"kib", 1ull << 10},
      {"m", 1ull << 20}, {"mb", 1000000},       {"mib", 1ull << 20},
      {"g", 1ull << 30}, {"gb", 1000000000ull}, {"gib", 1ull << 30},
      {"t", 1ull << 40}, {"tb", 1000000000000ull}, {"tib", 1ull << 40},
  };
  for (const auto& [name, mult] : kUnits) {
    if (unit == name) {
      const double bytes = value * static_cast<double>(mult);
      if (bytes > 9.2e18) return absl::InvalidArgumentError("size too large");
      // Not 0 for a size that is not 0: 0 means "no limit" for quotas.
      if (bytes > 0 && bytes < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("size '", text, "' is less than one byte"));
      }
      return static_cast<uint64_t>(bytes);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown size unit '", unit, "'"));
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  uint64_t v = bytes;
  while (u < 4 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++u;
  }
  return absl::StrCat(v, kUnits[u]);
}

namespace {

// The port of a host:port address: digits, at most 65535 (gRPC and the HTTP server
// would otherwise take it modulo 65536 and bind another port). Empty: fine.
absl::Status CheckPort(const char* option, const std::string& address) {
  const std::string port = address.substr(address.rfind(':') + 1);
  uint32_t n = 0;
  if (port.empty() || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      port.size() > 5 || !absl::SimpleAtoi(port, &n) || n > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option ", option, ": the port of '", address, "' must be a number from 0 to 65535"));
  }
  return absl::OkStatus();
}

}  // namespace

bool DaemonConfig::ListenIsLoopback() const {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::Status DaemonConfig::Validate() const {
  if (listen.empty() || listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("option listen: expected host:port, got '", listen, "'"));
  }
  if (absl::Status s = CheckPort("listen", listen); !s.ok()) return s;
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "option tls_cert_file: TLS needs both tls_cert_file and tls_key_file");
  }
  if (!tls_client_ca_file.empty() && !tls()) {
    return absl::InvalidArgumentError(
        "option tls_client_ca_file: mutual TLS needs tls_cert_file and tls_key_file too");
  }
  if (tls() && tls_reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError("option tls_reload_interval: must be at least 1s");
  }
  if (!tls() && !allow_insecure_remote && !ListenIsLoopback()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option listen: ", listen, " is reachable beyond this host and TLS is off; set "
        "tls_cert_file and tls_key_file (and tls_client_ca_file for mutual TLS), or "
        "allow_insecure_remote = true to serve plaintext anyway"));
  }
  if (tls() && tls_client_ca_file.empty() && tenants_file.empty() && !allow_insecure_remote &&
      !ListenIsLoopback()) {
    // TLS alone hides the traffic but checks no caller: each would be the implicit
    // tenant, with the admin role (Clear, Delete, Pin of every namespace).
    return absl::InvalidArgumentError(absl::StrCat(
        "option listen: ", listen, " is reachable beyond this host and nothing "
        "authenticates callers (TLS without tls_client_ca_file, and no tenants_file), so "
        "any of them would be the implicit admin tenant; set tls_client_ca_file (mutual "
        "TLS) or tenants_file, or allow_insecure_remote = true to serve them all anyway"));
  }
  if (!listen_unix.empty() && listen_unix[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "option listen_unix: expected an absolute path or empty, got '", listen_unix, "'"));
  }
  if (max_streams == 0 || max_streams_per_connection == 0) {
    return absl::InvalidArgumentError(
        "option max_streams: max_streams and max_streams_per_connection must be at least 1");
  }
  if (max_rpc_threads < 8 || max_rpc_threads > kMaxRpcThreads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option max_rpc_threads: must be 8 (gRPC's pollers need some) to ", kMaxRpcThreads,
        ", got ", max_rpc_threads));
  }
  if (max_streams_per_connection > uint64_t{std::numeric_limits<int32_t>::max()}) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option max_streams_per_connection: at most ", std::numeric_limits<int32_t>::max(),
        " (HTTP/2's limit), got ", max_streams_per_connection));
  }
  if (max_prefill_sessions > max_rpc_threads / 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option max_prefill_sessions: at most half of max_rpc_threads (", max_rpc_threads / 2,
        "), so that unary calls keep threads; got ", max_prefill_sessions));
  }
  if (data_dir.empty()) return absl::InvalidArgumentError("option data_dir: must not be empty");
  if (!metrics_listen.empty() && metrics_listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option metrics_listen: expected host:port or empty, got '", metrics_listen, "'"));
  }
  if (!metrics_listen.empty()) {
    if (absl::Status s = CheckPort("metrics_listen", metrics_listen); !s.ok()) return s;
  }
  if (max_frame_size < 4096 || max_frame_size > (64ull << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option max_frame_size: must be between 4KiB and 64MiB, got ", max_frame_size));
  }
  if (stream_window < (64ull << 10) || stream_window >= (1ull << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option stream_window: must be at least 64KiB and under 1GiB, got ", stream_window));
  }
  if (http2_max_frame < (16ull << 10) || http2_max_frame >= (16ull << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option http2_max_frame: must be at least 16KiB and under 16MiB (HTTP/2's bounds), "
        "got ", http2_max_frame));
  }
  if (max_put_buffer != 0 && max_put_buffer < stream_window + max_frame_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option max_put_buffer: must hold at least one Put stream (stream_window + "
        "max_frame_size = ", stream_window + max_frame_size, "), got ", max_put_buffer));
  }
  if (grpc_memory != 0 && grpc_memory / 2 < PutBufferBytes()) {
    // At less, the Put streams max_put_buffer admits can fill gRPC's quota alone, and
    // gRPC then closes connections that did nothing wrong.
    return absl::InvalidArgumentError(absl::StrCat(
        "option grpc_memory: must be at least twice max_put_buffer (", PutBufferBytes(),
        " bytes), got ", grpc_memory));
  }
  if (ssd_stream_buffer < max_frame_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option ssd_stream_buffer: must hold at least one frame (max_frame_size, ",
        max_frame_size, " bytes), got ", ssd_stream_buffer));
  }
  if (max_lease_seconds == 0) {
    return absl::InvalidArgumentError("option max_lease_seconds: must be at least 1");
  }
  if (max_lease_bytes > ram_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option max_lease_bytes: ", max_lease_bytes, " is more than ram_capacity (",
        ram_capacity, ")"));
  }
  if (max_keys_per_request == 0) {
    return absl::InvalidArgumentError("option max_keys_per_request: must be at least 1");
  }
  if (put_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("option put_wait: must not be negative");
  }
  if (put_place_idle != absl::ZeroDuration() && put_place_idle < absl::Milliseconds(10)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option put_place_idle: must be 0 (off) or at least 10ms, got ",
        absl::FormatDuration(put_place_idle)));
  }
  if (shutdown_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("option shutdown_grace: must not be negative");
  }
  if (remote_timeout > absl::Hours(1)) {
    // poll() takes milliseconds as an int; an hour is already more than any I/O needs.
    return absl::InvalidArgumentError(absl::StrCat(
        "option remote_timeout: at most 1h, got ", absl::FormatDuration(remote_timeout)));
  }
  if (client_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "option client_idle_timeout: must not be negative (0 turns it off)");
  }
  if (shm_socket != "auto" && shm_socket != "off" &&
      !(shm_socket.size() >= 2 && (shm_socket[0] == '/' || shm_socket[0] == '@'))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option shm_socket: '", shm_socket, "' is not auto, off, an absolute path or an @name"));
  }
  if (shm_socket.size() > 107) {
    return absl::InvalidArgumentError("option shm_socket: longer than a Unix socket name (107 bytes)");
  }
  if (!listen_unix.empty() && shm_socket[0] == '/' &&
      std::filesystem::path(listen_unix).lexically_normal() ==
          std::filesystem::path(shm_socket).lexically_normal()) {
    // One socket file cannot be both: the region socket (SOCK_SEQPACKET) and the gRPC
    // listener (SOCK_STREAM) would each find the other's socket there.
    return absl::InvalidArgumentError(absl::StrCat(
        "options listen_unix and shm_socket: both are '", listen_unix,
        "'; they must be different paths"));
  }
  if (shm_max_regions == 0) {
    return absl::InvalidArgumentError("option shm_max_regions: must be at least 1");
  }
  if (shm_copy_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option shm_copy_threads: ", shm_copy_threads, " is more than 64"));
  }
  if (shm_max_region_bytes < 4096) {
    return absl::InvalidArgumentError("option shm_max_region_bytes: must be at least 4KiB");
  }
  if (auto gid = AllowedGid(); !gid.ok()) return gid.status();
  if (prefill_prefetch_window == 0) {
    return absl::InvalidArgumentError("option prefill_prefetch_window: must be at least 1");
  }
  if (writeback_max_dirty > ram_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option writeback_max_dirty: ", writeback_max_dirty, " is more than ram_capacity (",
        ram_capacity, ")"));
  }
  if (writeback_threads == 0 || writeback_threads > 64) {
    return absl::InvalidArgumentError("option writeback_threads: must be 1 to 64");
  }
  if (int device = 0; gpu != "auto" && gpu != "off" &&
                      (!absl::SimpleAtoi(gpu, &device) || device < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option gpu: '", gpu, "' is not auto, off or a device ordinal (0, 1, ...)"));
  }
  if (gpu_crc_threads > 64) {
    return absl::InvalidArgumentError("option gpu_crc_threads: must be 0 (half the cores) to 64");
  }
  if (gpu_copy_streams == 0 || gpu_copy_streams > 16) {
    return absl::InvalidArgumentError("option gpu_copy_streams: must be 1 to 16");
  }
  if (gpu_staging_size != 0 && gpu_staging_size < (2ull << 20)) {
    return absl::InvalidArgumentError(
        "option gpu_staging_size: must be 0 (none) or at least 2MiB (one staging slot)");
  }
  if (prefill_ssd_reads == 0) {
    return absl::InvalidArgumentError("option prefill_ssd_reads: must be at least 1");
  }
  if (log_level != "debug" && log_level != "info" && log_level != "warn" &&
      log_level != "error") {
    return absl::InvalidArgumentError(absl::StrCat(
        "option log_level: must be debug, info, warn or error, got '", log_level, "'"));
  }
  if (!(hint_window_fraction > 0 && hint_window_fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option hint_window_fraction: must be in (0, 1], got ", hint_window_fraction));
  }
  if (max_hint_keys == 0 || max_hint_clients == 0 || event_buffer == 0 || max_layouts == 0) {
    return absl::InvalidArgumentError(
        "option max_hint_keys, max_hint_clients, event_buffer and max_layouts must be at "
        "least 1");
  }
  // Allocated whole at start-up, about 48 bytes an event: a typo must be refused, not
  // abort the daemon (std::bad_alloc) in a restart loop.
  if (event_buffer > kMaxEventBuffer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option event_buffer: at most ", kMaxEventBuffer, " events, got ", event_buffer));
  }
  if (absl::Status s = ValidateRemoteTls(*this); !s.ok()) return s;
  auto store = ToStoreOptions();
  if (!store.ok()) return store.status();
  absl::Status s = store->Validate();
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("option ", s.message()));
  return absl::OkStatus();
}

absl::StatusOr<TieredStoreOptions> DaemonConfig::ToStoreOptions() const {
  TieredStoreOptions o;
  auto mode = ParseWriteMode(write_mode);
  if (!mode.ok()) return absl::InvalidArgumentError(absl::StrCat("option ", mode.status().message()));
  o.write_mode = *mode;
  auto policy = ParseEvictionPolicy(eviction_policy);
  if (!policy.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("option eviction_policy: ", policy.status().message()));
  }
  o.eviction.kind = *policy;
  o.eviction.prefix_cost.cost_slope = eviction_cost_slope;
  o.eviction.prefix_cost.cost_weight = eviction_cost_weight;
  o.ram.arena.capacity_bytes = ram_capacity;
  o.ram.arena.slot_bytes = ram_slot_size;
  o.ram.arena.lock_memory = lock_memory;
  o.ram.arena.prefault = ram_prefault;
  o.ram.arena.huge_pages = ram_huge_pages;
  o.ram.max_pinned_fraction = max_pinned_fraction;
  o.ssd.path = data_dir + "/ssd";
  o.ssd.capacity_bytes = ssd_capacity;
  o.ssd.ttl = ssd_ttl;
  o.ssd.sync_writes = ssd_sync_writes;
  o.ssd.write_buffer_bytes = ssd_write_buffer;
  o.max_chunk_bytes = max_chunk_size;
  o.max_layouts = max_layouts;
  o.put_wait = put_wait;
  o.flush_threads = static_cast<int>(writeback_threads);
  o.max_dirty_bytes = writeback_max_dirty != 0 ? writeback_max_dirty : ram_capacity / 2;
  o.stream_buffer_bytes = ssd_stream_buffer;
  o.hints.max_bytes = std::max<uint64_t>(
      1, static_cast<uint64_t>(hint_window_fraction * static_cast<double>(ram_capacity)));
  o.hints.max_keys = max_hint_keys;
  o.hints.max_clients = max_hint_clients;
  o.hints.ttl = hint_ttl;
  o.gpu_staging.capacity_bytes = gpu_staging_size;  // Used only with a device.
  o.gpu_crc_threads = static_cast<int>(gpu_crc_threads);
  if (!remote_seeds.empty()) {
    for (absl::string_view seed : absl::StrSplit(remote_seeds, ',', absl::SkipWhitespace())) {
      auto e = RedisEndpoint::Parse(absl::StripAsciiWhitespace(seed));
      if (!e.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("option remote_seeds: ", e.status().message()));
      }
      o.remote.cluster.seeds.push_back(*std::move(e));
    }
    o.remote.cluster.auth.user = remote_user;
    if (!remote_password_file.empty()) {
      auto password = ReadFile(remote_password_file);
      if (!password.ok()) {
        // The machine's state, not the option's: a file a secrets agent writes may not
        // be there yet at boot, so not InvalidArgument (exit 2, which systemd does not
        // restart) but a failure a restart may cure.
        return absl::FailedPreconditionError(absl::StrCat(
            "option remote_password_file: cannot read '", remote_password_file,
            "': ", password.status().message()));
      }
      o.remote.cluster.auth.password = std::string(absl::StripTrailingAsciiWhitespace(*password));
    }
    o.remote.cluster.tls = RemoteTlsOf(*this);
    o.remote.cluster.connections_per_node = static_cast<int>(remote_connections_per_node);
    o.remote.cluster.connect_timeout = remote_timeout;
    o.remote.cluster.io_timeout = remote_timeout;
    o.remote.key_prefix = remote_key_prefix;
    o.remote.ttl = remote_ttl;
    if (remote_segment_size > (512ull << 20)) {
      return absl::InvalidArgumentError("option remote_segment_size: at most 512MiB");
    }
    o.remote.segment_bytes = static_cast<uint32_t>(remote_segment_size);
    o.remote.batch_bytes = std::max<uint64_t>(16ull << 20, remote_segment_size);
    o.remote.max_pending_bytes = remote_max_pending != 0
                                     ? remote_max_pending
                                     : std::min<uint64_t>(256ull << 20, ram_capacity / 8);
  }
  return o;
}

std::optional<int> DaemonConfig::GpuDevice() const {
  if (gpu == "off") return std::nullopt;
  int device = 0;
  if (gpu != "auto" && !absl::SimpleAtoi(gpu, &device)) return std::nullopt;  // Validated.
  return device;
}

std::string DaemonConfig::Describe() const {
  std::string out;
  for (const Option& o : Options()) absl::StrAppend(&out, o.name, "=", o.get(*this), " ");
  if (!out.empty()) out.pop_back();
  return out;
}

absl::Status ApplyToml(absl::string_view toml_text, absl::string_view source_name,
                       DaemonConfig& config) {
  if (absl::Status s = CheckKeyDepth(toml_text, source_name); !s.ok()) return s;
  toml::table table;
  try {
    table = toml::parse(std::string_view(toml_text.data(), toml_text.size()),
                        std::string_view(source_name.data(), source_name.size()));
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config %s: line %d: %s", source_name, e.source().begin.line, e.description()));
  }
  for (const auto& [key, node] : table) {
    const Option* option = FindOption(std::string(key.str()));
    if (option == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", source_name, ": unknown option '", std::string(key.str()), "'"));
    }
    std::string value;
    if (auto s = node.value<std::string>()) {
      value = *s;
      if (value.find('\0') != std::string::npos) {
        // A C string would end there: the path or address used would not be this one.
        return absl::InvalidArgumentError(absl::StrCat(
            "config ", source_name, ": option ", option->name, " contains a NUL character"));
      }
    } else if (auto b = node.value_exact<bool>()) {
      value = *b ? "true" : "false";
    } else if (auto i = node.value_exact<int64_t>()) {
      value = absl::StrCat(*i);
    } else if (auto d = node.value_exact<double>()) {
      value = absl::StrCat(*d);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "config ", source_name, ": option ", option->name,
          " must be a string, number or boolean"));
    }
    if (absl::Status s = option->set(config, value); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("config ", source_name, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

std::string DaemonConfig::RegionSocketName(uint64_t instance_id) const {
  if (shm_socket == "off") return "";
  if (shm_socket == "auto") return absl::StrCat("@kvtierd-", absl::Hex(instance_id, absl::kZeroPad16));
  return shm_socket;
}

absl::StatusOr<gid_t> LookUpGroupId(const std::string& name, absl::string_view option,
                                    const GetGroupByName& getgrnam) {
  group grp;
  group* found = nullptr;
  // 16KiB holds an ordinary group; each ERANGE doubles it, up to the bound.
  for (size_t size = size_t{16} << 10;; size *= 2) {
    std::vector<char> buf(size);
    const int err = getgrnam(name.c_str(), &grp, buf.data(), buf.size(), &found);
    if (err == 0 && found != nullptr) return found->gr_gid;
    if (err == 0 || err == ENOENT || err == ESRCH || err == EBADF || err == EPERM) {
      // No entry: getgrnam_r's "not found" is 0 with no result, and some NSS modules say
      // it with one of these errnos.
      return absl::InvalidArgumentError(
          absl::StrCat("option ", option, ": no group named '", name, "'"));
    }
    if (err != ERANGE) {
      return absl::UnavailableError(absl::StrCat("option ", option, ": cannot look up group '",
                                                 name, "': ", std::strerror(err)));
    }
    if (size >= kMaxGroupEntryBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "option ", option, ": the entry of group '", name, "' is larger than ",
          kMaxGroupEntryBytes >> 20, "MiB; give its gid instead"));
    }
  }
}

absl::StatusOr<std::optional<gid_t>> DaemonConfig::AllowedGid() const {
  if (shm_allowed_group.empty()) return std::nullopt;
  uint32_t gid = 0;
  if (absl::SimpleAtoi(shm_allowed_group, &gid)) return static_cast<gid_t>(gid);
  absl::StatusOr<gid_t> found = LookUpGroupId(shm_allowed_group, "shm_allowed_group", getgrnam_r);
  if (!found.ok()) return found.status();
  return *found;
}

absl::StatusOr<ParsedArgs> ParseDaemonArgs(const std::vector<std::string>& args) {
  ParsedArgs out;
  // Pass 1 finds --config so that flags override the file whatever their order.
  std::vector<std::pair<const Option*, std::string>> flags;
  std::string config_path;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (arg == "--help" || arg == "-h") {
      out.help_requested = true;
      continue;
    }
    if (arg == "--version") {
      out.version_requested = true;
      continue;
    }
    if (!absl::ConsumePrefix(&arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name(arg), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "config") {
      if (!has_value) {
        if (i + 1 >= args.size()) return absl::InvalidArgumentError("flag --config needs a file");
        value = args[++i];
      }
      if (value.empty()) return absl::InvalidArgumentError("flag --config needs a file");
      config_path = value;
      continue;
    }
    const Option* option = FindOption(name);
    if (option == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (!has_value) {
      if (option->is_bool && (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    flags.emplace_back(option, value);
  }
  if (!config_path.empty()) {
    auto text = ReadFile(config_path);
    if (!text.ok()) return text.status();
    if (absl::Status s = ApplyToml(*text, config_path, out.config); !s.ok()) return s;
  }
  for (const auto& [option, value] : flags) {
    if (absl::Status s = option->set(out.config, value); !s.ok()) return s;
  }
  return out;
}

std::string DaemonUsage() {
  std::string out =
      "usage: kvtierd [--config FILE] [--OPTION=VALUE ...]\n\n"
      "Serves KV-cache chunks from a host-RAM pool and RocksDB over gRPC.\n"
      "Every option can be set in the TOML file (option = value) or as a flag;\n"
      "flags win. Sizes take KiB/MiB/GiB suffixes, durations s/m/h.\n\noptions:\n";
  const DaemonConfig defaults;
  for (const Option& o : Options()) {
    absl::StrAppend(&out, absl::StrFormat("  --%-22s %s (default: %s)\n",
                                          absl::StrReplaceAll(o.name, {{"_", "-"}}), o.help,
                                          o.get(defaults).empty() ? "\"\"" : o.get(defaults)));
  }
  absl::StrAppend(&out, "  --config FILE            read options from a TOML file\n",
                  "  --help, --version\n");
  return out;
}

uint64_t DaemonConfig::PutBufferBytes() const {
  if (max_put_buffer != 0) return max_put_buffer;
  uint64_t bytes = ram_capacity / 8;
  if (cpus != 0) {
    bytes = std::min(bytes, uint64_t{kPutStreamsPerCpu} * cpus * (stream_window + max_frame_size));
  }
  return std::max<uint64_t>(64ull << 20, bytes);
}

uint32_t UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
  return static_cast<uint32_t>(CPU_COUNT(&set));
}

std::vector<DaemonConfig::MemoryPart> DaemonConfig::MemoryBesidePool() const {
  std::vector<MemoryPart> parts;
  // Defaults of what has no option (ToStoreOptions copies none of these).
  const TieredStoreOptions store;
  // Put streams' windows and frames being assembled (admission refuses past it).
  parts.push_back({"put_buffer", PutBufferBytes()});
  // Put streams waiting in line: nothing from a client that waits for headers, at most
  // its window from one that does not.
  if (max_put_waiters != 0) {
    parts.push_back({"put_waiters", uint64_t{max_put_waiters} * stream_window});
  }
  if (write_mode != "ram-only") {
    // Streamed SSD reads: the budget in use, and as many recycled spares.
    parts.push_back({"ssd_stream_buffer", 2 * ssd_stream_buffer});
    // The payload log's staging buffers: writes in flight plus the one being filled,
    // and two reads per read thread (storage/payload_log.h).
    parts.push_back({"ssd_io_buffers", uint64_t(store.ssd.write_depth + 1 +
                                                2 * store.ssd.read_threads) *
                                           store.ssd.io_bytes});
    parts.push_back({"ssd_memtables", ssd_write_buffer});
    // Reads from SSD that find no room in RAM and are not streamed (a Prefill session's)
    // take a whole-chunk buffer each, at most max_buffered_reads at once.
    parts.push_back({"prefill_ssd_reads", uint64_t(store.max_buffered_reads) * max_chunk_size});
  }
  if (!remote_seeds.empty()) {
    // The shared tier's pipelines: each writer thread builds one batch of segments.
    parts.push_back({"remote_batches", uint64_t(store.remote.write_threads) *
                                           store.remote.batch_bytes});
  }
  parts.push_back({"malloc_pad", uint64_t{kMallocArenas} * kMallocTopPad});
  return parts;
}

uint64_t DaemonConfig::GrpcMemoryBytes(uint64_t machine_memory) const {
  if (grpc_memory != 0) return grpc_memory;
  const uint64_t beside_pool = machine_memory > ram_capacity ? machine_memory - ram_capacity : 0;
  const uint64_t put_buffer = PutBufferBytes();
  const uint64_t floor = put_buffer > UINT64_MAX / 2 ? UINT64_MAX : 2 * put_buffer;
  return std::max(floor, beside_pool / 2);
}

uint64_t CgroupMemoryLimit(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  // cgroup v2: "0::/system.slice/kvtierd.service". The limits that bind this process are
  // memory.max of its cgroup and of every cgroup above it ("max": none).
  std::ifstream self(proc_self_cgroup);
  std::string line, path;
  while (std::getline(self, line)) {
    if (absl::StartsWith(line, "0::")) path = line.substr(3);
  }
  uint64_t limit = 0;
  std::string dir = path;
  while (true) {
    std::ifstream in(cgroup_root + dir + "/memory.max");
    std::string value;
    uint64_t bytes = 0;
    if (in >> value && absl::SimpleAtoi(value, &bytes) && bytes > 0) {
      limit = limit == 0 ? bytes : std::min(limit, bytes);
    }
    const size_t slash = dir.rfind('/');
    if (dir.empty() || slash == std::string::npos) break;
    dir.resize(slash);  // The parent; "" is the root.
  }
  return limit;
}

uint64_t MachineMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  uint64_t bytes = pages > 0 && page > 0
                       ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)
                       : 0;
  const uint64_t cgroup = CgroupMemoryLimit("/sys/fs/cgroup", "/proc/self/cgroup");
  if (cgroup != 0) bytes = bytes == 0 ? cgroup : std::min(bytes, cgroup);
  return bytes;
}

uint32_t DaemonConfig::PrefillSessionsBound() const {
  return max_prefill_sessions != 0 ? max_prefill_sessions : max_rpc_threads / 2;
}

uint32_t DaemonConfig::MaxPutStreams() const {
  const uint64_t per_stream = stream_window + max_frame_size;
  return static_cast<uint32_t>(
      std::clamp<uint64_t>(PutBufferBytes() / per_stream, 1, uint64_t{UINT32_MAX}));
}

uint32_t DaemonConfig::SendTurnsResolved() const {
  if (get_send_turns != 0) return get_send_turns;
  return std::max(kMinSendTurns, kSendTurnsPerCpu * cpus);
}

uint32_t DaemonConfig::ShmCopyThreads() const {
  if (shm_copy_threads != 0) return shm_copy_threads;
  return std::clamp<uint32_t>(std::thread::hardware_concurrency(), 1, 8);
}

}  // namespace kvtier
