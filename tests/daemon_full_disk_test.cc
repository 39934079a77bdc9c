// A full disk under a real kvtierd: the data dir is a small tmpfs, far smaller than
// ssd_capacity. Puts go on succeeding past the disk's room: the SSD tier keeps to what
// fits (said at start-up, and in kvtier_ssd_limit_bytes), evicting the least recently
// used, and every chunk it still serves is intact. The payload files stop short of the
// room RocksDB needs (SsdTierOptions::MinFreeBytes), so the daemon still shuts down
// cleanly and starts again on that disk, after SIGTERM or kill -9, with the newest
// chunks. When something else takes the rest of the disk, RocksDB itself runs out: the
// daemon still stops without crashing (a failed memtable flush is exit 1; the rows are
// in the WAL) and starts again once the space is back. Needs root for the mount; skips
// (saying why) where mounting is not allowed.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "client/kvtier_client.h"
#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::KeyOf;
using testing::PatternBytes;

TEST(FullDiskTest, TheSsdTierKeepsToTheDiskAndStoredChunksSurvive) {
  const std::string mnt = testing::MakeTempDir("kvtier-fulldisk");
  if (mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=160m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs (" << std::strerror(errno)
                 << "); the fault-injection tests in ssd_tier_test cover full disks";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{mnt};

  const std::string data_dir = mnt + "/data";
  auto daemon = testing::DaemonProcess::Start(
      data_dir, {"--write-mode=write-through", "--ram-capacity=64MiB",
                 "--ssd-capacity=1GiB", "--ssd-write-buffer=8MiB"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  // 1 GiB of capacity on a 160 MiB disk: said at start-up, with what would fit.
  EXPECT_NE(daemon->ReadLog().find("the tier will hold only what fits"), std::string::npos)
      << daemon->ReadLog();
  auto client = KvTierClient::Connect(daemon->target());
  ASSERT_TRUE(client.ok());
  auto reg = (*client)->RegisterLayout(testing::LayoutOfMiB(4));
  ASSERT_TRUE(reg.ok()) << reg.status();

  constexpr uint64_t kChunks = 100;  // 400 MiB: well past the 160 MiB disk.
  for (uint64_t i = 0; i < kChunks; ++i) {
    const std::string data = PatternBytes(i, 4 << 20);
    ChunkToPut c{KeyOf(i), data, 256};
    auto r = (*client)->Put(reg->namespace_id, {&c, 1});
    ASSERT_TRUE(r.ok()) << "chunk " << i << ": " << r.status();
  }
  auto metrics = testing::HttpGet(daemon->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const double limit = testing::SeriesValue(metrics->body, "kvtier_ssd_limit_bytes");
  EXPECT_GT(limit, 0) << metrics->body;
  EXPECT_LT(limit, 160 << 20) << metrics->body;
  EXPECT_GT(testing::SeriesValue(metrics->body, "kvtier_tier_evictions_total{tier=\"ssd\"}"), 0)
      << metrics->body;
  // The newest chunks, on SSD; written through, they are there after any restart.
  std::vector<uint64_t> stored;
  for (uint64_t i = kChunks - 4; i < kChunks; ++i) stored.push_back(i);

  // The payload files left RocksDB its room: 2 x ssd_write_buffer + 64 MiB, less what
  // RocksDB itself wrote since (a few MiB of rows and logs).
  struct statvfs fs {};
  ASSERT_EQ(statvfs(mnt.c_str(), &fs), 0);
  EXPECT_GE(static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize, 64ull << 20);

  // Still serving; everything acknowledged is intact, and the failed chunk is not
  // visible. The same after a clean stop and after kill -9, each followed by a restart
  // on the same full disk, and after a stop on a disk someone else filled to the last
  // byte (space given back before the restart).
  const std::vector<std::string> args = {"--write-mode=write-through", "--ram-capacity=64MiB",
                                         "--ssd-capacity=1GiB", "--ssd-write-buffer=8MiB"};
  const char* const rounds[] = {"serving", "after SIGTERM", "after kill -9",
                                "after SIGTERM on a disk filled by someone else"};
  const std::string ballast = mnt + "/ballast";
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(rounds[round]);
    if (round > 0) {
      client->reset();
      if (round == 1) {
        auto code = daemon->Terminate();
        ASSERT_TRUE(code.ok()) << code.status();
        EXPECT_EQ(*code, 0) << daemon->ReadLog();
      } else if (round == 2) {
        daemon->Kill();
      } else {
        // A new layout puts a row in the memtable; the disk is then taken to its last
        // byte, so flushing it at shutdown fails inside RocksDB.
        auto other = KvTierClient::Connect(daemon->target());
        ASSERT_TRUE(other.ok());
        ASSERT_TRUE((*other)->RegisterLayout(testing::LayoutOfMiB(4, "another-model")).ok());
        other->reset();
        const int fd = open(ballast.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        ASSERT_GE(fd, 0);
        const std::string block(1 << 20, '\0');
        for (size_t n : {block.size(), size_t{4096}}) {
          while (write(fd, block.data(), n) == static_cast<ssize_t>(n)) {
          }
        }
        close(fd);
        auto code = daemon->Terminate();
        ASSERT_TRUE(code.ok()) << code.status();
        EXPECT_TRUE(*code == 0 || *code == 1) << "exit " << *code << "\n" << daemon->ReadLog();
        EXPECT_EQ(daemon->ReadLog().find("Assertion"), std::string::npos) << daemon->ReadLog();
        ASSERT_EQ(unlink(ballast.c_str()), 0);
      }
      const std::string previous_log = daemon->ReadLog();
      daemon = testing::DaemonProcess::Start(data_dir, args);
      ASSERT_TRUE(daemon.ok()) << daemon.status() << "\n" << previous_log;
      client = KvTierClient::Connect(daemon->target());
      ASSERT_TRUE(client.ok());
      reg = (*client)->RegisterLayout(testing::LayoutOfMiB(4));
      ASSERT_TRUE(reg.ok()) << reg.status();
    }
    std::vector<ChunkKey> keys;
    for (uint64_t i : stored) keys.push_back(KeyOf(i));
    for (size_t at = 0; at < keys.size(); at += 8) {
      auto part = absl::MakeConstSpan(keys).subspan(at, std::min<size_t>(8, keys.size() - at));
      auto got = (*client)->Get(reg->namespace_id, part);
      ASSERT_TRUE(got.ok()) << got.status();
      for (size_t j = 0; j < part.size(); ++j) {
        ASSERT_TRUE((*got)[j].found) << stored[at + j];
        EXPECT_TRUE((*got)[j].data == PatternBytes(stored[at + j], 4 << 20));
      }
    }
    // Whatever else is still held is intact too.
    for (uint64_t i = 0; i < kChunks - 4; ++i) {
      auto got = (*client)->Get(reg->namespace_id, std::vector<ChunkKey>{KeyOf(i)});
      ASSERT_TRUE(got.ok()) << got.status();
      if ((*got)[0].found) {
        EXPECT_TRUE((*got)[0].data == PatternBytes(i, 4 << 20)) << i;
      }
    }
  }

  client->reset();
  daemon->Kill();
}

}  // namespace
}  // namespace kvtier
