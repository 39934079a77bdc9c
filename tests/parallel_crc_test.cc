// ParallelCrc: the CRC32C of pieces split into parts on several threads equals the
// one-pass CRC32C, for every way the part boundaries can fall (inside a piece, on a
// piece's edge, across empty pieces), and `done` runs exactly once.
#include "storage/parallel_crc.h"

#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"

namespace kvtier {
namespace {

uint32_t CrcOf(ParallelCrc& crc, const std::vector<absl::string_view>& pieces) {
  absl::Notification done;
  uint32_t out = 0;
  int calls = 0;
  crc.Compute(pieces, [&](uint32_t c) {
    out = c;
    ++calls;
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_EQ(calls, 1);
  return out;
}

TEST(ParallelCrcTest, PartsAreSizedByMinPartAndThreads) {
  ParallelCrc crc(3, 1000);
  EXPECT_EQ(crc.PartsFor(0), 1);
  EXPECT_EQ(crc.PartsFor(1999), 1);
  EXPECT_EQ(crc.PartsFor(2000), 2);
  EXPECT_EQ(crc.PartsFor(1 << 20), 4);  // Three helpers and the caller.
  ParallelCrc inline_only(0, 1000);
  EXPECT_EQ(inline_only.PartsFor(1 << 20), 1);
}

TEST(ParallelCrcTest, EqualsTheOnePassCrcWhereverThePartsSplit) {
  std::string data(10007, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + (i >> 7));
  const uint32_t want = crc32c::Value(data);
  for (int threads : {0, 1, 2, 3, 7}) {
    for (uint64_t min_part : {1ull, 100ull, 999ull, 5000ull, 20000ull}) {
      ParallelCrc crc(threads, min_part);
      for (size_t piece : {1ul, 64ul, 1000ul, 3333ul, 10007ul}) {
        std::vector<absl::string_view> pieces;
        for (size_t at = 0; at < data.size(); at += piece) {
          pieces.push_back(absl::string_view(data).substr(at, piece));
          if (at % 3 == 0) pieces.push_back(absl::string_view());  // Empty pieces too.
        }
        EXPECT_EQ(CrcOf(crc, pieces), want)
            << "threads " << threads << " min_part " << min_part << " piece " << piece;
      }
    }
  }
  ParallelCrc crc(2, 1);
  EXPECT_EQ(CrcOf(crc, {}), 0u);
}

TEST(ParallelCrcTest, AFlippedByteInAnyPartChangesTheCrc) {
  std::string data(1 << 16, 'k');
  const uint32_t clean = crc32c::Value(data);
  ParallelCrc crc(3, 1024);
  for (size_t at : {0ul, data.size() / 4 + 1, data.size() / 2, data.size() - 1}) {
    data[at] ^= 1;
    EXPECT_NE(CrcOf(crc, {data}), clean) << at;
    data[at] ^= 1;
  }
  EXPECT_EQ(CrcOf(crc, {data}), clean);
}

}  // namespace
}  // namespace kvtier
