#include "server/daemon_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(ParseByteSizeTest, UnitsAndErrors) {
  EXPECT_EQ(*ParseByteSize("1048576"), 1048576u);
  EXPECT_EQ(*ParseByteSize("4MiB"), 4u << 20);
  EXPECT_EQ(*ParseByteSize("1GiB"), 1ull << 30);
  EXPECT_EQ(*ParseByteSize("512k"), 512u << 10);
  EXPECT_EQ(*ParseByteSize("2 GB"), 2000000000u);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_FALSE(ParseByteSize("lots").ok());
  EXPECT_FALSE(ParseByteSize("12 parsecs").ok());
  EXPECT_FALSE(ParseByteSize("").ok());
  // Below a byte is an error, not 0 (which a quota reads as "no limit").
  EXPECT_FALSE(ParseByteSize("0.5").ok());
  EXPECT_FALSE(ParseByteSize(".5b").ok());
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("0.5k"), 512u);
  EXPECT_EQ(FormatBytes(4u << 20), "4MiB");
  EXPECT_EQ(FormatBytes(1000), "1000B");
}

TEST(DaemonConfigTest, DefaultsValidate) {
  EXPECT_TRUE(DaemonConfig{}.Validate().ok());
  EXPECT_EQ(DaemonConfig{}.listen, "127.0.0.1:50051");
  EXPECT_EQ(DaemonConfig{}.data_dir, "./var/kvtier");
}

TEST(DaemonConfigTest, ShippedExampleConfigMatchesEmbeddedDefaults) {
  std::ifstream in(KVTIER_SOURCE_DIR "/deploy/kvtierd.toml");
  ASSERT_TRUE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  DaemonConfig c;
  c.listen = "changed";
  ASSERT_TRUE(ApplyToml(text.str(), "kvtierd.toml", c).ok());
  EXPECT_EQ(c.Describe(), DaemonConfig{}.Describe());
  // "The same list, commented" (README): every option --help names is in it, set or
  // shown commented out.
  const std::string usage = DaemonUsage();
  int options = 0;
  for (size_t at = usage.find("\n  --"); at != std::string::npos;
       at = usage.find("\n  --", at + 1)) {
    const size_t begin = at + 5;
    const size_t end = usage.find_first_of(" \n", begin);
    std::string key = usage.substr(begin, end - begin);
    std::replace(key.begin(), key.end(), '-', '_');
    if (key == "config" || key == "help,") continue;  // --config, --help, --version.
    ++options;
    EXPECT_TRUE(text.str().find("\n" + key + " = ") != std::string::npos ||
                text.str().find("\n# " + key + " = ") != std::string::npos)
        << key << " is missing from deploy/kvtierd.toml";
  }
  EXPECT_GT(options, 50);
  // Commented-out flags and numbers are shown at their defaults too ("# remote_tls =
  // true" once stood for a default of false). Paths and addresses there are examples.
  std::istringstream lines(text.str());
  int shown = 0;
  for (std::string raw; std::getline(lines, raw);) {
    absl::string_view line = raw;
    if (!absl::ConsumePrefix(&line, "# ")) continue;
    const size_t eq = line.find(" = ");
    if (eq == absl::string_view::npos ||
        line.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") != eq) {
      continue;
    }
    const absl::string_view value = line.substr(eq + 3);
    if (value != "true" && value != "false" &&
        value.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    DaemonConfig shown_config;
    ASSERT_TRUE(ApplyToml(absl::StrCat(line, "\n"), "kvtierd.toml", shown_config).ok())
        << line;
    EXPECT_EQ(shown_config.Describe(), DaemonConfig{}.Describe()) << "not the default: " << line;
    ++shown;
  }
  EXPECT_GE(shown, 2);  // remote_connections_per_node, remote_tls.
}

// The event log is allocated whole at start-up: a value past its bound is refused,
// where it once passed validation and the allocation then aborted the daemon.
TEST(DaemonConfigTest, EventBufferPastItsBoundIsRefused) {
  DaemonConfig c;
  c.event_buffer = DaemonConfig::kMaxEventBuffer;
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  c.event_buffer = UINT32_MAX;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.Validate().message().find("option event_buffer: at most"), std::string::npos)
      << c.Validate();
}

TEST(DaemonConfigTest, WritebackMaxDirtyDefaultsToHalfThePool) {
  DaemonConfig c;
  c.ram_capacity = 64ull << 20;
  auto o = c.ToStoreOptions();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_dirty_bytes, 32ull << 20);
  c.writeback_max_dirty = 8ull << 20;
  o = c.ToStoreOptions();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_dirty_bytes, 8ull << 20);
  c.writeback_max_dirty = (64ull << 20) + 1;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.Validate().message().find("writeback_max_dirty"), std::string::npos);
}

TEST(DaemonConfigTest, PutBufferBoundsPutStreams) {
  DaemonConfig c;
  c.cpus = 0;  // Unknown: the pool alone sizes the default.
  c.ram_capacity = 32ull << 20;
  EXPECT_EQ(c.PutBufferBytes(), 64ull << 20) << "the floor for small pools";
  c.ram_capacity = 16ull << 30;
  EXPECT_EQ(c.PutBufferBytes(), 2ull << 30) << "an eighth of the pool";
  EXPECT_EQ(c.MaxPutStreams(), (2ull << 30) / ((2ull << 20) + (4ull << 20)));
  c.max_put_buffer = (2ull << 20) + (4ull << 20) - 1;  // Not even one stream.
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.Validate().message().find("max_put_buffer"), std::string::npos);
  c.max_put_buffer = 13ull << 20;
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.MaxPutStreams(), 2u);
}

TEST(DaemonConfigTest, PutBufferDefaultAllowsEightStreamsPerCpu) {
  DaemonConfig c;
  const uint64_t per_stream = (2ull << 20) + (4ull << 20);
  c.ram_capacity = 16ull << 30;  // An eighth: 2 GiB, 341 streams.
  c.cpus = 2;
  EXPECT_EQ(c.PutBufferBytes(), 16 * per_stream);
  EXPECT_EQ(c.MaxPutStreams(), 16u);
  c.cpus = 64;  // 512 streams' worth: the pool's eighth is lower.
  EXPECT_EQ(c.PutBufferBytes(), 2ull << 30);
  c.cpus = 1;  // 48 MiB: the floor is higher.
  EXPECT_EQ(c.PutBufferBytes(), 64ull << 20);
  c.cpus = 2;
  c.max_put_buffer = 1ull << 30;  // Set: CPUs do not matter.
  EXPECT_EQ(c.PutBufferBytes(), 1ull << 30);
  EXPECT_GT(UsableCpus(), 0u);
  EXPECT_EQ(DaemonConfig{}.cpus, UsableCpus());
}

TEST(DaemonConfigTest, GetSendTurnsDefaultIsTwoPerCpuAtLeastFour) {
  DaemonConfig c;
  EXPECT_EQ(c.get_send_turns, 0u);
  c.cpus = 2;
  EXPECT_EQ(c.SendTurnsResolved(), 4u);
  c.cpus = 1;
  EXPECT_EQ(c.SendTurnsResolved(), 4u);
  c.cpus = 0;  // Unknown.
  EXPECT_EQ(c.SendTurnsResolved(), 4u);
  c.cpus = 16;
  EXPECT_EQ(c.SendTurnsResolved(), 32u);
  ASSERT_TRUE(ApplyToml("get_send_turns = 3\n", "t.toml", c).ok());
  EXPECT_EQ(c.SendTurnsResolved(), 3u) << "set: CPUs do not matter";
  auto parsed = ParseDaemonArgs({"--get-send-turns=64"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.SendTurnsResolved(), 64u);
}

TEST(DaemonConfigTest, PrefillSessionsLeaveHalfTheRpcThreads) {
  DaemonConfig c;
  EXPECT_EQ(c.PrefillSessionsBound(), 256u);
  c.max_rpc_threads = 9;
  EXPECT_EQ(c.PrefillSessionsBound(), 4u);
  auto parsed = ParseDaemonArgs({"--max-rpc-threads=64", "--max-prefill-sessions=32"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.PrefillSessionsBound(), 32u);
  EXPECT_TRUE(parsed->config.Validate().ok());
  auto over = ParseDaemonArgs({"--max-rpc-threads=64", "--max-prefill-sessions=33"});
  ASSERT_TRUE(over.ok()) << over.status();
  const absl::Status s = over->config.Validate();
  EXPECT_NE(s.message().find("option max_prefill_sessions"), std::string::npos) << s;
}

TEST(DaemonConfigTest, PutPlaceIdleParsesAndMustNotBeNegative) {
  DaemonConfig c;
  EXPECT_EQ(c.put_place_idle, absl::Milliseconds(500));
  ASSERT_TRUE(ApplyToml("put_place_idle = \"250ms\"\n", "t.toml", c).ok());
  EXPECT_EQ(c.put_place_idle, absl::Milliseconds(250));
  c.put_place_idle = absl::Seconds(-1);
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.Validate().message().find("put_place_idle"), std::string::npos);
  c.put_place_idle = absl::Milliseconds(1);  // The reaper would sweep without pause.
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.Validate().message().find("put_place_idle"), std::string::npos);
  c.put_place_idle = absl::ZeroDuration();  // Off.
  EXPECT_TRUE(c.Validate().ok());
}

TEST(DaemonConfigTest, MemoryBesidePoolNamesEachBoundedBuffer) {
  auto parts_of = [](const DaemonConfig& c) {
    std::map<std::string, uint64_t> parts;
    for (const DaemonConfig::MemoryPart& p : c.MemoryBesidePool()) {
      EXPECT_TRUE(parts.emplace(p.part, p.bytes).second) << "part twice: " << p.part;
    }
    return parts;
  };
  DaemonConfig c;
  c.ram_capacity = 512ull << 20;
  c.write_mode = "write-through";
  c.ssd_stream_buffer = 48ull << 20;
  c.ssd_write_buffer = 16ull << 20;
  const std::map<std::string, uint64_t> expected = {
      {"put_buffer", 64ull << 20},         // The floor: an eighth of 512 MiB is less.
      {"put_waiters", 256 * (2ull << 20)},  // 256 in line, a stream_window each at most.
      {"ssd_stream_buffer", 96ull << 20},  // The budget and its recycled spares.
      {"ssd_io_buffers", (4 + 1 + 2 * 4) * (4ull << 20)},  // Payload log staging.
      {"ssd_memtables", 16ull << 20},
      {"prefill_ssd_reads", 4 * (512ull << 20)},  // Whole chunks of max_chunk_size.
      {"malloc_pad", 4 * (8ull << 20)},
  };
  EXPECT_EQ(parts_of(c), expected);
  c.max_put_buffer = 100ull << 20;
  EXPECT_EQ(parts_of(c)["put_buffer"], 100ull << 20) << "the set value, resolved";
  c.max_chunk_size = 8ull << 20;
  EXPECT_EQ(parts_of(c)["prefill_ssd_reads"], 4 * (8ull << 20));
  EXPECT_EQ(parts_of(c)["ssd_stream_buffer"], 96ull << 20);
  c.max_put_waiters = 8;
  EXPECT_EQ(parts_of(c)["put_waiters"], 8 * (2ull << 20));
  c.remote_seeds = "127.0.0.1:7000";
  EXPECT_EQ(parts_of(c)["remote_batches"], 2 * (16ull << 20)) << "two writers' pipelines";
  // No SSD tier and no shared tier, no buffers of theirs.
  c.remote_seeds.clear();
  c.write_mode = "ram-only";
  c.max_put_waiters = 0;  // No line, no part for it.
  const std::map<std::string, uint64_t> ram_only = {{"put_buffer", 100ull << 20},
                                                    {"malloc_pad", 4 * (8ull << 20)}};
  EXPECT_EQ(parts_of(c), ram_only);
}

TEST(DaemonConfigTest, GrpcMemoryHoldsThePutStreams) {
  DaemonConfig c;
  c.cpus = 0;  // max_put_buffer resolves to an eighth of the pool.
  c.ram_capacity = 16ull << 30;
  EXPECT_EQ(c.GrpcMemoryBytes(64ull << 30), 24ull << 30) << "half the memory beside the pool";
  EXPECT_EQ(c.GrpcMemoryBytes(20ull << 30), 4ull << 30) << "twice the resolved max_put_buffer";
  EXPECT_EQ(c.GrpcMemoryBytes(8ull << 30), 4ull << 30) << "a pool larger than the machine";
  c.max_put_buffer = 64ull << 20;
  EXPECT_EQ(c.GrpcMemoryBytes(16ull << 30 | 256ull << 20), 128ull << 20);
  c.grpc_memory = (128ull << 20) - 1;  // The Put streams it admits could fill it.
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.Validate().message().find("grpc_memory"), std::string::npos);
  c.grpc_memory = 128ull << 20;
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.GrpcMemoryBytes(64ull << 30), 128ull << 20) << "set: the machine does not matter";
}

// A systemd unit's MemoryMax= sits on the unit's cgroup, not the root: the lowest limit
// on the way from the process's cgroup up to the root is the one that binds.
TEST(DaemonConfigTest, CgroupMemoryLimitIsTheLowestOnThePathToTheRoot) {
  const std::string root = ::testing::TempDir() + "/cgroup-" + std::to_string(getpid());
  std::filesystem::create_directories(root + "/system.slice/kvtierd.service");
  const std::string self = root + "/self";
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream(path) << text;
  };
  write(self, "0::/system.slice/kvtierd.service\n");
  EXPECT_EQ(CgroupMemoryLimit(root, self), 0u) << "no memory.max anywhere";
  write(root + "/system.slice/kvtierd.service/memory.max", "max\n");
  write(root + "/system.slice/memory.max", "8589934592\n");
  EXPECT_EQ(CgroupMemoryLimit(root, self), 8ull << 30) << "the slice's";
  write(root + "/system.slice/kvtierd.service/memory.max", "4294967296\n");
  EXPECT_EQ(CgroupMemoryLimit(root, self), 4ull << 30) << "the unit's, lower";
  write(root + "/memory.max", "1073741824\n");
  EXPECT_EQ(CgroupMemoryLimit(root, self), 1ull << 30) << "the root's, lower still";
  write(self, "0::/\n");  // A container's own namespace: its root.
  EXPECT_EQ(CgroupMemoryLimit(root, self), 1ull << 30);
  write(self, "");  // cgroup v1 or no line: only the root's.
  EXPECT_EQ(CgroupMemoryLimit(root, self), 1ull << 30);
  std::filesystem::remove_all(root);
}

TEST(DaemonConfigTest, MachineMemoryIsAtMostThePhysicalMemory) {
  const uint64_t physical = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                            static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  EXPECT_GT(MachineMemoryBytes(), 0u);
  EXPECT_LE(MachineMemoryBytes(), physical);
}

TEST(DaemonConfigTest, SharedMemoryOptions) {
  DaemonConfig c;
  EXPECT_EQ(c.RegionSocketName(0xab), "@kvtierd-00000000000000ab");
  c.shm_socket = "off";
  EXPECT_EQ(c.RegionSocketName(0xab), "");
  c.shm_socket = "/run/kvtier/shm.sock";
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.RegionSocketName(0xab), "/run/kvtier/shm.sock");
  for (const char* bad : {"relative.sock", "@", "", "/"}) {
    c.shm_socket = bad;
    EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  c.shm_socket = "/" + std::string(120, 'x');
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  // One path for both sockets: refused, naming both options (the gRPC listener would
  // otherwise find the region socket on its path).
  c.shm_socket = "/run/kvtier/kvtierd.sock";
  c.listen_unix = "/run/kvtier//kvtierd.sock";
  const absl::Status same = c.Validate();
  EXPECT_EQ(same.code(), absl::StatusCode::kInvalidArgument) << same;
  EXPECT_NE(same.message().find("listen_unix and shm_socket"), std::string::npos) << same;
  c.listen_unix = "/run/kvtier/kvtierd-grpc.sock";
  EXPECT_TRUE(c.Validate().ok());
  c.listen_unix.clear();
  c.shm_socket = "auto";
  c.shm_max_regions = 0;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c.shm_max_regions = 1;
  // Copy threads: 0 resolves to the host's cores (1 to 8), more than 64 is refused.
  EXPECT_GE(c.ShmCopyThreads(), 1u);
  EXPECT_LE(c.ShmCopyThreads(), 8u);
  c.shm_copy_threads = 3;
  EXPECT_EQ(c.ShmCopyThreads(), 3u);
  c.shm_copy_threads = 65;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c.shm_copy_threads = 0;
  c.shm_allowed_group = "4242";
  ASSERT_TRUE(c.AllowedGid().ok());
  EXPECT_EQ(**c.AllowedGid(), 4242u);
  c.shm_allowed_group = "root";
  ASSERT_TRUE(c.AllowedGid().ok());
  EXPECT_EQ(**c.AllowedGid(), 0u);
  c.shm_allowed_group = "no-such-group-kvtier";
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// A group whose entry (thousands of members from LDAP or sssd) needs a buffer of
// `needed` bytes: getgrnam_r answers ERANGE below that.
struct LargeGroup {
  size_t needed;
  std::vector<size_t>* sizes;  // Every buffer size asked with.
  int operator()(const char* name, group* grp, char* buf, size_t len, group** result) const {
    sizes->push_back(len);
    *result = nullptr;
    if (std::string(name) != "big") return 0;
    if (len < needed) return ERANGE;
    grp->gr_name = buf;
    grp->gr_gid = 31337;
    *result = grp;
    return 0;
  }
};

// A large group was once reported missing ("no group named"): ERANGE on a fixed 16KiB
// buffer counted as not found, and the daemon exited 2.
TEST(DaemonConfigTest, AGroupLargerThanTheFirstBufferStillResolves) {
  std::vector<size_t> sizes;
  auto gid = LookUpGroupId("big", "shm_allowed_group", LargeGroup{size_t{1} << 20, &sizes});
  ASSERT_TRUE(gid.ok()) << gid.status();
  EXPECT_EQ(*gid, 31337u);
  ASSERT_GE(sizes.size(), 2u);
  EXPECT_GE(sizes.back(), size_t{1} << 20);
  // A missing group is still InvalidArgument, naming it.
  auto missing = LookUpGroupId("small", "shm_allowed_group", LargeGroup{0, &sizes});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("no group named 'small'"), std::string::npos)
      << missing.status();
  // An entry that never fits stops at the bound, and does not say the group is missing.
  sizes.clear();
  auto huge = LookUpGroupId("big", "shm_allowed_group", LargeGroup{SIZE_MAX, &sizes});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(huge.status().message().find("no group named"), std::string::npos) << huge.status();
  EXPECT_LE(sizes.back(), kMaxGroupEntryBytes);
  // A directory that does not answer is Unavailable, not a missing group.
  auto down = LookUpGroupId("big", "shm_allowed_group",
                            [](const char*, group*, char*, size_t, group** result) {
                              *result = nullptr;
                              return EIO;
                            });
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
}

TEST(DaemonConfigTest, MaxLayoutsParsesReachesTheStoreAndMustBePositive) {
  auto parsed = ParseDaemonArgs({"--max-layouts=12"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.max_layouts, 12u);
  auto store = parsed->config.ToStoreOptions();
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->max_layouts, 12u);
  DaemonConfig c;
  EXPECT_EQ(c.max_layouts, 4096u);
  c.max_layouts = 0;
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_layouts"), std::string::npos) << s;
}

TEST(DaemonConfigTest, GpuOptions) {
  DaemonConfig c;
  EXPECT_EQ(c.GpuDevice(), std::optional<int>(0));  // auto
  c.gpu = "off";
  EXPECT_EQ(c.GpuDevice(), std::nullopt);
  c.gpu = "3";
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.GpuDevice(), std::optional<int>(3));
  for (const char* bad : {"-1", "gpu0", "", "on"}) {
    c.gpu = bad;
    const absl::Status s = c.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("option gpu"), absl::string_view::npos) << s;
  }
  c.gpu = "auto";
  c.gpu_copy_streams = 0;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c.gpu_copy_streams = 2;
  c.gpu_crc_threads = 65;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c.gpu_crc_threads = 8;
  EXPECT_TRUE(c.Validate().ok());
  c.gpu_staging_size = 4096;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c.gpu_staging_size = 0;
  EXPECT_TRUE(c.Validate().ok());
  auto parsed = ParseDaemonArgs({"--gpu=off", "--gpu-staging-size=256MiB"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.gpu, "off");
  EXPECT_EQ(parsed->config.gpu_staging_size, 256ull << 20);
  EXPECT_EQ(parsed->config.ToStoreOptions()->gpu_staging.capacity_bytes, 256ull << 20);
}

TEST(DaemonConfigTest, FlagsOverrideFileWhateverTheOrder) {
  const std::string path = ::testing::TempDir() + "/override.toml";
  std::ofstream(path) << "ram_capacity = \"2GiB\"\nwrite_mode = \"ram-only\"\n"
                         "max_keys_per_request = 16\nlock_memory = true\n";
  auto parsed = ParseDaemonArgs({"--ram-capacity=3GiB", "--config", path, "--data-dir", "/x"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.ram_capacity, 3ull << 30);
  EXPECT_EQ(parsed->config.write_mode, "ram-only");
  EXPECT_EQ(parsed->config.max_keys_per_request, 16u);
  EXPECT_TRUE(parsed->config.lock_memory);
  EXPECT_EQ(parsed->config.data_dir, "/x");
}

TEST(DaemonConfigTest, BoolFlagsAndDashes) {
  auto parsed = ParseDaemonArgs({"--lock-memory", "--ssd_sync_writes=false", "--ssd-ttl=24h"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->config.lock_memory);
  EXPECT_FALSE(parsed->config.ssd_sync_writes);
  EXPECT_EQ(parsed->config.ssd_ttl, absl::Hours(24));
}

TEST(DaemonConfigTest, ErrorsNameTheOption) {
  auto unknown = ParseDaemonArgs({"--ram-capacty=1GiB"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("ram-capacty"), std::string::npos);

  auto bad_value = ParseDaemonArgs({"--ssd-ttl=soon"});
  ASSERT_FALSE(bad_value.ok());
  EXPECT_NE(bad_value.status().message().find("ssd_ttl"), std::string::npos);

  auto missing = ParseDaemonArgs({"--listen"});
  EXPECT_FALSE(missing.ok());

  // An infinite duration overflowed where it met a clock (a shutdown deadline in the
  // past, a Redis timeout at once) or Redis (PX out of range: nothing shared).
  for (const char* flag : {"--shutdown-grace=inf", "--remote-ttl=inf", "--remote-timeout=inf",
                           "--ssd-ttl=-inf", "--shutdown-grace=100000h"}) {
    auto r = ParseDaemonArgs({flag});
    ASSERT_FALSE(r.ok()) << flag;
    EXPECT_NE(r.status().message().find("10 years"), std::string::npos) << r.status();
  }
  auto half_second = ParseDaemonArgs({"--shutdown-grace=500ms"});
  ASSERT_TRUE(half_second.ok()) << half_second.status();
  EXPECT_EQ(half_second->config.shutdown_grace, absl::Milliseconds(500));

  DaemonConfig c;
  EXPECT_FALSE(ApplyToml("ram_capacity = [1, 2]", "x.toml", c).ok());
  absl::Status syntax = ApplyToml("ram_capacity = ", "x.toml", c);
  ASSERT_FALSE(syntax.ok());
  EXPECT_NE(syntax.message().find("line 1"), std::string::npos) << syntax.message();

  struct Case {
    void (*mutate)(DaemonConfig&);
    const char* option;
  } cases[] = {
      {[](DaemonConfig& c) { c.listen = "nohostport"; }, "listen"},
      {[](DaemonConfig& c) { c.ram_slot_size = 1000; }, "ram_slot_size"},
      {[](DaemonConfig& c) { c.ram_capacity = 1; }, "ram_capacity"},
      {[](DaemonConfig& c) { c.ssd_capacity = 0; }, "ssd_capacity"},
      {[](DaemonConfig& c) { c.write_mode = "sometimes"; }, "write_mode"},
      {[](DaemonConfig& c) { c.max_frame_size = 10; }, "max_frame_size"},
      {[](DaemonConfig& c) { c.stream_window = 1000; }, "stream_window"},
      {[](DaemonConfig& c) { c.ssd_stream_buffer = 1 << 20; }, "ssd_stream_buffer"},
      {[](DaemonConfig& c) { c.stream_window = 1ull << 30; }, "stream_window"},
      {[](DaemonConfig& c) { c.http2_max_frame = 16383; }, "http2_max_frame"},
      {[](DaemonConfig& c) { c.http2_max_frame = 16ull << 20; }, "http2_max_frame"},
      {[](DaemonConfig& c) { c.max_keys_per_request = 0; }, "max_keys_per_request"},
      {[](DaemonConfig& c) { c.max_lease_seconds = 0; }, "max_lease_seconds"},
      {[](DaemonConfig& c) { c.max_lease_bytes = c.ram_capacity + 1; }, "max_lease_bytes"},
      {[](DaemonConfig& c) { c.max_pinned_fraction = 1.5; }, "max_pinned_fraction"},
      {[](DaemonConfig& c) { c.log_level = "loud"; }, "log_level"},
      {[](DaemonConfig& c) { c.ssd_write_buffer = 1024; }, "ssd_write_buffer"},
      // Ports past 65535 would wrap (99999 binds 34463), negative ones fail at bind.
      {[](DaemonConfig& c) { c.listen = "127.0.0.1:99999"; }, "listen"},
      {[](DaemonConfig& c) { c.listen = "127.0.0.1:-1"; }, "listen"},
      {[](DaemonConfig& c) { c.listen = "127.0.0.1:"; }, "listen"},
      {[](DaemonConfig& c) { c.metrics_listen = "127.0.0.1:70000"; }, "metrics_listen"},
      {[](DaemonConfig& c) { c.client_idle_timeout = absl::Seconds(-1); },
       "client_idle_timeout"},
      // Each thread a stack; past the task limit the daemon aborts at a burst.
      {[](DaemonConfig& c) { c.max_rpc_threads = 100000; }, "max_rpc_threads"},
      {[](DaemonConfig& c) { c.max_rpc_threads = 4294967295u; }, "max_rpc_threads"},
      // Cast to gRPC's int, it went negative.
      {[](DaemonConfig& c) { c.max_streams_per_connection = 3000000000u; },
       "max_streams_per_connection"},
      // poll() takes int milliseconds.
      {[](DaemonConfig& c) { c.remote_timeout = absl::Hours(24 * 30); }, "remote_timeout"},
  };
  for (const Case& k : cases) {
    DaemonConfig bad;
    k.mutate(bad);
    absl::Status s = bad.Validate();
    ASSERT_FALSE(s.ok()) << k.option;
    EXPECT_NE(s.message().find(k.option), std::string::npos) << k.option << ": " << s.message();
  }
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// What --config accepts: a regular file of at most 1 MiB, flat keys, no NUL in strings.
// Each of these once started on defaults, hung, crashed (a stack overflow in the TOML
// parser) or used a truncated value.
TEST(DaemonConfigTest, ConfigFilesThatAreNotConfigsAreRefused) {
  const std::string dir = ::testing::TempDir() + "/kvtier-config-cases";
  std::filesystem::create_directories(dir);
  const std::string fifo = dir + "/fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string big = dir + "/big.toml";
  std::ofstream(big) << "# " << std::string(2 << 20, 'x') << "\n";
  const std::string deep = dir + "/deep.toml";
  {
    std::string key = "a";
    for (int i = 0; i < 50000; ++i) key += ".a";
    std::ofstream(deep) << key << " = 1\n";
  }
  const std::string deep_table = dir + "/deep-table.toml";
  {
    std::string key = "[a";
    for (int i = 0; i < 50000; ++i) key += ".a";
    std::ofstream(deep_table) << key << "]\n";
  }
  const std::string deep_quoted = dir + "/deep-quoted.toml";  // '=' inside the quoted key.
  {
    std::string key = "\"x=y\"";
    for (int i = 0; i < 50000; ++i) key += ".a";
    std::ofstream(deep_quoted) << key << " = 1\n";
  }
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"--config", dir}, "is not a regular file"},
      {{"--config", fifo}, "is not a regular file"},
      {{"--config", "/dev/zero"}, "is not a regular file"},
      {{"--config="}, "--config needs a file"},
      {{"--config", big}, "larger than 1 MiB"},
      {{"--config", deep}, "line 1: a key nested 50001 levels deep"},
      {{"--config", deep_table}, "line 1: a key nested 50001 levels deep"},
      {{"--config", deep_quoted}, "line 1: a key nested 50001 levels deep"},
  };
  for (const auto& c : cases) {
    auto parsed = ParseDaemonArgs(c.args);
    ASSERT_FALSE(parsed.ok()) << c.args.back();
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(c.message), std::string::npos)
        << c.args.back() << ": " << parsed.status().message();
  }
  // A NUL inside a string value: the path used would stop there.
  DaemonConfig config;
  const std::string nul("listen_unix = \"/tmp/a\\u0000.sock\"\n");
  absl::Status s = ApplyToml(nul, "nul.toml", config);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("listen_unix contains a NUL"), std::string::npos) << s.message();
  // Dots inside quoted values or comments are not nesting.
  EXPECT_TRUE(ApplyToml("data_dir = \"/a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s\"  # x.y.z\n",
                        "dots.toml", config).ok());
  // Nor are dots after a quoted key that holds '='.
  const absl::Status quoted_key =
      ApplyToml("\"a=b\" = \"/a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s\"\n", "q.toml", config);
  EXPECT_EQ(quoted_key.message().find("levels deep"), std::string::npos) << quoted_key;
}

TEST(DaemonConfigTest, PlaintextBeyondLoopbackNeedsConsent) {
  for (const char* local : {"127.0.0.1:1", "127.1.2.3:0", "localhost:50051", "[::1]:1"}) {
    DaemonConfig c;
    c.listen = local;
    EXPECT_TRUE(c.ListenIsLoopback()) << local;
    EXPECT_TRUE(c.Validate().ok()) << local;
  }
  for (const char* remote : {"0.0.0.0:50051", "[::]:50051", "10.0.0.7:1", "kvtier.example:1"}) {
    DaemonConfig c;
    c.listen = remote;
    EXPECT_FALSE(c.ListenIsLoopback()) << remote;
    absl::Status s = c.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << remote;
    EXPECT_NE(s.message().find("allow_insecure_remote"), std::string::npos) << s;
    c.allow_insecure_remote = true;
    EXPECT_TRUE(c.Validate().ok()) << remote;
    c.allow_insecure_remote = false;
    c.tls_cert_file = "/etc/kvtier/cert.pem";
    c.tls_key_file = "/etc/kvtier/key.pem";
    // TLS alone authenticates nobody: every caller would be the implicit admin.
    s = c.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << remote;
    EXPECT_NE(s.message().find("tls_client_ca_file"), std::string::npos) << s;
    EXPECT_NE(s.message().find("tenants_file"), std::string::npos) << s;
    c.tls_client_ca_file = "/etc/kvtier/ca.pem";
    EXPECT_TRUE(c.Validate().ok()) << remote;
    c.tls_client_ca_file.clear();
    c.tenants_file = "/etc/kvtier/tenants";
    EXPECT_TRUE(c.Validate().ok()) << remote;
    c.tenants_file.clear();
    c.allow_insecure_remote = true;
    EXPECT_TRUE(c.Validate().ok()) << remote;
  }
}

TEST(DaemonConfigTest, TlsAndUnixSocketOptions) {
  DaemonConfig c;
  c.tls_cert_file = "/c.pem";
  EXPECT_NE(c.Validate().message().find("tls_key_file"), std::string::npos);
  c.tls_cert_file = "";
  c.tls_client_ca_file = "/ca.pem";
  EXPECT_NE(c.Validate().message().find("option tls_client_ca_file"), std::string::npos);
  c.tls_cert_file = "/c.pem";
  c.tls_key_file = "/k.pem";
  EXPECT_TRUE(c.Validate().ok());
  c.tls_reload_interval = absl::Milliseconds(10);
  EXPECT_NE(c.Validate().message().find("option tls_reload_interval"), std::string::npos);
  DaemonConfig u;
  u.listen_unix = "kvtierd.sock";
  EXPECT_NE(u.Validate().message().find("option listen_unix"), std::string::npos);
  u.listen_unix = "/run/kvtier/kvtierd.sock";
  EXPECT_TRUE(u.Validate().ok());
  auto parsed = ParseDaemonArgs({"--listen=0.0.0.0:1", "--allow-insecure-remote",
                                 "--tenants-file=/etc/kvtier/tenants"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->config.allow_insecure_remote);
  EXPECT_EQ(parsed->config.tenants_file, "/etc/kvtier/tenants");
}

// Certificates from tests/tls/make_test_certs.sh in a fresh directory.
std::string MakeCerts() {
  char tmpl[] = "/tmp/kvtier-redis-certs-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) return "";
  const std::string cmd =
      std::string("bash ") + KVTIER_SOURCE_DIR "/tests/tls/make_test_certs.sh " + dir;
  return std::system(cmd.c_str()) == 0 ? dir : "";
}

TEST(DaemonConfigTest, RemoteTlsOptionsReachTheClusterOptions) {
  EXPECT_FALSE(DaemonConfig{}.remote_tls);
  const std::string certs = MakeCerts();
  ASSERT_FALSE(certs.empty());
  auto parsed = ParseDaemonArgs({"--remote-seeds=10.0.0.5:6379", "--remote-tls",
                                 "--remote-tls-ca-file=" + certs + "/ca.pem",
                                 "--remote-tls-cert-file=" + certs + "/client-a.pem",
                                 "--remote_tls_key_file=" + certs + "/client-a.key",
                                 "--remote-tls-server-name=redis.internal"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const DaemonConfig& c = parsed->config;
  EXPECT_TRUE(c.remote_tls);
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  auto store = c.ToStoreOptions();
  ASSERT_TRUE(store.ok()) << store.status();
  const RedisTls& tls = store->remote.cluster.tls;
  EXPECT_TRUE(tls.enabled);
  EXPECT_EQ(tls.ca_file, certs + "/ca.pem");
  EXPECT_EQ(tls.cert_file, certs + "/client-a.pem");
  EXPECT_EQ(tls.key_file, certs + "/client-a.key");
  EXPECT_EQ(tls.server_name, "redis.internal");
  EXPECT_NE(c.Describe().find("remote_tls=true"), std::string::npos);

  // The same from a config file; TLS with the system trust store and no client
  // certificate needs no file of its own.
  DaemonConfig t;
  ASSERT_TRUE(ApplyToml("remote_seeds = \"10.0.0.5:6379\"\nremote_tls = true\n"
                        "remote_tls_server_name = \"redis.internal\"\n",
                        "kvtierd.toml", t)
                  .ok());
  EXPECT_TRUE(t.remote_tls);
  EXPECT_EQ(t.remote_tls_server_name, "redis.internal");
  EXPECT_TRUE(t.Validate().ok()) << t.Validate();
  EXPECT_TRUE(t.ToStoreOptions()->remote.cluster.tls.enabled);
  // Without remote_tls the cluster is reached in plaintext.
  EXPECT_FALSE(DaemonConfig{}.ToStoreOptions()->remote.cluster.tls.enabled);
}

TEST(DaemonConfigTest, BadRemoteTlsOptionsNameTheOption) {
  const std::string certs = MakeCerts();
  ASSERT_FALSE(certs.empty());
  const std::string garbage = certs + "/garbage.pem";
  std::ofstream(garbage) << "not a certificate\n";
  DaemonConfig good;
  good.remote_seeds = "10.0.0.5:6379";
  good.remote_tls = true;
  good.remote_tls_ca_file = certs + "/ca.pem";
  good.remote_tls_cert_file = certs + "/client-a.pem";
  good.remote_tls_key_file = certs + "/client-a.key";
  ASSERT_TRUE(good.Validate().ok()) << good.Validate();

  struct Case {
    std::function<void(DaemonConfig&)> mutate;
    std::string want;  // The message starts with this.
  } cases[] = {
      {[](DaemonConfig& c) { c.remote_tls = false; },
       "option remote_tls_ca_file: set, but remote_tls is false"},
      {[](DaemonConfig& c) {
         c.remote_tls = false;
         c.remote_tls_ca_file = c.remote_tls_cert_file = c.remote_tls_key_file = "";
         c.remote_tls_server_name = "redis.internal";
       },
       "option remote_tls_server_name: set, but remote_tls is false"},
      {[](DaemonConfig& c) { c.remote_tls_key_file = ""; }, "option remote_tls_key_file: "},
      {[](DaemonConfig& c) { c.remote_tls_cert_file = ""; }, "option remote_tls_cert_file: "},
      {[&](DaemonConfig& c) { c.remote_tls_ca_file = certs + "/missing.pem"; },
       "option remote_tls_ca_file: '" + certs + "/missing.pem': cannot read"},
      {[&](DaemonConfig& c) { c.remote_tls_ca_file = garbage; },
       "option remote_tls_ca_file: '" + garbage + "'"},
      {[&](DaemonConfig& c) { c.remote_tls_cert_file = garbage; },
       "option remote_tls_cert_file: '" + garbage + "'"},
      {[&](DaemonConfig& c) { c.remote_tls_key_file = certs + "/server.key"; },
       "option remote_tls_key_file: '" + certs + "/server.key'"},
  };
  for (const Case& k : cases) {
    DaemonConfig bad = good;
    k.mutate(bad);
    const absl::Status s = bad.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.want;
    EXPECT_EQ(s.message().substr(0, k.want.size()), k.want) << s.message();
  }
}

}  // namespace
}  // namespace kvtier
