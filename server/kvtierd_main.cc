// kvtierd: the kvtier daemon. Parses options, opens the tiered store (recovering the
// SSD tier's index), serves kvtier.v1.KvCache, grpc.health.v1.Health and server
// reflection, and shuts down gracefully on SIGTERM/SIGINT/SIGHUP: health goes NOT_SERVING,
// in-flight RPCs get shutdown_grace to finish, write-back chunks are flushed to SSD and
// RocksDB is closed.
#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <malloc.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <fcntl.h>
#include <sys/random.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/authenticator.h"
#include "server/daemon_config.h"
#include "server/http_endpoint.h"
#include "server/kv_cache_service.h"
#include "server/parse_error_interceptor.h"
#include "server/prefill_metrics.h"
#include "server/prefill_runner.h"
#include "server/region_socket.h"
#include "server/rpc_metrics.h"
#include "server/store_collector.h"
#include "server/stall_reaper.h"
#include "server/stream_limiter.h"
#include "server/transport_credentials.h"
#include "server/unix_listener.h"
#include "storage/io_pool.h"
#include "storage/log.h"
#include "storage/tiered_store.h"
#ifdef KVTIER_HAVE_CUDA
#include "storage/cuda/cuda_device_backend.h"
#endif

#ifndef KVTIER_VERSION
#define KVTIER_VERSION "dev"
#endif

namespace kvtier {
namespace {

// Takes server reflection off a server: linking gRPC's reflection library registers its
// plugin with every ServerBuilder (a static initializer), so leaving the Init call out
// is not enough.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(p.get()) != nullptr;
    });
  }
};

// gRPC's default bound on a request's headers, set explicitly: the proto's status
// contract names it.
constexpr int kMaxRequestMetadataBytes = 8 << 10;

LogLevel ParseLogLevel(const std::string& s) {
  if (s == "debug") return LogLevel::kDebug;
  if (s == "warn") return LogLevel::kWarning;
  if (s == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  out << grpc_port << "\n" << metrics_port << "\n";
  // The bytes reach the file only as the stream is flushed, at close: a full disk fails
  // there, and an empty port file must not be renamed in.
  out.close();
  std::error_code ec;
  if (out.fail()) {
    const int err = errno;
    std::filesystem::remove(tmp, ec);  // What is left of it, if anything.
    return absl::UnavailableError(
        absl::StrCat("port_file: cannot write ", tmp, ": ", std::strerror(err)));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("port_file: ", ec.message()));
  return absl::OkStatus();
}

// Tells systemd (Type=notify) about state changes; a no-op when not run by systemd.
void Notify(const std::string& state) {
  if (sd_notify(0, state.c_str()) < 0) LogWarning("sd_notify failed: ", state);
}

// The GPU the staging tier runs on, or null; says once, at start-up, which it is.
std::unique_ptr<DeviceBackend> OpenGpu(const DaemonConfig& config) {
  const std::optional<int> device = config.GpuDevice();
  if (!device) {
    LogInfo("GPU staging tier: off (gpu=off); RAM and SSD serve all reads");
    return nullptr;
  }
#ifdef KVTIER_HAVE_CUDA
  CudaBackendOptions options;
  options.device = *device;
  options.copy_streams = static_cast<int>(config.gpu_copy_streams);
  auto backend = OpenCudaBackend(options);
  if (!backend.ok()) {
    // Asked for by number: the operator expects a GPU, so this is a degraded mode.
    const std::string why = std::string(backend.status().message());
    if (config.gpu == "auto") {
      LogInfo("GPU staging tier: off (no usable GPU: ", why, "); RAM and SSD serve all reads");
    } else {
      LogWarning("GPU staging tier: off: gpu=", config.gpu, " was asked for but ", why,
                 "; RAM and SSD serve all reads (kvtier_gpu_available 0)");
    }
    return nullptr;
  }
  LogInfo("GPU staging tier: on ", (*backend)->Describe(), ", staging buffers ",
          FormatBytes(config.gpu_staging_size), ", ", config.gpu_copy_streams,
          " copy streams");
  return *std::move(backend);
#else
  if (config.gpu == "auto") {
    LogInfo("GPU staging tier: off (this build has no CUDA); RAM and SSD serve all reads");
  } else {
    LogWarning("GPU staging tier: off: gpu=", config.gpu, " was asked for but this build has "
               "no CUDA; RAM and SSD serve all reads (kvtier_gpu_available 0)");
  }
  return nullptr;
#endif
}

// Holds <data_dir>/kvtierd.lock (flock) for the daemon's life, taken before anything
// that lives in data_dir or is shared with another daemon (sockets, the gRPC port, the
// TLS copy, the store): a second kvtierd on the same data_dir stops at once, touching
// nothing of the first. The lock goes with the process, however it ends.
absl::StatusOr<int> LockDataDir(const std::string& data_dir) {
  std::error_code ec;
  std::filesystem::create_directories(data_dir, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("data_dir: cannot create ", data_dir, ": ",
                                               ec.message()));
  }
  const std::string path = data_dir + "/kvtierd.lock";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("data_dir: cannot open ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[32] = {};
    const ssize_t n = pread(fd, holder, sizeof(holder) - 1, 0);
    close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "data_dir: ", data_dir, " is in use by another kvtierd",
          n > 0 ? absl::StrCat(" (pid ", absl::StripAsciiWhitespace(holder), ")") : "",
          "; give each daemon its own data_dir"));
    }
    return absl::UnavailableError(absl::StrCat("data_dir: cannot lock ", path, ": ",
                                               std::strerror(err)));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    LogWarning("data_dir: cannot write the pid into ", path, ": ", std::strerror(errno));
  }
  return fd;
}

int Run(const DaemonConfig& config, const sigset_t& signals) {
  SetMinLogLevel(ParseLogLevel(config.log_level));
  LogInfo("kvtierd ", KVTIER_VERSION, " starting: ", config.Describe());

  auto store_options = config.ToStoreOptions();
  if (!store_options.ok()) {
    LogError(store_options.status().message());
    return 2;
  }
  // shm_allowed_group, looked up once for the region socket and listen_unix alike.
  // Validate() looked it up too, but a directory (LDAP, sssd) may answer differently, or
  // not at all, the second time.
  const absl::StatusOr<std::optional<gid_t>> allowed_gid = config.AllowedGid();
  if (!allowed_gid.ok()) {
    LogError(allowed_gid.status().message());
    return 2;
  }
  absl::StatusOr<int> data_dir_lock = LockDataDir(config.data_dir);
  if (!data_dir_lock.ok()) {
    LogError(data_dir_lock.status().message());
    return 1;
  }
  // Before the store, which page-locks its pool through it; destroyed after it.
  std::unique_ptr<DeviceBackend> gpu = OpenGpu(config);
  store_options->device = gpu.get();
  if (store_options->write_mode != WriteMode::kRamOnly) {
    std::error_code ec;
    std::filesystem::create_directories(store_options->ssd.path, ec);
    if (ec) {
      LogError("data_dir: cannot create ", store_options->ssd.path, ": ", ec.message());
      return 1;
    }
  } else {
    LogWarning("write_mode=ram-only: no SSD tier; chunks are lost on restart");
  }

  // Order matters for shutdown: members declared later are destroyed first. The HTTP
  // endpoint reads the store through its collector, so it is stopped before the store
  // goes; the gRPC server is drained before either.
  auto registry = std::make_shared<prometheus::Registry>();
  RpcMetrics rpc_metrics(*registry);
  {
    // The memory envelope: the pool, and what the configuration bounds beside it.
    auto& bound = prometheus::BuildGauge()
                      .Name("kvtier_memory_bound_bytes")
                      .Help("Memory the configuration bounds: the RAM pool, and each buffer "
                            "beside it (their sum is the daemon's fixed allowance; not "
                            "counted: code, libraries, gRPC connections up to grpc_memory)")
                      .Register(*registry);
    bound.Add({{"part", "pool"}}).Set(static_cast<double>(config.ram_capacity));
    uint64_t beside = 0;
    std::string parts;
    for (const DaemonConfig::MemoryPart& p : config.MemoryBesidePool()) {
      bound.Add({{"part", p.part}}).Set(static_cast<double>(p.bytes));
      beside += p.bytes;
      absl::StrAppend(&parts, parts.empty() ? "" : ", ", p.part, " ", FormatBytes(p.bytes));
    }
    LogInfo("memory: pool ", FormatBytes(config.ram_capacity), "; beside it at most ",
            FormatBytes(beside), " (", parts, ") plus code and gRPC connections");
  }
  ServiceLimits limits;
  limits.max_frame_bytes = config.max_frame_size;
  limits.max_keys_per_request = config.max_keys_per_request;
  limits.max_layouts = config.max_layouts;
  // A frame is the data plus a few dozen bytes of framing; leave 1 MiB of slack.
  limits.max_message_bytes = config.max_frame_size + (1 << 20);
  PrefillMetrics prefill_metrics(*registry);
  PrefillRunnerOptions prefill_options;
  prefill_options.max_frame_bytes = config.max_frame_size;
  prefill_options.max_keys = config.max_keys_per_request;
  prefill_options.bandwidth_limit = static_cast<double>(config.prefill_bandwidth_limit);
  prefill_options.prefetch_window = config.prefill_prefetch_window;
  prefill_options.ssd_read_concurrency = static_cast<int>(config.prefill_ssd_reads);
  PrefillRunner prefill(prefill_options, &prefill_metrics);
  PrefillEstimatesCollector estimates_collector(&prefill.estimators());
  LeaseTableOptions lease_options;
  lease_options.max_leases = config.max_leases;
  lease_options.max_ttl = absl::Seconds(config.max_lease_seconds);
  lease_options.max_held_bytes =
      config.max_lease_bytes != 0 ? config.max_lease_bytes : config.ram_capacity / 2;
  LeaseTable leases(lease_options);

  // The same-host data plane: its region socket is up before gRPC, so DataPlane() never
  // names a socket that does not answer yet.
  RegionTableOptions region_options;
  region_options.max_regions = config.shm_max_regions;
  region_options.max_region_bytes = config.shm_max_region_bytes;
  RegionTable regions(region_options);
  uint64_t instance_id = 0;
  while (instance_id == 0) {
    if (getrandom(&instance_id, sizeof(instance_id), 0) != sizeof(instance_id)) instance_id = 0;
  }
  // Chunk events for Events subscribers; outlives the server and the store.
  EventLog events(config.event_buffer, instance_id);
  DataPlaneInfo data_plane;
  std::unique_ptr<RegionSocket> region_socket;
  // Shared-memory copies of a chunk run on this many threads (the RPC's own and helpers).
  std::unique_ptr<ParallelCopy> copier;
  if (const std::string name = config.RegionSocketName(instance_id); !name.empty()) {
    RegionSocketOptions socket_options;
    socket_options.name = name;
    socket_options.instance_id = instance_id;
    socket_options.allowed_gid = *allowed_gid;
    socket_options.device = gpu.get();  // Null without a GPU: add_device is refused.
    auto socket = RegionSocket::Start(std::move(socket_options), &regions);
    if (!socket.ok()) {
      LogError(socket.status().message());
      return 1;
    }
    region_socket = *std::move(socket);
    if (config.ShmCopyThreads() > 1) {
      copier = std::make_unique<ParallelCopy>(
          ParallelCopyOptions{.helpers = static_cast<int>(config.ShmCopyThreads()) - 1});
    }
    data_plane = DataPlaneInfo{&regions, copier.get(), name, instance_id};
    LogInfo("same-host shared memory: region socket ", name);
  }
  // Who may call: the tenants file (if any) and, on the Unix socket, the peer's uid.
  AuthenticatorOptions auth_options;
  auth_options.tenants_file = config.tenants_file;
  auto auth = Authenticator::Create(std::move(auth_options), registry.get());
  if (!auth.ok()) {
    LogError(auth.status().message());
    return 1;
  }
  // Keeps gRPC's checked copy of the TLS files current; outlives the server.
  std::unique_ptr<TlsReloader> tls_reloader;
  auto credentials = MakeServerCredentials(config, registry.get(), &tls_reloader);
  if (!credentials.ok()) {
    LogError(credentials.status().message());
    return 1;
  }
  std::unique_ptr<UnixListener> unix_listener;
  if (!config.listen_unix.empty()) {
    // With tenants every request proves who it is; without, the socket admits whom the
    // region socket admits: the daemon's user, root and shm_allowed_group.
    const bool tenants = (*auth)->enabled();
    const uid_t self = getuid();
    const std::optional<gid_t> gid = *allowed_gid;
    auto listener = UnixListener::Bind(
        config.listen_unix, 0666, [tenants, self, gid](const PeerCredentials& peer) -> absl::Status {
          if (tenants || peer.uid == self || peer.uid == 0 || (gid && peer.InGroup(*gid))) {
            return absl::OkStatus();
          }
          return absl::PermissionDeniedError(
              "not the daemon's user, root or shm_allowed_group, and no tenants_file");
        });
    if (!listener.ok()) {
      LogError(listener.status().message());
      return 1;
    }
    unix_listener = *std::move(listener);
  }
  StreamLimiter streams(config.max_streams, registry.get());
  StreamLimiter::LineOptions put_line;
  put_line.max_waiting = config.max_put_waiters;
  put_line.max_wait = config.put_wait;
  StreamLimiter put_streams(config.MaxPutStreams(), registry.get(), "put_streams",
                            {"max_put_buffer", "max_put_buffer", "Put streams",
                             "max_put_waiters", "put_wait"},
                            std::move(put_line));
  StreamLimiter subscribers(KvCacheService::kMaxEventSubscribers, registry.get(),
                            "event_subscribers", KvCacheService::EventSubscriberNaming());
  StreamLimiter prefill_sessions(config.PrefillSessionsBound(), registry.get(),
                                 "prefill_sessions",
                                 {"max_prefill_sessions", "", "Prefill sessions"});
  StallReaperOptions stall_options;
  stall_options.idle = config.client_idle_timeout;
  if (config.max_put_waiters != 0 && config.put_place_idle > absl::ZeroDuration()) {
    stall_options.contended_idle = config.put_place_idle;
    stall_options.waiting_for_place = [&put_streams] { return put_streams.waiting(); };
    stall_options.full_frame_bytes = config.max_frame_size;
    // Swept often enough that a stalled holder's place is back within a quarter more.
    stall_options.period =
        std::clamp(config.put_place_idle / 4, absl::Milliseconds(1), stall_options.period);
  }
  stall_options.registry = registry.get();
  StallReaper stalls(stall_options);
  SendTurnsOptions turn_options;
  turn_options.turns = config.SendTurnsResolved();
  turn_options.registry = registry.get();
  SendTurns send_turns(turn_options);
  TenantQuotas quotas(registry.get());
  // Held to the quota in force: open Put streams follow the tenants file's reloads.
  quotas.SetQuotaSource([a = auth->get()](const std::string& tenant) {
    return a->CurrentQuota(tenant);
  });
  // The unary calls' threads: max_rpc_threads less the Prefill sessions' share. gRPC's
  // callback API hands a call over only once its request arrived whole, so a stream
  // opened and reset before its message (HTTP/2 rapid reset) takes no thread; a call
  // reset while it waits here is not run. Declared before the service and the server:
  // it outlives every call.
  IoPool unary_pool(static_cast<int>(config.max_rpc_threads - config.PrefillSessionsBound()));
  ServiceGuards guards{auth->get(), unix_listener.get(), &streams, &put_streams, &stalls,
                       &send_turns, &quotas, &subscribers, &prefill_sessions};
  guards.unary = &unary_pool;
  KvCacheService service(limits, KVTIER_VERSION, &rpc_metrics, &prefill, &leases, data_plane,
                         &events, guards);
  std::atomic<bool> serving{false};

  // gRPC first, so that health checks get NOT_SERVING (and KvCache calls UNAVAILABLE)
  // while the SSD index is being recovered, instead of connection refused.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!config.grpc_reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  int port = 0;
  builder.AddListeningPort(config.listen, *credentials, &port);
  const int max_message = static_cast<int>(limits.max_message_bytes);
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  // Bound what gRPC buffers per stream: with BDP probing on, HTTP/2 windows grow to
  // tens of MiB per stream under bulk puts, and that memory sits outside the RAM pool.
  // Puts waiting for room (put_wait) each hold a full window, so the bound is
  // concurrent puts x stream_window.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  // gRPC sets SO_REUSEPORT by default: a second daemon on the same port would start and
  // take part of the first one's connections. The port must be free.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Admission: HTTP/2 streams per connection, and gRPC's threads for the synchronous
  // handler (Prefill; its sessions are bounded by max_prefill_sessions before this):
  // the sessions' share of max_rpc_threads (the unary pool has the rest) and a few for
  // gRPC's pollers and for answering the sessions past the bound.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(config.max_streams_per_connection));
  grpc::ResourceQuota quota("kvtierd");
  constexpr int kSyncServerSpareThreads = 4;
  quota.SetMaxThreads(static_cast<int>(config.PrefillSessionsBound()) + kSyncServerSpareThreads);
  // gRPC buffers a whole message before its size check (measured: a 512 MiB Put frame
  // raised the daemon's peak RSS by 512 MiB, then got "larger than max"); the quota
  // bounds what all connections together hold.
  const uint64_t grpc_memory = config.GrpcMemoryBytes(MachineMemoryBytes());
  quota.Resize(grpc_memory);
  LogInfo("gRPC may hold ", grpc_memory >> 20, " MiB of received bytes (grpc_memory",
          config.grpc_memory != 0 ? ""
          : grpc_memory == 2 * config.PutBufferBytes()
              ? ": twice max_put_buffer"
              : ": half the memory beside the pool",
          ")");
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                             static_cast<int>(config.stream_window));
  // What clients may put in one HTTP/2 DATA frame: gRPC's 16 KiB default cuts a 4 MiB
  // Put frame into 256 HTTP/2 frames, each parsed on its own.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE,
                             static_cast<int>(config.http2_max_frame));
  // No compressed requests: gRPC 1.51 inflates a whole message before its size check,
  // outside the quota above, so a 400 KB gzip request became 384 MiB of RSS. KV bytes do
  // not compress anyway. A compressed request is UNIMPLEMENTED, before it is inflated.
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  // Request headers: gRPC's 8 KiB, said here (and in the proto's status contract) since
  // past it a call gets RESOURCE_EXHAUSTED it must not retry.
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxRequestMetadataBytes);
  builder.RegisterService(&service);
  // Request bytes that do not parse: INVALID_ARGUMENT naming the message, not INTERNAL.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<ParseErrorInterceptorFactory>());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LogError("listen: cannot bind ", config.listen, " (in use, or not a valid host:port)");
    return 1;
  }
  auto* health = server->GetHealthCheckService();
  // Health answers for the server ("") and for the service by name; the bool overloads
  // below then flip both.
  health->SetServingStatus(v1::KvCache::service_full_name(), false);
  health->SetServingStatus(false);
  if (unix_listener) unix_listener->Serve(server.get());
  // On every way out, the listener stops handing connections to the server first.
  absl::Cleanup stop_unix = [&unix_listener] {
    if (unix_listener) unix_listener->Stop();
  };

  std::unique_ptr<HttpEndpoint> http;
  if (!config.metrics_listen.empty()) {
    auto endpoint =
        HttpEndpoint::Start(config.metrics_listen, [&serving] { return serving.load(); });
    if (!endpoint.ok()) {
      LogError(endpoint.status().message());
      events.Close();
      server->Shutdown();
      return 1;
    }
    http = *std::move(endpoint);
    http->AddCollectable(registry.get());
    http->AddCollectable(&estimates_collector);
  }

  Notify("STATUS=recovering the SSD tier");
  store_options->events = &events;
  store_options->admit_promotion = [&quotas](TieredStore& s, uint64_t ns, uint64_t bytes) {
    return quotas.AdmitPromotion(&s, ns, bytes);
  };
  auto store = TieredStore::Open(*std::move(store_options));
  if (!store.ok()) {
    LogError("cannot open the store: ", store.status().message());
    http.reset();
    events.Close();
    server->Shutdown();
    return 1;
  }
  StoreCollector collector(store->get(), KVTIER_VERSION);
  quotas.SetStore(store->get());
  service.SetStore(store->get());
  if (http) {
    http->AddCollectable(&collector);
    http->AddCollectable(&quotas);
  }
  serving = true;
  health->SetServingStatus(true);  // "" (the server) and every registered service.

  const int metrics_port = http ? http->port() : 0;
  if (!config.port_file.empty()) {
    if (absl::Status s = WritePortFile(config.port_file, port, metrics_port); !s.ok()) {
      LogError(s.message());
      http.reset();
      events.Close();
      server->Shutdown();
      return 1;
    }
  }
  const std::string host = config.listen.substr(0, config.listen.rfind(':'));
  LogInfo("serving kvtier.v1.KvCache on ", host, ":", port,
          http ? absl::StrCat("; metrics on http://", config.metrics_listen.substr(
                                  0, config.metrics_listen.rfind(':')), ":", metrics_port,
                              "/metrics")
               : "; metrics off");
  Notify(absl::StrCat("READY=1\nSTATUS=serving on ", host, ":", port));

  int sig = 0;
  sigwait(&signals, &sig);
  LogInfo("received ", sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGHUP",
          ": shutting down (grace ",
          absl::FormatDuration(config.shutdown_grace), ")");
  Notify("STOPPING=1\nSTATUS=draining RPCs and flushing write-back");
  serving = false;
  health->SetServingStatus(false);
  prefill.BeginShutdown();  // Sessions send Done with what they streamed, then end.
  events.Close();           // Events subscribers get UNAVAILABLE instead of waiting.
  if (unix_listener) unix_listener->Stop();  // No new connections into a closing server.
  // gRPC's graceful GOAWAY waits for each connection to answer a ping, and an idle C++
  // client (polled only by its 5 s backup poller) answers late: SIGTERM was held up by
  // idle connections. So once no call of ours has been open for a second (time for the
  // last replies to leave: a synchronous handler's call counts as closed when it
  // returns, just before gRPC sends its reply), the connections left are closed
  // outright. A request still arriving then, with no handler yet, is cancelled.
  absl::Notification shut;
  std::thread closer([&] {
    int quiet = 0;
    while (!shut.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
      quiet = rpc_metrics.open_calls() == 0 ? quiet + 1 : 0;
      if (quiet >= 20) {
        LogInfo("no RPC in flight: closing the idle client connections");
        grpc_server_cancel_all_calls(server->c_server());
        return;
      }
    }
  });
  // Not in whole seconds (500ms was none); finite, at most 10 years (Validate).
  server->Shutdown(absl::ToChronoTime(absl::Now() + config.shutdown_grace));
  shut.Notify();
  closer.join();
  server->Wait();
  // The server goes before the store: no handler, reactor or completion callback of
  // gRPC's can reach the store while it closes.
  server.reset();
  LogInfo("RPCs drained; flushing the store");
  http.reset();
  absl::Status closed = (*store)->Close();
  // Leases hold pool chunks, which give their slots back to the pool when dropped:
  // end them while the pool still exists.
  leases.Clear();
  store->reset();
  if (!closed.ok()) {
    LogError("shutdown: ", closed.message());
    return 1;
  }
  LogInfo("stopped cleanly");
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  // Frames and RocksDB batches are 256 KiB to hundreds of MiB. glibc raises its mmap
  // threshold each time such a block is freed, after which they come from heap arenas
  // that do not shrink: resident memory creeps far past the RAM pool. A fixed threshold
  // keeps large blocks on mmap, returned to the kernel on free.
  // Every thread that mallocs gets an arena of its own up to 8 per core by default, and
  // each keeps its high-water mark: with gRPC's thread pool that is tens of MiB of
  // resident memory that no chunk uses. Four arenas keep contention low on the paths
  // that allocate (chunk bytes never come from malloc).
  // With that trim threshold alone, each arena's top was given back and faulted in again
  // on every put (gRPC's receive buffers for a frame grow the heap, then free it): 20-40
  // thousand page faults a second at 0.4 GB/s of 2 MiB puts, a fifth of the daemon's CPU
  // on a VM where a fault costs about 20 microseconds. A top pad keeps 8 MiB per arena
  // (32 MiB at most) mapped across the churn; puts then fault almost never
  // (bench/RESULTS.md, optimisation log).
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  mallopt(M_TRIM_THRESHOLD, 1 << 20);
  mallopt(M_TOP_PAD, kvtier::kMallocTopPad);
  mallopt(M_ARENA_MAX, kvtier::kMallocArenas);
  // Debian builds Abseil without NDEBUG, so every Mutex lock and destruction updates a
  // lock-order graph under one global lock (GraphCycles: about 1% of the daemon's CPU
  // under load, and a point every thread passes through). Lock order is checked in the
  // tests (whose binaries keep it) and statically by the clang thread-safety build; the
  // daemon does not pay for it again.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // SIGTERM, SIGINT and SIGHUP (its terminal closed, for a daemon started in one) are
  // taken synchronously by sigwait in Run(), each a graceful shutdown. Block them first
  // thing, before any library can start a thread, so that every thread inherits the
  // mask and no thread dies of the default action (which loses write-back chunks).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::vector<std::string> args(argv + 1, argv + argc);
  auto parsed = kvtier::ParseDaemonArgs(args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "kvtierd: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  if (parsed->help_requested) {
    std::fputs(kvtier::DaemonUsage().c_str(), stdout);
    return 0;
  }
  if (parsed->version_requested) {
    std::printf("kvtierd %s\n", KVTIER_VERSION);
    return 0;
  }
  if (absl::Status s = parsed->config.Validate(); !s.ok()) {
    std::fprintf(stderr, "kvtierd: %s\n", std::string(s.message()).c_str());
    // 2, which the systemd unit does not restart, only for what the configuration
    // says; a file or service the machine does not provide yet (a secret written at
    // boot) may be there at the next try.
    return absl::IsInvalidArgument(s) ? 2 : 1;
  }
  return kvtier::Run(parsed->config, signals);
}
