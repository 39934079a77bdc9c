// PayloadLog on real files in a temp dir: appends from uneven parts read back exactly,
// per-piece verification hands out no byte of a bad piece, files roll over and are
// deleted once nothing in them is live, Move copies forward, recovery adopts extents and
// deletes the rest, and a full disk is ResourceExhausted with nothing left live.
#include "storage/payload_log.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "storage/crc32c.h"
#include "storage/log.h"
#include "tests/support/fake_clock.h"
#include "tests/support/faulty_payload_ops.h"

namespace kvtier {
namespace {

using ::kvtier::testing::FaultyPayloadOps;
using ::kvtier::testing::TempDir;

constexpr uint64_t kKiB = 1024;

std::string Bytes(uint64_t size, uint64_t seed) {
  std::string s(size, '\0');
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < size; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    s[i] = static_cast<char>(x);
  }
  return s;
}

std::vector<absl::string_view> Uneven(absl::string_view data) {
  std::vector<absl::string_view> parts;
  for (size_t at = 0, n = 777; at < data.size(); n = n * 3 + 1) {
    parts.push_back(data.substr(at, n));
    at += std::min(n, data.size() - at);
  }
  return parts;
}

class PayloadLogTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    options_.dir = dir_.path() + "/payload";
    options_.file_bytes = 256 * kKiB;
    options_.io_bytes = 64 * kKiB;
    options_.piece_bytes = 16 * kKiB;
    options_.write_depth = 2;
    options_.read_depth = 2;
    options_.direct_io = GetParam();
    ops_ = std::make_shared<FaultyPayloadOps>();
    options_.file_ops = ops_;
    Open();
  }
  void Open() {
    log_.reset();
    auto l = PayloadLog::Open(options_);
    ASSERT_TRUE(l.ok()) << l.status();
    log_ = *std::move(l);
  }

  struct Stored {
    PayloadExtent extent;
    std::vector<uint32_t> crcs;
    std::string data;
  };
  Stored Append(uint64_t size, uint64_t seed) {
    Stored s;
    s.data = Bytes(size, seed);
    const auto parts = Uneven(s.data);
    auto e = log_->Append(parts, size, &s.crcs);
    EXPECT_TRUE(e.ok()) << e.status();
    if (e.ok()) s.extent = *e;
    return s;
  }
  absl::StatusOr<std::string> ReadAll(const Stored& s, uint64_t off, uint64_t len) {
    std::string out(len, '\0');
    uint64_t next = off;
    absl::Status st = log_->Read(s.extent, s.crcs, off, len, [&](uint64_t at, absl::string_view b) {
      EXPECT_EQ(at, next) << "handed out in order";
      std::memcpy(out.data() + (at - off), b.data(), b.size());
      next = at + b.size();
    });
    if (!st.ok()) return st;
    EXPECT_EQ(next, off + len);
    return out;
  }
  uint64_t FilesOnDisk() const {
    uint64_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(options_.dir)) {
      if (e.path().extension() == ".kvp") ++n;
    }
    return n;
  }

  TempDir dir_{"kvtier_payload"};
  PayloadLogOptions options_;
  std::shared_ptr<FaultyPayloadOps> ops_;
  std::unique_ptr<PayloadLog> log_;
};

// Place then Write: placements lie in placing order whatever order they are written in
// (the SSD tier's eviction order relies on it), and one dropped unwritten frees its room
// (its file is deleted once nothing in it is live).
TEST_P(PayloadLogTest, PlacementsLieInPlacingOrderAndAnUnwrittenOneIsFreed) {
  const std::string a = Bytes(100 * kKiB, 1), b = Bytes(100 * kKiB, 2);
  auto pa = log_->Place(a.size());
  auto pb = log_->Place(b.size());
  ASSERT_TRUE(pa.ok() && pb.ok());
  const PayloadExtent ea = pa->extent(), eb = pb->extent();
  EXPECT_EQ(ea.file, eb.file);
  EXPECT_LT(ea.offset, eb.offset);
  Stored sb{eb, {}, b};
  const std::vector<absl::string_view> parts_b{b};
  auto wb = log_->Write(*std::move(pb), parts_b, &sb.crcs);  // Written first.
  ASSERT_TRUE(wb.ok()) << wb.status();
  EXPECT_EQ(*wb, eb);
  Stored sa{ea, {}, a};
  const std::vector<absl::string_view> parts_a{a};
  ASSERT_TRUE(log_->Write(*std::move(pa), parts_a, &sa.crcs).ok());
  EXPECT_EQ(ReadAll(sa, 0, a.size()).value(), a);
  EXPECT_EQ(ReadAll(sb, 0, b.size()).value(), b);
  // A placement in a file of its own, dropped: the file goes once it is sealed.
  const uint64_t live = log_->GetStats().live_bytes;
  {
    auto big = log_->Place(200 * kKiB);  // Past file_bytes: a new file.
    ASSERT_TRUE(big.ok());
    EXPECT_NE(big->extent().file, ea.file);
    EXPECT_EQ(log_->GetStats().live_bytes, live + 200 * kKiB);
  }
  EXPECT_EQ(log_->GetStats().live_bytes, live);
  log_->Release(sa.extent);
  log_->Release(sb.extent);
  Stored c = Append(200 * kKiB, 3);  // Seals the dropped placement's file: deleted.
  EXPECT_EQ(FilesOnDisk(), 1u);
  EXPECT_EQ(ReadAll(c, 0, c.data.size()).value(), c.data);
}

TEST_P(PayloadLogTest, AppendsReadBackExactlyWithPieceChecksums) {
  const uint64_t sizes[] = {1, 4096, 16 * kKiB, 100 * kKiB + 3, 200 * kKiB};
  std::vector<Stored> stored;
  for (uint64_t i = 0; i < std::size(sizes); ++i) stored.push_back(Append(sizes[i], i));
  for (const Stored& s : stored) {
    EXPECT_EQ(s.extent.offset % kPayloadAlign, 0u);
    ASSERT_EQ(s.crcs.size(), (s.data.size() + 16 * kKiB - 1) / (16 * kKiB));
    for (size_t p = 0; p < s.crcs.size(); ++p) {
      const absl::string_view piece = absl::string_view(s.data).substr(p * 16 * kKiB, 16 * kKiB);
      EXPECT_EQ(s.crcs[p], crc32c::Value(piece)) << "piece " << p;
    }
    auto all = ReadAll(s, 0, s.data.size());
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_TRUE(*all == s.data);
  }
  // Ranges that start and end inside pieces, across io boundaries.
  const Stored& big = stored[4];
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {1, 10}, {16 * kKiB - 1, 2}, {60 * kKiB, 70 * kKiB}, {200 * kKiB - 5, 5}, {7, 0}}) {
    auto r = ReadAll(big, off, len);
    ASSERT_TRUE(r.ok()) << off << "+" << len << ": " << r.status();
    EXPECT_TRUE(*r == big.data.substr(off, len)) << off << "+" << len;
  }
  EXPECT_EQ(ReadAll(big, 200 * kKiB, 1).status().code(), absl::StatusCode::kInvalidArgument);
  const PayloadLogStats st = log_->GetStats();
  uint64_t footprints = 0;
  for (const Stored& s : stored) footprints += s.extent.footprint();
  EXPECT_EQ(st.live_bytes, footprints);
  EXPECT_EQ(st.bytes_written, footprints) << "each byte written once";
  EXPECT_EQ(ops_->bytes_written(), footprints);
  EXPECT_EQ(st.direct_io, GetParam());
}

TEST_P(PayloadLogTest, ABadPieceHandsOutNothingOfItself) {
  Stored s = Append(100 * kKiB, 9);
  // Flip one byte in the third piece (bytes [32, 48) KiB) on disk.
  const std::string path = options_.dir + "/" + PayloadLog::FileName(s.extent.file);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(s.extent.offset + 40 * kKiB));
    char c;
    f.read(&c, 1);
    c ^= 1;
    f.seekp(static_cast<std::streamoff>(s.extent.offset + 40 * kKiB));
    f.write(&c, 1);
  }
  // Ranges clear of the bad piece still read; any range touching it fails, and what was
  // handed out before the failure ends where the bad piece begins.
  ASSERT_TRUE(ReadAll(s, 0, 32 * kKiB).ok());
  ASSERT_TRUE(ReadAll(s, 48 * kKiB, 52 * kKiB).ok());
  uint64_t handed_end = 0;
  absl::Status st = log_->Read(s.extent, s.crcs, 0, 100 * kKiB,
                               [&](uint64_t at, absl::string_view b) { handed_end = at + b.size(); });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_LE(handed_end, 32 * kKiB);
  EXPECT_EQ(ReadAll(s, 47 * kKiB, 2 * kKiB).status().code(), absl::StatusCode::kDataLoss);
  // Wrong number of piece checksums: the index is inconsistent, never a wrong byte.
  std::vector<uint32_t> short_crcs(s.crcs.begin(), s.crcs.end() - 1);
  EXPECT_EQ(log_->Read(s.extent, short_crcs, 0, 1, [](uint64_t, absl::string_view) {}).code(),
            absl::StatusCode::kDataLoss);
}

TEST_P(PayloadLogTest, FilesRollOverAndDeadFilesAreDeleted) {
  std::vector<Stored> stored;
  for (int i = 0; i < 10; ++i) stored.push_back(Append(100 * kKiB, i));  // 2 per file + 1.
  EXPECT_GE(FilesOnDisk(), 4u);
  const uint32_t first = stored[0].extent.file;
  EXPECT_EQ(stored[1].extent.file, first);
  EXPECT_NE(stored[2].extent.file, first);
  log_->Release(stored[0].extent);
  EXPECT_TRUE(std::filesystem::exists(options_.dir + "/" + PayloadLog::FileName(first)))
      << "one extent is still live";
  auto candidate = log_->MostGarbage();
  ASSERT_TRUE(candidate.has_value());
  EXPECT_EQ(candidate->file, first);
  EXPECT_EQ(candidate->garbage_bytes, 100 * kKiB);
  log_->Release(stored[1].extent);
  EXPECT_FALSE(std::filesystem::exists(options_.dir + "/" + PayloadLog::FileName(first)));
  // The active file is never deleted under a writer, even with nothing live.
  const uint32_t last = stored[9].extent.file;
  log_->Release(stored[9].extent);
  EXPECT_TRUE(std::filesystem::exists(options_.dir + "/" + PayloadLog::FileName(last)));
  uint64_t disk = 0;
  for (const auto& e : std::filesystem::directory_iterator(options_.dir)) disk += e.file_size();
  EXPECT_EQ(log_->disk_bytes(), disk);
}

TEST_P(PayloadLogTest, MoveCopiesVerifiedBytesForward) {
  Stored a = Append(150 * kKiB, 1);
  Stored b = Append(150 * kKiB, 2);  // Rolls over: a file holds at least one extent.
  auto moved = log_->Move(a.extent, a.crcs);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_NE(moved->file, a.extent.file);
  Stored m{*moved, a.crcs, a.data};
  auto r = ReadAll(m, 0, a.data.size());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r == a.data);
  log_->Release(a.extent);
  // A corrupt source is DataLoss and leaves nothing new live.
  const uint64_t live = log_->GetStats().live_bytes;
  ops_->SetCorruptReads(true);
  EXPECT_EQ(log_->Move(b.extent, b.crcs).status().code(), absl::StatusCode::kDataLoss);
  ops_->SetCorruptReads(false);
  EXPECT_EQ(log_->GetStats().live_bytes, live);
}

TEST_P(PayloadLogTest, RecoveryAdoptsWhatTheIndexNamesAndDeletesTheRest) {
  Stored a = Append(100 * kKiB, 1);
  Stored b = Append(100 * kKiB, 2);
  Stored c = Append(200 * kKiB, 3);  // Another file.
  Stored d = Append(200 * kKiB, 4);  // And another, which nothing will adopt.
  ASSERT_NE(c.extent.file, a.extent.file);
  ASSERT_NE(d.extent.file, c.extent.file);
  // A stray file (a crash's leftover) goes at open.
  std::ofstream(options_.dir + "/junk.tmp") << "x";
  Open();
  EXPECT_FALSE(std::filesystem::exists(options_.dir + "/junk.tmp"));
  EXPECT_TRUE(log_->Adopt(a.extent));
  EXPECT_TRUE(log_->Adopt(c.extent));
  // Extents past a file's end, or in a file that is not there, are refused.
  PayloadExtent past = b.extent;
  past.offset += 256 * kKiB;
  EXPECT_FALSE(log_->Adopt(past));
  EXPECT_FALSE(log_->Adopt(PayloadExtent{999, 0, 10}));
  EXPECT_EQ(log_->FinishRecovery(), 1);  // d's file.
  EXPECT_FALSE(std::filesystem::exists(options_.dir + "/" + PayloadLog::FileName(d.extent.file)));
  auto r = ReadAll(a, 0, a.data.size());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r == a.data);
  // New appends go to a new file, never into an old one.
  Stored e = Append(10 * kKiB, 5);
  EXPECT_GT(e.extent.file, d.extent.file);
  EXPECT_EQ(log_->GetStats().live_bytes, a.extent.footprint() + c.extent.footprint() + e.extent.footprint());
}

TEST_P(PayloadLogTest, FullDiskIsResourceExhaustedAndLeavesNothingLive) {
  Stored a = Append(100 * kKiB, 1);
  const uint64_t live = log_->GetStats().live_bytes;
  ops_->FailWritesAfter(64 * kKiB);  // The second io of the next append fails.
  std::string data = Bytes(200 * kKiB, 2);
  const absl::string_view part(data);
  std::vector<uint32_t> crcs;
  auto full = log_->Append({&part, 1}, data.size(), &crcs);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_NE(full.status().message().find("disk full"), std::string::npos);
  EXPECT_EQ(log_->GetStats().live_bytes, live);
  ops_->FailWritesAfter(1ull << 40);
  // Failing syncs are Unavailable, also with nothing left live.
  options_.sync = true;
  Open();
  ASSERT_TRUE(log_->Adopt(a.extent));
  ops_->SetFailSync(true);
  auto unsynced = log_->Append({&part, 1}, data.size(), &crcs);
  EXPECT_EQ(unsynced.status().code(), absl::StatusCode::kUnavailable) << unsynced.status();
  ops_->SetFailSync(false);
  EXPECT_EQ(log_->GetStats().live_bytes, a.extent.footprint());
  auto ok = log_->Append({&part, 1}, data.size(), &crcs);
  ASSERT_TRUE(ok.ok()) << ok.status();
  // Parts that hold fewer bytes than claimed are refused before anything is written.
  EXPECT_EQ(log_->Append({&part, 1}, data.size() + 1, &crcs).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The log leaves min_free_bytes free on the file system, for the index beside it: an
// append that would dip under it is refused before anything is written (no file
// created, nothing live), and goes through once there is room again.
TEST_P(PayloadLogTest, AppendsLeaveMinFreeBytesForTheIndex) {
  constexpr uint64_t kMiB = 1024 * kKiB;
  options_.min_free_bytes = 1 * kMiB;
  options_.file_bytes = 512 * kKiB;
  Open();
  Stored a = Append(100 * kKiB, 1);
  const PayloadLogStats before = log_->GetStats();
  std::string data = Bytes(200 * kKiB, 2);
  const absl::string_view part(data);
  std::vector<uint32_t> crcs;
  // 200 KiB would leave 1 MiB + 100 KiB - 200 KiB: under the floor.
  ops_->SetFreeBytes(kMiB + 100 * kKiB);
  auto refused = log_->Append({&part, 1}, data.size(), &crcs);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("disk full"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("stay free for the SSD tier's index"),
            std::string::npos) << refused.status();
  const PayloadLogStats after = log_->GetStats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.bytes_written, before.bytes_written);
  EXPECT_EQ(after.files, before.files);
  EXPECT_EQ(ops_->bytes_written(), a.extent.footprint()) << "nothing written for it";
  // A Move (garbage collection) is held to the same floor.
  ops_->SetFreeBytes(kMiB + a.extent.footprint() - kPayloadAlign);
  EXPECT_EQ(log_->Move(a.extent, a.crcs).status().code(), absl::StatusCode::kResourceExhausted);
  // Exactly enough room: it goes through.
  ops_->SetFreeBytes(kMiB + 200 * kKiB);
  auto ok = log_->Append({&part, 1}, data.size(), &crcs);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ops_->SetFreeBytes(std::nullopt);
}

// A file under the next name, put there behind the log's back (or left by a creation
// that failed halfway), is skipped, not retried forever: every append after it would
// otherwise fail with a status that says "retry".
TEST_P(PayloadLogTest, AFileUnderTheNextNameIsSkippedNotRetriedForever) {
  Stored a = Append(200 * kKiB, 1);
  const std::string squatter =
      options_.dir + "/" + PayloadLog::FileName(a.extent.file + 1);
  std::ofstream(squatter) << "not ours";
  Stored b = Append(200 * kKiB, 2);  // Does not fit in a's file: needs a new one.
  EXPECT_EQ(b.extent.file, a.extent.file + 2);
  auto r = ReadAll(b, 0, b.data.size());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(*r == b.data);
  std::ifstream in(squatter);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "not ours") << "the log wrote into a file it did not create";
}

// With sync on, a new file's directory entry is made durable before an append into it
// returns (else a power cut can lose the file of an acknowledged chunk); a failed
// directory sync fails the append and leaves no file behind.
TEST_P(PayloadLogTest, SyncedAppendsSyncTheDirectoryOfEachNewFile) {
  Append(100 * kKiB, 1);
  EXPECT_EQ(ops_->dir_syncs(), 0u) << "sync is off";
  options_.sync = true;
  Open();
  Stored a = Append(100 * kKiB, 2);  // A new file: the log never appends to old ones.
  EXPECT_EQ(ops_->dir_syncs(), 1u);
  Append(100 * kKiB, 3);  // Same file.
  EXPECT_EQ(ops_->dir_syncs(), 1u);
  const uint64_t files = FilesOnDisk();
  ops_->SetFailSyncDir(true);
  std::string data = Bytes(200 * kKiB, 4);  // Needs a new file.
  const absl::string_view part(data);
  std::vector<uint32_t> crcs;
  auto failed = log_->Append({&part, 1}, data.size(), &crcs);
  ops_->SetFailSyncDir(false);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_EQ(FilesOnDisk(), files) << "the file whose entry was not synced is left behind";
  Stored b = Append(200 * kKiB, 5);
  EXPECT_NE(b.extent.file, a.extent.file);
  EXPECT_EQ(ops_->dir_syncs(), 2u);
}

// A device that cannot read the bytes (EIO) loses them as surely as a bad checksum:
// DataLoss, not Unavailable, which would have clients retry a read that fails each time.
TEST_P(PayloadLogTest, AnUnreadableDeviceIsDataLoss) {
  Stored a = Append(100 * kKiB, 1);
  ops_->SetReadError(EIO);
  auto r = ReadAll(a, 0, a.data.size());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_EQ(log_->Move(a.extent, a.crcs).status().code(), absl::StatusCode::kDataLoss);
  // Other errors stay retryable.
  ops_->SetReadError(ENOMEM);
  EXPECT_EQ(ReadAll(a, 0, a.data.size()).status().code(), absl::StatusCode::kUnavailable);
  ops_->SetReadError(0);
  auto ok = ReadAll(a, 0, a.data.size());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(*ok == a.data);
}

TEST(PayloadLogOptionsTest, ValidateNamesTheBadOption) {
  PayloadLogOptions o;
  o.dir = "/tmp/x";
  EXPECT_TRUE(o.Validate().ok());
  PayloadLogOptions bad = o;
  bad.piece_bytes = 1000;
  EXPECT_NE(bad.Validate().message().find("piece_bytes"), std::string::npos);
  bad = o;
  bad.io_bytes = bad.piece_bytes * 3 / 2;
  EXPECT_NE(bad.Validate().message().find("io_bytes"), std::string::npos);
  bad = o;
  bad.file_bytes = bad.io_bytes / 2;
  EXPECT_NE(bad.Validate().message().find("file_bytes"), std::string::npos);
  bad = o;
  bad.write_depth = 0;
  EXPECT_NE(bad.Validate().message().find("write_depth"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(DirectAndBuffered, PayloadLogTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Direct" : "Buffered"; });

}  // namespace
}  // namespace kvtier
