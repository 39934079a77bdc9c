// ParallelCopy: the bytes and the CRC32C must be exactly those of a serial copy, however
// the spans fall and whoever runs the parts.
#include "storage/parallel_copy.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "storage/crc32c.h"

namespace kvtier {
namespace {

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Cuts [0, n) into spans of the given lengths (cycled), copying src to dst.
std::vector<ParallelCopy::Span> Cut(std::string& dst, const std::string& src,
                                    const std::vector<size_t>& lengths) {
  std::vector<ParallelCopy::Span> spans;
  size_t at = 0;
  for (size_t i = 0; at < src.size(); ++i) {
    const size_t n = std::min(lengths[i % lengths.size()], src.size() - at);
    spans.push_back({dst.data() + at, src.data() + at, n});
    at += n;
  }
  return spans;
}

TEST(ParallelCopyTest, OptionsAreValidated) {
  EXPECT_TRUE(ParallelCopyOptions{}.Validate().ok());
  EXPECT_FALSE((ParallelCopyOptions{.helpers = -1}.Validate().ok()));
  EXPECT_FALSE((ParallelCopyOptions{.helpers = 1, .min_part_bytes = 100}.Validate().ok()));
  EXPECT_FALSE((ParallelCopyOptions{.helpers = 0, .caller_works = false}.Validate().ok()));
}

TEST(ParallelCopyTest, BytesAndCrcMatchASerialCopyForAnySpans) {
  const std::string src = RandomBytes((3 << 20) + 12345, 1);
  const uint32_t want = crc32c::Extend(77, src.data(), src.size());
  // Pool-slot-like spans, uneven ones, one span, and empty spans among them.
  const std::vector<std::vector<size_t>> layouts = {
      {65536}, {1, 4095, 70000, 0, 333333}, {src.size()}, {0, 1 << 20}};
  for (int helpers : {0, 1, 3}) {
    ParallelCopy copy({.helpers = helpers, .min_part_bytes = 4096});
    for (const auto& lengths : layouts) {
      for (auto over : {crc32c::CrcOver::kSource, crc32c::CrcOver::kDestination}) {
        std::string dst(src.size(), '\0');
        const auto spans = Cut(dst, src, lengths);
        EXPECT_EQ(copy.CopyAndExtend(77, spans, over), want)
            << "helpers " << helpers << " first span " << lengths[0];
        EXPECT_TRUE(dst == src) << "helpers " << helpers << " first span " << lengths[0];
      }
    }
  }
}

TEST(ParallelCopyTest, HelpersRunThePartsAndTheirCrcsCombineInOrder) {
  // The caller claims nothing: every part is a helper's, on other threads, so the
  // result can only be right if the parts' CRCs are combined in stream order.
  const std::string src = RandomBytes(5 << 20, 2);
  ParallelCopy copy({.helpers = 3, .min_part_bytes = 64 << 10, .caller_works = false});
  std::string dst(src.size(), '\0');
  const auto spans = Cut(dst, src, {65536});
  EXPECT_EQ(copy.CopyAndExtend(0, spans, crc32c::CrcOver::kSource), crc32c::Value(src));
  EXPECT_TRUE(dst == src);
  // 4 threads, two parts each.
  EXPECT_EQ(copy.parts_helped(), 8u);
}

TEST(ParallelCopyTest, ShortCopiesStayOnTheCallersThread) {
  const std::string src = RandomBytes((2 << 20) - 1, 3);
  ParallelCopy copy({.helpers = 2, .min_part_bytes = 1 << 20, .caller_works = false});
  std::string dst(src.size(), '\0');
  const auto spans = Cut(dst, src, {65536});
  EXPECT_EQ(copy.CopyAndExtend(0, spans, crc32c::CrcOver::kSource), crc32c::Value(src));
  EXPECT_TRUE(dst == src);
  EXPECT_EQ(copy.parts_helped(), 0u);  // Under two parts' worth: not split.
}

TEST(ParallelCopyTest, ConcurrentCallersShareTheHelpers) {
  ParallelCopy copy({.helpers = 1, .min_part_bytes = 4096});
  std::vector<std::thread> callers;
  std::vector<int> ok(8, 0);
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&, t] {
      const std::string src = RandomBytes((1 << 20) + t * 4099, 10 + t);
      for (int round = 0; round < 20; ++round) {
        std::string dst(src.size(), '\0');
        const auto spans = Cut(dst, src, {65536, 12288});
        if (copy.CopyAndExtend(round, spans, crc32c::CrcOver::kDestination) !=
                crc32c::Extend(round, src.data(), src.size()) ||
            dst != src) {
          return;
        }
      }
      ok[t] = 1;
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(ok, std::vector<int>(8, 1));
}

}  // namespace
}  // namespace kvtier
