// DaemonConfig: every kvtierd option, its default, and how it is read. Options come from
// embedded defaults, then the TOML file given with --config, then command-line flags
// (--name=value or --name value; dashes and underscores are interchangeable). Every
// option can be given both ways. Validate() runs once at start-up and names the bad
// option.
//
// Thread-safety: a value type, built once in main().
#ifndef KVTIER_SERVER_DAEMON_CONFIG_H_
#define KVTIER_SERVER_DAEMON_CONFIG_H_

#include <grp.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "storage/log.h"
#include "storage/tiered_store.h"

namespace kvtier {

// CPUs this process may run on (its affinity mask, as taskset or a cpuset sets it);
// 0 if unknown.
uint32_t UsableCpus();

// Put streams receiving at once, per CPU, that the max_put_buffer default allows. On the
// overload probe (2 CPUs, bench/results/overload) 16 stored as fast as 42 and answered
// health checks and Lookups in half the time: more streams than the CPUs can drain only
// queue ahead of everything else.
inline constexpr uint32_t kPutStreamsPerCpu = 8;
// The get_send_turns default: per CPU, and at least.
inline constexpr uint32_t kSendTurnsPerCpu = 2;
inline constexpr uint32_t kMinSendTurns = 4;

struct DaemonConfig {
  std::string listen = "127.0.0.1:50051";  // gRPC address, host:port; port 0 picks one.
  // Transport security. TLS with tls_cert_file and tls_key_file (PEM); mutual TLS when
  // tls_client_ca_file is set too (clients must present a certificate it signed). The
  // files are re-read every tls_reload_interval, so certificates rotate without a restart;
  // files that are not valid are logged and the previous ones kept (TlsReloader).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  absl::Duration tls_reload_interval = absl::Seconds(60);
  // Plaintext gRPC on an address other than loopback is refused unless this is set.
  bool allow_insecure_remote = false;
  // gRPC server reflection (grpcurl). Its streams are synchronous and unauthenticated:
  // each one open holds one of gRPC's threads, which Prefill sessions also need.
  bool grpc_reflection = true;
  // Also serve gRPC on this Unix-domain socket (absolute path; "" = off), where the
  // peer's uid is its identity (tenants_file "uid" lines).
  std::string listen_unix;
  // Tenants, their credentials, roles and request rates (server/tenant_table.h);
  // "" = one implicit tenant for every caller, as before tenants existed.
  std::string tenants_file;
  std::string data_dir = "./var/kvtier";   // RocksDB lives in <data_dir>/ssd.
  uint64_t ram_capacity = 1ull << 30;      // Host-RAM pool, bytes.
  uint64_t ram_slot_size = 64ull << 10;    // Pool slot, bytes (see SlotArenaOptions).
  bool lock_memory = false;                // mlock the pool.
  bool ram_prefault = true;                // Fault the pool in at start, in the background.
  bool ram_huge_pages = true;              // Transparent huge pages for the pool.
  double max_pinned_fraction = 0.5;        // Share of the pool pins may hold.
  uint64_t ssd_capacity = 16ull << 30;     // SSD tier payload bytes.
  absl::Duration ssd_ttl = absl::ZeroDuration();  // Zero: no expiry.
  bool ssd_sync_writes = false;            // fdatasync payload and index row per put.
  uint64_t ssd_write_buffer = 32ull << 20; // RocksDB memtable budget (index rows), bytes.
  uint64_t ssd_stream_buffer = 64ull << 20; // Frame buffers of streamed SSD reads, bytes.
  std::string write_mode = "write-back";   // write-back | write-through | ram-only.
  uint64_t max_frame_size = 4ull << 20;    // Largest data field of one frame, bytes.
  uint64_t stream_window = 2ull << 20;     // HTTP/2 receive window per stream, bytes.
  // Largest HTTP/2 DATA frame clients may send; gRPC's default, 16 KiB. 1 MiB made one
  // client's 2 MiB puts 15% faster (32 MiB: within noise) but raised health p99 under a
  // put flood from 6.9 to 7.4-8.4 ms (bench/RESULTS.md, optimisation log).
  uint64_t http2_max_frame = 16ull << 10;
  // What gRPC may buffer for open Put streams, outside the pool: each counts
  // stream_window + max_frame_size (its window, and a frame being assembled); past it a
  // new Put waits in line, or is answered RESOURCE_EXHAUSTED. 0: ram_capacity / 8, and
  // at most kPutStreamsPerCpu streams per CPU in `cpus`; at least 64MiB.
  uint64_t max_put_buffer = 0;
  // Not an option: the CPUs the daemon may run on, for the max_put_buffer default
  // (0: unknown, ignored).
  uint32_t cpus = UsableCpus();
  uint64_t PutBufferBytes() const;     // max_put_buffer, resolved.
  uint32_t MaxPutStreams() const;      // Put streams that fit in it (at least 1).
  // Put streams that may wait, in arrival order, for one of those places (each up to
  // put_wait) before a new one is refused at once; 0: none wait. A waiting stream is
  // sent no headers, so a client that waits for them (kvtier's) sends it nothing; one
  // that does not may fill its stream_window, counted in the memory bound.
  uint32_t max_put_waiters = 256;
  // Get calls that send RAM chunk bytes at once; the others wait their turn, first come
  // first served (SendTurns: a turn per chunk; a Get whose frame write waits 20 ms while
  // others wait sends the rest of its chunk without one). 0: kSendTurnsPerCpu per CPU in `cpus`,
  // at least kMinSendTurns.
  uint32_t get_send_turns = 0;
  uint32_t SendTurnsResolved() const;  // get_send_turns, resolved.
  // All the memory gRPC may hold for received bytes (gRPC's resource quota): read
  // buffers and messages being assembled, on every connection. gRPC assembles a whole
  // message before it checks its size, so without this bound one oversized message costs
  // its full size in RSS. Near the bound gRPC shrinks HTTP/2 windows, then cancels
  // streams and closes connections (clients see RESOURCE_EXHAUSTED or UNAVAILABLE, both
  // retryable): the daemon degrades instead of growing until the kernel kills it.
  // 0: half the memory beside the pool (what the OOM killer would otherwise bound), at
  // least twice max_put_buffer; set, at least twice max_put_buffer.
  uint64_t grpc_memory = 0;
  // grpc_memory, resolved against `machine_memory` (MachineMemoryBytes()).
  uint64_t GrpcMemoryBytes(uint64_t machine_memory) const;
  // The memory this configuration bounds beside the pool, part by part (bytes): the
  // daemon's fixed allowance outside ram_capacity, which grows with neither the chunks
  // stored nor the clients (prefill_ssd_reads grows with the max_chunk_size option).
  // kvtierd exports it as kvtier_memory_bound_bytes{part} and logs it at start-up. Not
  // in it: the process's code and libraries, RocksDB's block cache, and gRPC's state
  // and buffers beyond put_buffer (bounded as a whole by grpc_memory, which includes
  // put_buffer). malloc_pad is the free memory kept at the arenas' tops, not their
  // fragmentation.
  struct MemoryPart {
    std::string part;
    uint64_t bytes = 0;
  };
  std::vector<MemoryPart> MemoryBesidePool() const;
  uint32_t max_keys_per_request = 4096;    // Keys in one Lookup/Get/Pin/Delete.
  uint32_t max_leases = 65536;             // Lookup leases live at once.
  uint32_t max_lease_seconds = 300;        // Longest Lookup lease.
  uint64_t max_lease_bytes = 0;            // RAM chunk bytes leases may hold; 0: half the pool.
  uint64_t max_chunk_size = 512ull << 20;  // Largest chunk a layout may have, bytes.
  absl::Duration put_wait = absl::Seconds(5);  // A put waits this long for room in RAM.
  // Admission: streaming calls (Put, Get, Prefill, Events) open at once, daemon-wide;
  // HTTP/2 streams per client connection; gRPC threads for the synchronous handlers.
  // Past each, calls are answered RESOURCE_EXHAUSTED instead of queueing.
  uint32_t max_streams = 4096;
  uint32_t max_streams_per_connection = 1024;
  uint32_t max_rpc_threads = 512;
  // Prefill sessions open at once. Each holds one of max_rpc_threads for its whole life,
  // so this bound keeps the rest for the unary handlers: past it a session is refused
  // RESOURCE_EXHAUSTED with a retry hint. 0: half of max_rpc_threads.
  uint32_t max_prefill_sessions = 0;
  uint32_t PrefillSessionsBound() const;
  // A Put whose client sends no frame, or a Get or Prefill whose client reads nothing
  // (a write held back by flow control), for this long is cancelled, and what it held
  // (pool slots, chunks, a thread) is given back; 0: never.
  absl::Duration client_idle_timeout = absl::Seconds(60);
  // A Put stream holding a place within max_put_buffer whose client completes no frame
  // for this long while other Puts wait in line for a place is cancelled, and its place
  // goes to the line; 0: only client_idle_timeout applies.
  absl::Duration put_place_idle = absl::Milliseconds(500);
  absl::Duration shutdown_grace = absl::Seconds(30);  // In-flight RPCs get this long.
  std::string log_level = "info";          // debug | info | warn | error.
  uint64_t prefill_bandwidth_limit = 0;    // Daemon-wide Prefill streaming cap, bytes/s; 0: none.
  uint32_t prefill_prefetch_window = 2;    // Chunks a session reads ahead of the one it sends.
  uint32_t prefill_ssd_reads = 2;          // SSD reads in flight across all sessions.
  uint32_t writeback_threads = 4;          // Write-back: chunks written to SSD at once.
  // Write-back: payload bytes in RAM not yet on SSD before puts wait for the flushers;
  // 0: half of ram_capacity.
  uint64_t writeback_max_dirty = 0;
  // RAM and SSD eviction: lru | prefix-lru | prefix-cost (storage/eviction_policies.h).
  std::string eviction_policy = "lru";
  double eviction_cost_slope = 0.1154;     // prefix-cost: b / a of the recompute cost a + b*i.
  double eviction_cost_weight = 16;        // prefix-cost: ticks of recency per unit of cost.
  // Hint: share of the RAM pool the look-ahead window may hold; most keys per client's
  // hint; most hinting clients.
  double hint_window_fraction = 0.5;
  uint32_t max_hint_keys = 65536;
  uint32_t max_hint_clients = 64;
  // Most layouts registered at once, all tenants together (persisted ones included); a
  // named tenant may register an equal share unless its max_layouts says otherwise.
  uint32_t max_layouts = 4096;
  absl::Duration hint_ttl = absl::Seconds(60);  // A hint not renewed is dropped after this.
  uint32_t event_buffer = 65536;           // Events: chunk events kept for subscribers.
  static constexpr uint32_t kMaxEventBuffer = 1u << 24;  // About 800 MB of events.
  // Same-host data plane: the region socket clients register shared memory on.
  // "auto": an abstract socket named after the daemon's instance; "off": none; else an
  // absolute path or an "@abstract" name.
  std::string shm_socket = "auto";
  std::string shm_allowed_group;           // Group (name or gid) admitted besides our user.
  uint32_t shm_max_regions = 1024;         // Regions registered at once, all clients.
  uint64_t shm_max_region_bytes = 64ull << 30;  // Largest region.
  // Threads one shared-memory copy (a chunk into or out of a region) may use, the RPC's
  // own included: 1 copies on the RPC's thread; 0 means one per core, at most 8.
  uint32_t shm_copy_threads = 0;
  // shm_copy_threads with 0 resolved for this host.
  uint32_t ShmCopyThreads() const;
  // GPU: "auto" uses device 0 when the build has CUDA and the host a GPU, and says once
  // at start-up when it does not; "off"; or a device ordinal (a missing one is a loud
  // degraded mode, not a start-up failure).
  std::string gpu = "auto";
  uint64_t gpu_staging_size = 1ull << 30;  // GPU staging buffers (L0), bytes; 0: none.
  uint32_t gpu_copy_streams = 2;           // CUDA streams copies are spread over.
  // Threads that check a host-to-device delivery's CRC32C beside the delivering one;
  // 0: half the cores (at most 16).
  uint32_t gpu_crc_threads = 0;
  // The shared tier (L3) on Redis Cluster: seed nodes as "host:port,host:port"; empty
  // for none. The password is read from a file (not kept in the config); a user name
  // means a Redis ACL user. remote_max_pending 0: ram_capacity / 8, at most 256MiB.
  std::string remote_seeds;
  std::string remote_user;
  std::string remote_password_file;
  std::string remote_key_prefix = "kvt";
  absl::Duration remote_ttl = absl::Hours(24);
  uint64_t remote_segment_size = 1ull << 20;
  uint64_t remote_max_pending = 0;
  uint32_t remote_connections_per_node = 4;
  absl::Duration remote_timeout = absl::Seconds(2);
  // TLS to the Redis nodes (their tls-port). The server certificate is verified against
  // remote_tls_ca_file (empty: the system trust store) and must name
  // remote_tls_server_name, or when that is empty the host each node is reached at (a
  // seed, or the address CLUSTER SLOTS gives). remote_tls_cert_file and
  // remote_tls_key_file (PEM) are the client certificate for nodes with
  // tls-auth-clients. The files are read at start-up; one that cannot be used stops it.
  bool remote_tls = false;
  std::string remote_tls_ca_file;
  std::string remote_tls_cert_file;
  std::string remote_tls_key_file;
  std::string remote_tls_server_name;
  std::string metrics_listen = "127.0.0.1:9464";  // HTTP /metrics and /healthz; "" = off.
  // If set, written once serving: the bound gRPC port on line 1, the metrics port (0 if
  // off) on line 2. For supervisors and tests that listen on port 0.
  std::string port_file;

  absl::Status Validate() const;
  // The storage options these settings imply.
  absl::StatusOr<TieredStoreOptions> ToStoreOptions() const;
  // The region socket's name for a daemon with this instance id; "" when off.
  std::string RegionSocketName(uint64_t instance_id) const;
  // shm_allowed_group as a gid (nullopt when unset), a number or a group's name
  // (LookUpGroupId). Returns InvalidArgument (no such group), Unavailable (the lookup
  // failed). Each call asks NSS again: resolve it once and keep the answer.
  absl::StatusOr<std::optional<gid_t>> AllowedGid() const;
  // Whether the listen host is a loopback address.
  bool ListenIsLoopback() const;
  bool tls() const { return !tls_cert_file.empty(); }
  // One "name = value" line per option, for the start-up log.
  std::string Describe() const;
  // The GPU device to open: nullopt for "off", else the ordinal ("auto": 0).
  std::optional<int> GpuDevice() const;
};

// getgrnam_r's signature: LookUpGroupId takes it so that tests can answer as NSS does.
using GetGroupByName = std::function<int(const char*, group*, char*, size_t, group**)>;

// The gid of the group `name`, asking `getgrnam` (getgrnam_r in the daemon) with a
// buffer that grows on ERANGE, up to kMaxGroupEntryBytes: a group of thousands of members
// (LDAP, sssd) does not fit a fixed one, and is not "missing" for that. `option` is named
// in errors. Returns: InvalidArgument (no such group, or an entry larger than the
// bound), Unavailable (the lookup failed otherwise, e.g. the directory did not answer).
inline constexpr size_t kMaxGroupEntryBytes = size_t{16} << 20;
absl::StatusOr<gid_t> LookUpGroupId(const std::string& name, absl::string_view option,
                                    const GetGroupByName& getgrnam);

// Parses argv (without argv[0]). Returns InvalidArgument naming the bad flag, option or
// value. `--help` and `--version` are reported through `help_requested` /
// `version_requested` with an Ok config.
struct ParsedArgs {
  DaemonConfig config;
  bool help_requested = false;
  bool version_requested = false;
};
absl::StatusOr<ParsedArgs> ParseDaemonArgs(const std::vector<std::string>& args);
// Applies a TOML document's keys over `config`. Returns InvalidArgument naming the key.
absl::Status ApplyToml(absl::string_view toml_text, absl::string_view source_name,
                       DaemonConfig& config);
std::string DaemonUsage();

// "4MiB", "1GiB", "512k", "1048576" -> bytes. Returns InvalidArgument.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);
std::string FormatBytes(uint64_t bytes);

// kvtierd's malloc settings (kvtierd_main.cc): at most kMallocArenas arenas, each
// keeping kMallocTopPad bytes free at its top (part "malloc_pad" of MemoryBesidePool).
inline constexpr int kMallocArenas = 4;
inline constexpr int kMallocTopPad = 8 << 20;

// The memory this process may use: physical memory, or the lowest memory.max of its
// cgroup and the cgroups above it (a container's or a systemd unit's MemoryMax=) when
// lower.
uint64_t MachineMemoryBytes();
// That lowest memory.max (0: none), for the cgroup v2 hierarchy at `cgroup_root` and
// this process's line in `proc_self_cgroup` ("0::/path").
uint64_t CgroupMemoryLimit(const std::string& cgroup_root, const std::string& proc_self_cgroup);

}  // namespace kvtier

#endif  // KVTIER_SERVER_DAEMON_CONFIG_H_
