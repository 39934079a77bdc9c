// TuneAllocatorForTransfers changes the whole process's malloc, once. Each case runs in a
// fresh process (a "threadsafe" death test re-executes this binary for that case alone),
// so no case sees another's tuning, and each reports through its exit code.
#include "client/allocator_tuning.h"

#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/kvtier_client.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

void Escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }

// Pages in the 4 MiB a round allocates (1024 with 4 KiB pages).
long PagesPerRound() { return (4l << 20) / sysconf(_SC_PAGESIZE); }
// A round that faults in at least a quarter of its pages got them fresh from the kernel;
// one that faults in under 1/64 of them reused the arena's.
bool FaultsEveryRound(long faults) { return faults > PagesPerRound() / 4; }
bool Reuses(long faults) { return faults < PagesPerRound() / 64; }

// What gRPC does with its read buffers, on a thread other than main (so in an arena of
// its own): allocate four 1 MiB blocks, fill them, free them. Returns the minor page
// faults per round after two warm-up rounds: one per page when glibc gives the freed
// top of the arena back to the kernel every round, 0 when it keeps it. Transparent huge
// pages are turned off for the process first, so a fault is a page whatever the
// machine's THP setting.
long FaultsPerRound() {
  prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
  constexpr int kRounds = 16;
  constexpr size_t kBlock = 1 << 20;
  long faults = 0;
  std::thread thread([&] {
    auto round = [] {
      void* blocks[4];
      for (void*& b : blocks) {
        b = std::malloc(kBlock);
        std::memset(b, 1, kBlock);
        Escape(b);
      }
      for (void* b : blocks) std::free(b);
    };
    round();
    round();
    rusage before;
    getrusage(RUSAGE_THREAD, &before);
    for (int i = 0; i < kRounds; ++i) round();
    rusage after;
    getrusage(RUSAGE_THREAD, &after);
    faults = (after.ru_minflt - before.ru_minflt) / kRounds;
  });
  thread.join();
  return faults;
}

// Starts `threads` threads that each malloc a block while all of them are alive (glibc
// gives a new thread a new arena until it reaches its cap), then counts the process's
// arenas in malloc_info's report (one <heap nr=...> per arena, the main one included).
int ArenasAfterThreads(int threads) {
  std::latch allocated(threads);
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i) {
    ts.emplace_back([&] {
      void* p = std::malloc(64 << 10);
      Escape(p);
      allocated.arrive_and_wait();
      std::free(p);
    });
  }
  for (std::thread& t : ts) t.join();
  char* report = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&report, &size);
  malloc_info(0, out);
  std::fclose(out);
  const std::string xml(report, size);
  std::free(report);
  int arenas = 0;
  for (size_t at = xml.find("<heap nr="); at != std::string::npos;
       at = xml.find("<heap nr=", at + 1)) {
    ++arenas;
  }
  return arenas;
}

// Exit codes of the child processes. Not 0: a child that never ran the statement (a
// skip) and returned normally must not pass.
constexpr int kAsExpected = 42;
constexpr int kWrongResult = 1;
constexpr int kStillFaults = 2;
constexpr int kNoFaults = 3;

class AllocatorTuningTest : public testing::Test {
 protected:
  void SetUp() override {
#if !defined(__GLIBC__) || defined(__SANITIZE_ADDRESS__)
    GTEST_SKIP() << "glibc's own malloc only (sanitizers replace it)";
#endif
    // (The test that starts its child with tunables marks it, so that child runs.)
    if (absl::StrContains(StartupGlibcTunables(), "glibc.malloc.") &&
        std::getenv("KVTIER_TEST_CHILD_TUNABLES") == nullptr) {
      GTEST_SKIP() << "this process started with malloc tunables; the tuning stands aside";
    }
    if (std::getenv("MALLOC_ARENA_MAX") != nullptr &&
        std::getenv("KVTIER_TEST_CHILD_TUNABLES") == nullptr) {
      GTEST_SKIP() << "MALLOC_ARENA_MAX caps this process's arenas already";
    }
    GTEST_FLAG_SET(death_test_style, "threadsafe");
  }
};

TEST_F(AllocatorTuningTest, UntunedArenasFaultTheirBuffersInEveryRound) {
  // The cost the tuning removes, shown on this machine's glibc: without it the test
  // below could not tell a working tuning from a broken one.
  EXPECT_EXIT(std::exit(FaultsEveryRound(FaultsPerRound()) ? kAsExpected : kNoFaults),
              testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, ThePadKeepsFreedBuffersMapped) {
  EXPECT_EXIT(
      {
        if (TuneAllocatorForTransfers(16 << 20, "") != AllocatorTuning::kApplied) {
          std::exit(kWrongResult);
        }
        if (!Reuses(FaultsPerRound())) std::exit(kStillFaults);
        // Once per process: a second call (another client) changes nothing.
        std::exit(TuneAllocatorForTransfers(1 << 20, "") == AllocatorTuning::kAlreadyApplied
                      ? kAsExpected
                      : kWrongResult);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, AnOperatorsMallocTunablesWin) {
  EXPECT_EXIT(
      {
        if (TuneAllocatorForTransfers(16 << 20, "glibc.malloc.trim_threshold=131072") !=
            AllocatorTuning::kLeftToOperator) {
          std::exit(kWrongResult);
        }
        std::exit(FaultsEveryRound(FaultsPerRound()) ? kAsExpected : kNoFaults);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, ZeroLeavesTheAllocatorAlone) {
  EXPECT_EXIT(
      {
        if (TuneAllocatorForTransfers(0, "") != AllocatorTuning::kDisabled) {
          std::exit(kWrongResult);
        }
        std::exit(FaultsEveryRound(FaultsPerRound()) ? kAsExpected : kNoFaults);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, ConnectTunesTheProcessUnlessAskedNotTo) {
  // Connect is lazy: no daemon is needed at this address.
  EXPECT_EXIT(
      {
        ClientOptions options;
        options.malloc_top_pad_bytes = 0;
        if (!KvTierClient::Connect("127.0.0.1:1", options).ok()) std::exit(kWrongResult);
        if (!FaultsEveryRound(FaultsPerRound())) std::exit(kNoFaults);  // 0: left alone.
        options.malloc_top_pad_bytes = 16 << 20;
        if (!KvTierClient::Connect("127.0.0.1:1", options).ok()) std::exit(kWrongResult);
        if (!Reuses(FaultsPerRound())) std::exit(kStillFaults);
        std::exit(TuneAllocatorForTransfers(16 << 20, "") == AllocatorTuning::kAlreadyApplied
                      ? kAsExpected
                      : kWrongResult);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, WithoutACapEachThreadGetsAnArena) {
  // What the cap changes, on this machine's glibc (so the test below can fail).
  EXPECT_EXIT(
      {
        if (TuneAllocatorForTransfers(16 << 20, "") != AllocatorTuning::kApplied) {
          std::exit(kWrongResult);
        }
        std::exit(ArenasAfterThreads(8) > 2 ? kAsExpected : kWrongResult);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, TheArenaCapHoldsForThreadsStartedAfterIt) {
  EXPECT_EXIT(
      {
        if (TuneAllocatorForTransfers(16 << 20, "", 2) != AllocatorTuning::kApplied) {
          std::exit(kWrongResult);
        }
        if (ArenasAfterThreads(8) > 2) std::exit(kWrongResult);
        // The pad is set as well.
        std::exit(Reuses(FaultsPerRound()) ? kAsExpected : kStillFaults);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, ConnectCapsTheArenasWhenAsked) {
  // Connect must cap before it makes its channel: gRPC's threads start with it and take
  // arenas of their own (this failed when the tuning came after the channel).
  EXPECT_EXIT(
      {
        ClientOptions options;
        options.malloc_arena_max = 2;
        if (!KvTierClient::Connect("127.0.0.1:1", options).ok()) std::exit(kWrongResult);
        std::exit(ArenasAfterThreads(8) <= 2 ? kAsExpected : kWrongResult);
      },
      testing::ExitedWithCode(kAsExpected), "");
  // Not asked: glibc's default stands.
  EXPECT_EXIT(
      {
        if (!KvTierClient::Connect("127.0.0.1:1").ok()) std::exit(kWrongResult);
        std::exit(ArenasAfterThreads(8) > 2 ? kAsExpected : kWrongResult);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST_F(AllocatorTuningTest, AnOperatorsArenaCapWins) {
  // MALLOC_ARENA_MAX=4 at start-up: glibc allows 4 arenas, and Connect's 2 must not
  // lower it.
  ASSERT_EQ(setenv("MALLOC_ARENA_MAX", "4", 1), 0);
  ASSERT_EQ(setenv("KVTIER_TEST_CHILD_TUNABLES", "1", 1), 0);
  EXPECT_EXIT(
      {
        ClientOptions options;
        options.malloc_arena_max = 2;
        if (!KvTierClient::Connect("127.0.0.1:1", options).ok()) std::exit(kWrongResult);
        const int arenas = ArenasAfterThreads(8);
        std::exit(arenas > 2 && arenas <= 4 ? kAsExpected : kWrongResult);
      },
      testing::ExitedWithCode(kAsExpected), "");
  ASSERT_EQ(unsetenv("MALLOC_ARENA_MAX"), 0);
  ASSERT_EQ(unsetenv("KVTIER_TEST_CHILD_TUNABLES"), 0);
}

TEST_F(AllocatorTuningTest, ConnectHeedsTheTunablesTheProcessStartedWith) {
  // The child is a new process started with this environment (threadsafe death tests
  // execute the binary again), so GLIBC_TUNABLES is in its startup environment.
  ASSERT_EQ(setenv("GLIBC_TUNABLES", "glibc.malloc.check=0", 1), 0);
  ASSERT_EQ(setenv("KVTIER_TEST_CHILD_TUNABLES", "1", 1), 0);
  EXPECT_EXIT(
      {
        if (StartupGlibcTunables() != "glibc.malloc.check=0") std::exit(kWrongResult);
        if (!KvTierClient::Connect("127.0.0.1:1").ok()) std::exit(kWrongResult);
        std::exit(FaultsEveryRound(FaultsPerRound()) ? kAsExpected : kNoFaults);
      },
      testing::ExitedWithCode(kAsExpected), "");
  ASSERT_EQ(unsetenv("GLIBC_TUNABLES"), 0);
  ASSERT_EQ(unsetenv("KVTIER_TEST_CHILD_TUNABLES"), 0);
  // Set after start-up, glibc never read it: it is not the operator's tuning.
  EXPECT_EXIT(
      {
        setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0", 1);
        if (!StartupGlibcTunables().empty()) std::exit(kWrongResult);
        if (!KvTierClient::Connect("127.0.0.1:1").ok()) std::exit(kWrongResult);
        std::exit(Reuses(FaultsPerRound()) ? kAsExpected : kStillFaults);
      },
      testing::ExitedWithCode(kAsExpected), "");
}

TEST(ClientOptionsTest, APadAboveOneGibIsRefused) {
  ClientOptions options;
  options.malloc_top_pad_bytes = (1ull << 30) + 1;
  absl::Status s = options.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("malloc_top_pad_bytes"), std::string::npos) << s;
  options.malloc_top_pad_bytes = 1ull << 30;
  EXPECT_TRUE(options.Validate().ok());
}

TEST(ClientOptionsTest, AnArenaCapAbove1024IsRefused) {
  ClientOptions options;
  options.malloc_arena_max = 1025;
  absl::Status s = options.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("malloc_arena_max"), std::string::npos) << s;
  options.malloc_arena_max = 1024;
  EXPECT_TRUE(options.Validate().ok());
}

}  // namespace
}  // namespace kvtier
