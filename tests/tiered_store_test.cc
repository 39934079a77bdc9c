// TieredStore: puts and reads in every write mode, visibility rules (checksum,
// completeness, abandoned writers), write-back (flusher, demotion, eviction), promotion
// from SSD, pins, deletes racing write-back, and recovery after a restart. Real RocksDB in
// a temp dir; FaultInjectionFs slows or fails the SSD where a test needs it.
#include "storage/tiered_store.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "storage/crc32c.h"
#include "tests/support/fake_clock.h"
#include "storage/log.h"
#include "tests/support/fault_injection_fs.h"
#include "tests/support/faulty_payload_ops.h"

namespace kvtier {

// Test output names the write mode instead of dumping its bytes (found by ADL, so it
// lives in WriteMode's namespace).
void PrintTo(WriteMode mode, std::ostream* os) { *os << WriteModeName(mode); }

namespace {

using ::kvtier::testing::FakeClock;
using ::kvtier::testing::TempDir;

using ::kvtier::testing::FaultInjectionFs;
using ::kvtier::testing::FaultyPayloadOps;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kChunkBytes = kMiB;  // From SmallLayout().
constexpr uint64_t kRamChunks = 8;      // The RAM pool holds this many chunks.



// 4 layers * 2 (K, V) * 2 heads * 128 dims * 256 tokens * 2 bytes = 1 MiB per chunk.
LayoutSpec SmallLayout(absl::string_view model = "test/small-model") {
  LayoutSpec l;
  l.model_id = std::string(model);
  l.model_revision = "r1";
  l.dtype = LayoutSpec::DType::kFloat16;
  l.num_layers = 4;
  l.num_kv_heads = 2;
  l.head_dim = 128;
  l.tokens_per_chunk = 256;
  l.key_position = LayoutSpec::KeyPosition::kPostRope;
  return l;
}

std::string Payload(const ChunkId& id, uint64_t size) {
  std::string s(size, '\0');
  uint64_t x = id.key.hi ^ id.key.lo ^ 0x243f6a8885a308d3ull;
  for (size_t i = 0; i + 8 <= size; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&s[i], &x, 8);
  }
  return s;
}

std::string ReadAll(const ChunkView& view) {
  std::string out;
  out.reserve(view.meta().size);
  view.ForEachPiece(0, view.meta().size,
                    [&](absl::string_view p) { out.append(p.data(), p.size()); });
  return out;
}

// Polls `done` until it holds or `timeout` passes; returns whether it held.
bool WaitFor(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

class TieredStoreTestBase : public ::testing::Test {
 protected:
  void SetUp() override { SetMinLogLevel(LogLevel::kError); }
  void TearDown() override { store_.reset(); }

  TieredStoreOptions Options(WriteMode mode) {
    TieredStoreOptions o;
    o.write_mode = mode;
    o.ram.arena.capacity_bytes = kRamChunks * kChunkBytes;
    o.ram.arena.slot_bytes = 64 << 10;
    o.ram.now = [this] { return clock_.Now(); };
    o.ssd.path = dir_.path() + "/db";
    o.ssd.capacity_bytes = 256 * kMiB;
    o.ssd.write_buffer_bytes = 16 * kMiB;
    o.ssd.file_system = fs_;
    o.ssd.file_ops = ops_;
    o.max_chunk_bytes = 4 * kMiB;
    o.put_wait = absl::Milliseconds(50);  // Tests of a full pool want the answer now.
    return o;
  }

  void Open(WriteMode mode) { OpenWith(Options(mode)); }
  void OpenWith(const TieredStoreOptions& o) {
    store_.reset();
    options_ = o;
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  // Closes and opens again on the same directory.
  void Reopen() {
    ASSERT_TRUE(store_->Close().ok());
    OpenWith(options_);
  }

  uint64_t Register(const LayoutSpec& layout = SmallLayout()) {
    auto r = store_->RegisterLayout(layout);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->namespace_id : 0;
  }

  ChunkId Id(uint64_t n) const { return ChunkId{ns_, ChunkKey{0x5eed000000000000ull | n, n}}; }

  // A whole put: BeginPut, frames of `frame` bytes, CommitPut with the right CRC.
  absl::Status Put(const ChunkId& id, uint64_t frame = 100000) {
    auto w = store_->BeginPut(id, 256);
    if (!w.ok()) return w.status();
    if (*w == nullptr) return absl::AlreadyExistsError("BeginPut says present");
    const std::string data = Payload(id, (*w)->size());
    for (uint64_t at = 0; at < data.size(); at += frame) {
      if (absl::Status s = (*w)->Append(absl::string_view(data).substr(at, frame)); !s.ok()) {
        return s;
      }
    }
    return store_->CommitPut(*std::move(w), crc32c::Value(data));
  }
  void PutOk(const ChunkId& id) { ASSERT_TRUE(Put(id).ok()) << id.DebugString(); }

  // Opens a write-back store (put_wait 10 s) whose RAM is all taken by puts in flight,
  // and returns them: dropping one gives its room back.
  std::vector<std::unique_ptr<ChunkWriter>> OpenFullOfPutsInFlight(TieredStoreOptions o) {
    o.write_mode = WriteMode::kWriteBack;
    o.put_wait = absl::Seconds(10);
    OpenWith(o);
    ns_ = Register();
    std::vector<std::unique_ptr<ChunkWriter>> in_flight;
    for (uint64_t i = 0; i < kRamChunks; ++i) {
      auto w = store_->BeginPut(Id(i), 256);
      EXPECT_TRUE(w.ok()) << w.status();
      if (w.ok()) in_flight.push_back(*std::move(w));
    }
    return in_flight;
  }

  // In write-back mode, waits until the flusher has written every dirty chunk. A
  // chunk deleted while its write-back is in flight can show on SSD for a moment
  // before the flusher undoes its write (see DeleteDuringWriteBackDoesNotResurrect);
  // tests that check absence right after a delete settle first.
  void Settle() {
    if (store_->write_mode() != WriteMode::kWriteBack) return;
    ASSERT_TRUE(WaitFor([&] { return store_->GetStats().writeback_queue_depth == 0; }));
  }

  // Read succeeds, from `tier` unless kNone, with exactly the bytes put.
  void ExpectReadable(const ChunkId& id, Tier tier = Tier::kNone) {
    auto v = store_->Read(id);
    ASSERT_TRUE(v.ok()) << id.DebugString() << ": " << v.status();
    if (tier != Tier::kNone) {
      EXPECT_EQ(v->tier(), tier) << id.DebugString();
    }
    const std::string want = Payload(id, kChunkBytes);
    EXPECT_EQ(v->meta().size, kChunkBytes);
    EXPECT_EQ(v->meta().crc32c, crc32c::Value(want));
    EXPECT_EQ(v->meta().token_count, 256u);
    EXPECT_TRUE(ReadAll(*v) == want) << id.DebugString() << ": bytes differ";
  }

  TempDir dir_{"kvtier_store"};
  FakeClock clock_;
  std::shared_ptr<FaultInjectionFs> fs_ = std::make_shared<FaultInjectionFs>(/*seed=*/7);
  std::shared_ptr<FaultyPayloadOps> ops_ = std::make_shared<FaultyPayloadOps>();
  TieredStoreOptions options_;
  std::unique_ptr<TieredStore> store_;
  uint64_t ns_ = 0;
};

// ---------------------------------------------------------------------------------
// Options and layouts.

TEST(WriteModeTest, ParseAndName) {
  for (WriteMode m : {WriteMode::kWriteBack, WriteMode::kWriteThrough, WriteMode::kRamOnly}) {
    auto parsed = ParseWriteMode(WriteModeName(m));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, m);
  }
  const auto bad = ParseWriteMode("writeback");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "write_mode")) << bad.status();
}

class TieredStoreOptionsTest : public TieredStoreTestBase {};

TEST_F(TieredStoreOptionsTest, ValidateNamesTheBadOption) {
  EXPECT_TRUE(Options(WriteMode::kWriteBack).Validate().ok());
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  o.ssd.path.clear();
  EXPECT_TRUE(absl::StrContains(o.Validate().message(), "data_dir")) << o.Validate();
  EXPECT_EQ(TieredStore::Open(o).status().code(), absl::StatusCode::kInvalidArgument);
  // RAM-only does not need an SSD.
  o.write_mode = WriteMode::kRamOnly;
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o = Options(WriteMode::kWriteThrough);
  o.max_chunk_bytes = 0;
  EXPECT_TRUE(absl::StrContains(o.Validate().message(), "max_chunk_size")) << o.Validate();
  o = Options(WriteMode::kWriteThrough);
  o.ram.arena.slot_bytes = 1000;
  EXPECT_TRUE(absl::StrContains(o.Validate().message(), "ram_slot_size")) << o.Validate();
}

class TieredStoreLayoutTest : public TieredStoreTestBase {
 protected:
  void SetUp() override {
    TieredStoreTestBase::SetUp();
    Open(WriteMode::kWriteBack);
  }
};

// max_layouts bounds what clients can make the daemon keep and persist: past it a new
// layout is FAILED_PRECONDITION (layouts are never unregistered, so a retry cannot
// succeed), a registered one is still answered, and the bound holds across a restart.
TEST_F(TieredStoreLayoutTest, MaxLayoutsBoundsTheRegisteredLayouts) {
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  o.max_layouts = 2;
  OpenWith(o);
  ASSERT_TRUE(store_->RegisterLayout(SmallLayout("a")).ok());
  ASSERT_TRUE(store_->RegisterLayout(SmallLayout("b")).ok());
  auto third = store_->RegisterLayout(SmallLayout("c"));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kFailedPrecondition) << third.status();
  EXPECT_NE(third.status().message().find("max_layouts"), std::string::npos) << third.status();
  auto again = store_->RegisterLayout(SmallLayout("a"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_registered);
  Reopen();
  EXPECT_EQ(store_->GetStats().namespaces, 2u);
  EXPECT_EQ(store_->RegisterLayout(SmallLayout("c")).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A layout whose chunk the SSD tier could never hold is refused when registered (else
// write-back would retry its chunks forever); without an SSD tier only RAM bounds it.
TEST_F(TieredStoreLayoutTest, AChunkLargerThanTheSsdTierIsRefusedAtRegistration) {
  LayoutSpec four = SmallLayout("four-mib");
  four.tokens_per_chunk *= 4;  // 4 MiB chunks.
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  o.ssd.capacity_bytes = 2 * kMiB;
  OpenWith(o);
  auto refused = store_->RegisterLayout(four);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("ssd_capacity"), std::string::npos)
      << refused.status();
  EXPECT_TRUE(store_->RegisterLayout(SmallLayout()).ok()) << "1 MiB chunks fit";
  o.write_mode = WriteMode::kRamOnly;
  OpenWith(o);
  EXPECT_TRUE(store_->RegisterLayout(four).ok());
}

// A layout registered when the SSD tier was larger is loaded at start-up, but its
// chunks can no longer be put: refused as final (FAILED_PRECONDITION, as its
// registration would be now). In write-back they were acknowledged
// into RAM, retried forever by the flusher and never evictable, until the backlog
// refused every put of every namespace and shutdown lost them.
TEST_F(TieredStoreLayoutTest, AStoredLayoutLargerThanTheSsdTierNowRefusesItsPuts) {
  LayoutSpec four = SmallLayout("four-mib");
  four.tokens_per_chunk *= 4;  // 4 MiB chunks.
  for (WriteMode mode : {WriteMode::kWriteBack, WriteMode::kWriteThrough}) {
    TieredStoreOptions o = Options(mode);
    o.ssd.path = dir_.path() + "/db-" + WriteModeName(mode);
    OpenWith(o);
    auto registered = store_->RegisterLayout(four);
    ASSERT_TRUE(registered.ok()) << registered.status();
    ns_ = registered->namespace_id;
    ASSERT_TRUE(store_->Close().ok());
    o.ssd.capacity_bytes = 2 * kMiB;
    OpenWith(o);
    ASSERT_TRUE(store_->FindLayout(ns_).ok()) << "kept, for its chunks' sake";
    auto refused = store_->BeginPut(Id(1), 256);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
        << WriteModeName(mode) << ": " << refused.status();
    EXPECT_NE(refused.status().message().find("ssd_capacity"), std::string::npos);
    EXPECT_EQ(store_->GetStats().ram.chunks, 0u);
    ns_ = Register();  // 1 MiB chunks fit, and are not held up behind the others.
    PutOk(Id(2));
    EXPECT_TRUE(store_->Close().ok());
  }
}

TEST_F(TieredStoreLayoutTest, RegisterIsIdempotent) {
  const LayoutSpec layout = SmallLayout();
  auto first = store_->RegisterLayout(layout);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->namespace_id, layout.NamespaceId());
  EXPECT_EQ(first->chunk_bytes, kChunkBytes);
  EXPECT_FALSE(first->already_registered);
  auto again = store_->RegisterLayout(layout);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->namespace_id, first->namespace_id);
  EXPECT_TRUE(again->already_registered);
  auto found = store_->FindLayout(first->namespace_id);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(*found, layout);
  EXPECT_EQ(store_->GetStats().namespaces, 1u);
  EXPECT_EQ(store_->FindLayout(first->namespace_id + 1).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(TieredStoreLayoutTest, RejectsBadLayouts) {
  LayoutSpec bad = SmallLayout();
  bad.head_dim = 0;
  auto r = store_->RegisterLayout(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "head_dim")) << r.status();
  bad = SmallLayout();
  bad.tp_world_size = 2;
  bad.tp_rank = 2;
  EXPECT_EQ(store_->RegisterLayout(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->GetStats().namespaces, 0u);
}

TEST_F(TieredStoreLayoutTest, RejectsChunksTooBig) {
  // 8 MiB: over max_chunk_bytes (4 MiB) though it would fit in RAM (8 MiB).
  LayoutSpec big = SmallLayout();
  big.tokens_per_chunk = 2048;
  ASSERT_EQ(big.ChunkBytes(), 8 * kMiB);
  auto r = store_->RegisterLayout(big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // Exactly the limit is fine.
  LayoutSpec at_limit = SmallLayout("test/at-limit");
  at_limit.tokens_per_chunk = 1024;
  ASSERT_EQ(at_limit.ChunkBytes(), 4 * kMiB);
  EXPECT_TRUE(store_->RegisterLayout(at_limit).ok());

  // Bounded by RAM as well: a 16 MiB max with an 8 MiB pool still refuses 16 MiB.
  TieredStoreOptions o = Options(WriteMode::kRamOnly);
  o.max_chunk_bytes = 64 * kMiB;
  OpenWith(o);
  LayoutSpec huge = SmallLayout();
  huge.tokens_per_chunk = 4096;
  ASSERT_EQ(huge.ChunkBytes(), 16 * kMiB);
  EXPECT_EQ(store_->RegisterLayout(huge).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->GetStats().namespaces, 0u);
}

TEST_F(TieredStoreLayoutTest, PutNeedsARegisteredNamespace) {
  auto w = store_->BeginPut(ChunkId{12345, ChunkKey{1, 2}}, 256);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->GetStats().ram.used_bytes, 0u);
}

// ---------------------------------------------------------------------------------
// Behaviour common to every write mode.

class TieredStoreModeTest : public TieredStoreTestBase,
                            public ::testing::WithParamInterface<WriteMode> {
 protected:
  void SetUp() override {
    TieredStoreTestBase::SetUp();
    Open(GetParam());
    ns_ = Register();
  }

  // Two puts of `id` admitted at once (neither sees it stored), each with all its bytes.
  void TwoFilledPutsOf(const ChunkId& id, std::unique_ptr<ChunkWriter>* first,
                       std::unique_ptr<ChunkWriter>* second) {
    const std::string data = Payload(id, kChunkBytes);
    for (auto* w : {first, second}) {
      auto begun = store_->BeginPut(id, 256);
      ASSERT_TRUE(begun.ok() && *begun != nullptr);
      *w = *std::move(begun);
      ASSERT_TRUE((*w)->Append(data).ok());
    }
  }
  // CommitPutAsync, waited for: whether the put stored the chunk.
  absl::StatusOr<bool> Commit(std::unique_ptr<ChunkWriter> w) {
    const std::string data = Payload(w->id(), kChunkBytes);
    absl::Notification answered;
    absl::StatusOr<bool> stored;
    store_->CommitPutAsync(std::move(w), crc32c::Value(data), [&](absl::StatusOr<bool> s) {
      stored = std::move(s);
      answered.Notify();
    });
    answered.WaitForNotification();
    return stored;
  }
};

INSTANTIATE_TEST_SUITE_P(AllModes, TieredStoreModeTest,
                         ::testing::Values(WriteMode::kWriteBack, WriteMode::kWriteThrough,
                                           WriteMode::kRamOnly),
                         [](const auto& info) {
                           std::string name = WriteModeName(info.param);
                           name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
                           return name;
                         });

TEST_P(TieredStoreModeTest, PutThenReadIsByteIdentical) {
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  for (uint64_t frame : {uint64_t{1} << 20, uint64_t{100000}, uint64_t{4093}}) {
    const ChunkId id = Id(frame);
    ASSERT_TRUE(Put(id, frame).ok()) << "frame " << frame;
    EXPECT_EQ(store_->Locate(id), Tier::kRam);
    ExpectReadable(id, Tier::kRam);
  }
  // One layer's range, as a layer-wise fetch reads it.
  auto v = store_->Read(Id(4093));
  ASSERT_TRUE(v.ok());
  const uint64_t layer = SmallLayout().LayerBytes();
  std::string layer2;
  v->ForEachPiece(2 * layer, layer,
                  [&](absl::string_view p) { layer2.append(p.data(), p.size()); });
  EXPECT_TRUE(layer2 == Payload(Id(4093), kChunkBytes).substr(2 * layer, layer));
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.ram.chunks, 3u);
  EXPECT_EQ(s.ram.chunk_bytes, 3 * kChunkBytes);
  EXPECT_EQ(s.checksum_failures, 0u);
}

// Two puts of one chunk admitted at once (neither saw it stored) both commit; exactly
// one reports it stored, so the daemon's chunks_stored counts add up.
TEST_P(TieredStoreModeTest, ConcurrentPutsOfOneChunkReportOneStore) {
  std::unique_ptr<ChunkWriter> first, second;
  ASSERT_NO_FATAL_FAILURE(TwoFilledPutsOf(Id(1), &first, &second));
  std::vector<bool> stored;
  for (auto* w : {&first, &second}) {
    absl::StatusOr<bool> s = Commit(std::move(*w));
    ASSERT_TRUE(s.ok()) << s.status();
    stored.push_back(*s);
  }
  EXPECT_EQ(stored, (std::vector<bool>{true, false}));
  ExpectReadable(Id(1));
}

// The same when the first put's copy has left RAM before the second commits (flushed
// and evicted, in write-back; evicted, in write-through): it is on SSD, and the second
// put stores nothing. RAM's insert alone once took it as new, and both reported it
// stored. Without an SSD the chunk is gone, and the second put stores it again.
TEST_P(TieredStoreModeTest, ASecondPutOfAChunkThatLeftRamReportsNoStore) {
  std::unique_ptr<ChunkWriter> first, second;
  ASSERT_NO_FATAL_FAILURE(TwoFilledPutsOf(Id(1), &first, &second));
  absl::StatusOr<bool> stored = Commit(std::move(first));
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_TRUE(*stored);
  // Out of RAM: newer chunks fill the pool (the second put holds one chunk of it), and
  // in write-back evicting a dirty chunk writes it to SSD first.
  for (uint64_t n = 2; n < 2 + kRamChunks; ++n) PutOk(Id(n));
  ASSERT_NE(store_->Locate(Id(1)), Tier::kRam);
  stored = Commit(std::move(second));
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(*stored, GetParam() == WriteMode::kRamOnly);
  ExpectReadable(Id(1));
}

TEST_P(TieredStoreModeTest, CrcMismatchIsInvalidArgumentAndStoresNothing) {
  auto w = store_->BeginPut(Id(1), 256);
  ASSERT_TRUE(w.ok() && *w != nullptr);
  const std::string data = Payload(Id(1), kChunkBytes);
  ASSERT_TRUE((*w)->Append(data).ok());
  const absl::Status s = store_->CommitPut(*std::move(w), crc32c::Value(data) ^ 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The message agrees with the code (do not retry): it once said "resend the chunk".
  EXPECT_NE(s.message().find("do not match the crc32c sent"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("resend"), std::string::npos) << s;
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  TieredStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.put_checksum_mismatches, 1u);
  EXPECT_EQ(stats.checksum_failures, 0u) << "no stored chunk was found corrupt";
  EXPECT_EQ(stats.ram.used_bytes, 0u) << "the rejected chunk's RAM is free again";
  EXPECT_EQ(stats.ram.chunks, 0u);
  EXPECT_EQ(stats.ssd.chunks, 0u);
  // Sending the right bytes and checksum works.
  PutOk(Id(1));
  ExpectReadable(Id(1));
}

TEST_P(TieredStoreModeTest, IncompleteChunkIsRejected) {
  auto w = store_->BeginPut(Id(1), 256);
  ASSERT_TRUE(w.ok() && *w != nullptr);
  EXPECT_EQ((*w)->size(), kChunkBytes);
  const std::string data = Payload(Id(1), kChunkBytes);
  ASSERT_TRUE((*w)->Append(absl::string_view(data).substr(0, kChunkBytes - 1)).ok());
  EXPECT_EQ((*w)->received(), kChunkBytes - 1);
  // Two bytes where one is left: refused, nothing written.
  EXPECT_EQ((*w)->Append("xy").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*w)->received(), kChunkBytes - 1);
  const absl::Status s = store_->CommitPut(*std::move(w), crc32c::Value(data));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "incomplete")) << s;
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().ram.used_bytes, 0u);
}

TEST_P(TieredStoreModeTest, AbandonedWriterLeavesNothingAndFreesRam) {
  {
    auto w = store_->BeginPut(Id(1), 256);
    ASSERT_TRUE(w.ok() && *w != nullptr);
    ASSERT_TRUE((*w)->Append(Payload(Id(1), kChunkBytes / 2)).ok());
    EXPECT_EQ(store_->GetStats().ram.used_bytes, kChunkBytes) << "RAM held while in flight";
    EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone) << "not visible before commit";
  }
  EXPECT_EQ(store_->GetStats().ram.used_bytes, 0u);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  // RAM taken by abandoned puts is reusable: fill it completely.
  for (uint64_t i = 0; i < kRamChunks; ++i) PutOk(Id(100 + i));
}

TEST_P(TieredStoreModeTest, PutIsIdempotent) {
  PutOk(Id(1));
  auto w = store_->BeginPut(Id(1), 256);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, nullptr) << "a present chunk gets no writer";
  EXPECT_EQ(store_->GetStats().ram.used_bytes, kChunkBytes);
  // Two racing puts of the same chunk: both commit, one copy is kept.
  auto a = store_->BeginPut(Id(2), 256);
  auto b = store_->BeginPut(Id(2), 256);
  ASSERT_TRUE(a.ok() && *a && b.ok() && *b);
  const std::string data = Payload(Id(2), kChunkBytes);
  ASSERT_TRUE((*a)->Append(data).ok());
  ASSERT_TRUE((*b)->Append(data).ok());
  EXPECT_TRUE(store_->CommitPut(*std::move(a), crc32c::Value(data)).ok());
  EXPECT_TRUE(store_->CommitPut(*std::move(b), crc32c::Value(data)).ok());
  EXPECT_EQ(store_->GetStats().ram.chunks, 2u);
  EXPECT_EQ(store_->GetStats().ram.used_bytes, 2 * kChunkBytes);
  ExpectReadable(Id(2));
}

TEST_P(TieredStoreModeTest, DeleteAndClear) {
  PutOk(Id(1));
  PutOk(Id(2));
  Settle();
  auto d = store_->Delete(Id(1));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(*d);
  d = store_->Delete(Id(1));
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(*d);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);

  // Another namespace is untouched by Clear.
  const uint64_t ns_a = ns_;
  const uint64_t ns_b = Register(SmallLayout("test/other-model"));
  ns_ = ns_b;
  PutOk(Id(1));
  ns_ = ns_a;
  PutOk(Id(3));
  Settle();
  auto n = store_->Clear(ns_a);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 2u);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kNone);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kNone);
  ns_ = ns_b;
  ExpectReadable(Id(1));
  EXPECT_EQ(store_->GetStats().ram.chunks, 1u);
  // The namespace stays registered: puts work again.
  ns_ = ns_a;
  PutOk(Id(2));
  ExpectReadable(Id(2));
}

TEST_P(TieredStoreModeTest, PinAndUnpin) {
  PutOk(Id(1));
  EXPECT_EQ(store_->Pin(Id(9), absl::ZeroDuration()).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store_->Pin(Id(1), absl::ZeroDuration()).ok());
  EXPECT_EQ(store_->GetStats().ram.pinned_bytes, kChunkBytes);
  EXPECT_TRUE(store_->Unpin(Id(1)));
  EXPECT_FALSE(store_->Unpin(Id(1)));
  EXPECT_EQ(store_->GetStats().ram.pinned_bytes, 0u);
}

TEST_P(TieredStoreModeTest, RamNeverExceedsCapacity) {
  for (uint64_t i = 0; i < 3 * kRamChunks; ++i) {
    ASSERT_TRUE(Put(Id(i)).ok()) << i;
    ASSERT_LE(store_->GetStats().ram.used_bytes, kRamChunks * kChunkBytes);
  }
  // The newest are in RAM.
  for (uint64_t i = 2 * kRamChunks + 1; i < 3 * kRamChunks; ++i) {
    EXPECT_EQ(store_->Locate(Id(i)), Tier::kRam) << i;
  }
}

// ssd_ttl holds in both modes that have an SSD tier: expired chunks are swept off it
// (and its stats) by the store's upkeep, not only when a read finds them. Write-through
// once had no upkeep thread: its expired chunks kept their space until read or evicted.
class TieredStoreTtlTest : public TieredStoreTestBase,
                          public ::testing::WithParamInterface<WriteMode> {};

TEST_P(TieredStoreTtlTest, ExpiredSsdChunksAreSweptOffTheTier) {
  TieredStoreOptions o = Options(GetParam());
  o.ssd.ttl = absl::Seconds(60);
  o.ssd.now = [this] { return clock_.Now(); };
  OpenWith(o);
  ns_ = Register();
  for (uint64_t i = 0; i < 3; ++i) PutOk(Id(i));
  ASSERT_TRUE(WaitFor([&] { return store_->GetStats().ssd.chunks == 3; }));
  clock_.Advance(absl::Seconds(61));
  const bool swept = WaitFor([&] {
    const SsdTierStats s = store_->GetStats().ssd;
    return s.chunks == 0 && s.used_bytes == 0 && s.expirations == 3;
  });
  const SsdTierStats s = store_->GetStats().ssd;
  EXPECT_TRUE(swept) << s.chunks << " chunks, " << s.used_bytes << " bytes, " << s.expirations
                     << " expired";
}

INSTANTIATE_TEST_SUITE_P(SsdModes, TieredStoreTtlTest,
                         ::testing::Values(WriteMode::kWriteBack, WriteMode::kWriteThrough),
                         [](const auto& info) {
                           std::string name = WriteModeName(info.param);
                           name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
                           return name;
                         });

// ---------------------------------------------------------------------------------
// Write-back.

class TieredStoreWriteBackTest : public TieredStoreTestBase {
 protected:
  void SetUp() override {
    TieredStoreTestBase::SetUp();
    Open(WriteMode::kWriteBack);
    ns_ = Register();
  }
  // Waits for the flusher to have written everything.
  // A write-through store holding Id(n), in RAM and on SSD.
  void WriteThroughHolding(uint64_t n) {
    OpenWith(Options(WriteMode::kWriteThrough));
    ns_ = Register();
    PutOk(Id(n));
  }
  // Flips a byte of the copy `v` holds (memory gone bad) and reports it, as a reader
  // that found the chunk's CRC32C wrong does.
  absl::Status FlipAByteAndDrop(const ChunkId& id, const ChunkView& v) {
    v.ForEachPiece(0, 1, [](absl::string_view p) { const_cast<char*>(p.data())[0] ^= 0x5a; });
    return store_->DropCorrupt(id, v);
  }

  void WaitFlushed(uint64_t ssd_chunks) {
    const bool flushed = WaitFor([&] {
      const TieredStoreStats s = store_->GetStats();
      return s.writeback_queue_depth == 0 && s.ssd.chunks == ssd_chunks;
    });
    const TieredStoreStats s = store_->GetStats();
    ASSERT_TRUE(flushed) << "dirty " << s.writeback_queue_depth << ", on SSD " << s.ssd.chunks
                         << ", want " << ssd_chunks;
  }
};

TEST_F(TieredStoreWriteBackTest, FlusherWritesToSsd) {
  for (uint64_t i = 0; i < 3; ++i) PutOk(Id(i));
  WaitFlushed(3);
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.ram.dirty_chunks, 0u);
  EXPECT_EQ(s.ssd.used_bytes, 3 * kChunkBytes);
  EXPECT_EQ(s.ram.chunks, 3u) << "written back, still cached in RAM";
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(store_->Locate(Id(i)), Tier::kRam);
    ExpectReadable(Id(i), Tier::kRam);
  }
}

TEST_F(TieredStoreWriteBackTest, EvictsCleanChunksWhenRamIsFull) {
  for (uint64_t i = 0; i < kRamChunks; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks);
  ExpectReadable(Id(0), Tier::kRam);  // 1 is now the coldest.
  PutOk(Id(100));
  PutOk(Id(101));
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.ram.evictions, 2u);
  EXPECT_EQ(s.demotions, 0u) << "clean chunks need no SSD write";
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kRam);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(3)), Tier::kRam);
}

// The SSD's WAL is made slow, so the (one) flusher is still writing chunk 0 when RAM
// fills with dirty chunks. Chunk 0 is then read, so the policy's victim is chunk 1,
// dirty and written by nobody: the next put must demote it (write it to SSD itself) to
// get room. (Had the victim been chunk 0, the put would wait for the flusher's write
// instead: HostPoolTest.ADemotionWaitsForTheVictimBeingFlushed.)
TEST_F(TieredStoreWriteBackTest, DemotesDirtyChunksWhenRamIsFull) {
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  o.flush_threads = 1;
  OpenWith(o);
  ns_ = Register();
  fs_->SetWalWriteDelay(absl::Milliseconds(200));
  PutOk(Id(0));
  ASSERT_TRUE(WaitFor([&] { return fs_->wal_appends_in_flight() > 0; }))
      << "the flusher never started writing";
  for (uint64_t i = 1; i < kRamChunks; ++i) PutOk(Id(i));
  EXPECT_EQ(store_->GetStats().ram.dirty_chunks, kRamChunks) << "RAM is all dirty";
  ASSERT_TRUE(store_->Read(Id(0)).ok());  // LRU order now 1, 2, ..., 0.
  PutOk(Id(kRamChunks));  // Needs a demotion.
  fs_->SetWalWriteDelay(absl::ZeroDuration());
  TieredStoreStats s = store_->GetStats();
  EXPECT_GE(s.demotions, 1u);
  EXPECT_EQ(s.demotion_failures, 0u);
  EXPECT_LE(s.ram.used_bytes, kRamChunks * kChunkBytes);
  WaitFlushed(kRamChunks + 1);
  // Nothing was lost: the demoted chunk is on SSD, the rest in RAM.
  uint64_t on_ssd = 0;
  for (uint64_t i = 0; i <= kRamChunks; ++i) {
    const Tier t = store_->Locate(Id(i));
    EXPECT_NE(t, Tier::kNone) << i;
    on_ssd += t == Tier::kSsd;
  }
  EXPECT_GE(on_ssd, 1u);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd) << "the policy's victim was demoted";
  for (uint64_t i = 0; i <= kRamChunks; ++i) ExpectReadable(Id(i));
}

// A full SSD: write-back keeps chunks dirty in RAM; when RAM must make room anyway the
// demotion fails loudly (counted) and the chunk is dropped rather than blocking puts.
TEST_F(TieredStoreWriteBackTest, DemotionFailureDropsAndCounts) {
  fs_->SetNoSpace(true);
  ops_->SetNoSpace(true);
  for (uint64_t i = 0; i < kRamChunks; ++i) PutOk(Id(i));
  PutOk(Id(kRamChunks));
  TieredStoreStats s = store_->GetStats();
  EXPECT_GE(s.demotion_failures, 1u);
  EXPECT_EQ(s.ssd.chunks, 0u);
  EXPECT_EQ(store_->Locate(Id(kRamChunks)), Tier::kRam);
  uint64_t lost = 0;
  for (uint64_t i = 0; i < kRamChunks; ++i) lost += store_->Locate(Id(i)) == Tier::kNone;
  EXPECT_EQ(lost, s.demotion_failures);
  // Space comes back: the flusher retries and everything left reaches the SSD. (RocksDB
  // lifts its stopped-writes state once it polls free space again, within ~5 s.)
  fs_->SetNoSpace(false);
  ops_->SetNoSpace(false);
  WaitFlushed(kRamChunks + 1 - lost);
  EXPECT_TRUE(store_->Close().ok());
}

// A full disk fails every write-back and demotion; the operator's log gets one line a
// second about it (on the store's clock), saying how many it held back, not a line per
// chunk.
TEST_F(TieredStoreWriteBackTest, AFullDiskLogsALineASecondNotOnePerChunk) {
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  o.now = [this] { return clock_.Now(); };
  OpenWith(o);
  ns_ = Register();
  SetMinLogLevel(LogLevel::kWarning);
  fs_->SetNoSpace(true);
  ops_->SetNoSpace(true);
  const auto failure_lines = [](const std::string& log) {
    int n = 0;
    for (size_t at = log.find("failed"); at != std::string::npos; at = log.find("failed", at + 1)) {
      ++n;
    }
    return n;
  };
  ::testing::internal::CaptureStderr();
  for (uint64_t i = 0; i < kRamChunks + 3; ++i) PutOk(Id(i));
  std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_GE(store_->GetStats().demotion_failures, 3u);
  EXPECT_EQ(failure_lines(log), 1) << log;
  // Capturing first: the flusher's retries fail too, and may take the next line as soon
  // as the clock allows it. The put needs room, so its demotion fails here either way.
  ::testing::internal::CaptureStderr();
  clock_.Advance(absl::Seconds(1));
  PutOk(Id(kRamChunks + 3));
  log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(failure_lines(log), 1) << log;
  EXPECT_NE(log.find("more like it since the last line"), std::string::npos) << log;
  SetMinLogLevel(LogLevel::kError);
  fs_->SetNoSpace(false);
  ops_->SetNoSpace(false);
}

TEST_F(TieredStoreWriteBackTest, PromotesOnSsdHit) {
  for (uint64_t i = 0; i < kRamChunks + 2; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 2);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  EXPECT_EQ(store_->GetStats().promotions, 0u);
  ExpectReadable(Id(0), Tier::kSsd);  // Served from SSD, and promoted.
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kRam);
  EXPECT_EQ(store_->GetStats().promotions, 1u);
  ExpectReadable(Id(0), Tier::kRam);
  EXPECT_EQ(store_->GetStats().promotions, 1u);
  EXPECT_EQ(store_->GetStats().ssd.hits, 1u);
}

TEST_F(TieredStoreWriteBackTest, ReadFromSsdWithoutRoomIsServedUnpromoted) {
  for (uint64_t i = 0; i < kRamChunks + 1; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 1);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  // Every RAM chunk held by a reader: nothing can be evicted for a promotion.
  std::vector<ChunkView> held;
  for (uint64_t i = 1; i <= kRamChunks; ++i) {
    auto v = store_->Read(Id(i));
    ASSERT_TRUE(v.ok());
    ASSERT_EQ(v->tier(), Tier::kRam);
    held.push_back(*std::move(v));
  }
  ExpectReadable(Id(0), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  EXPECT_EQ(store_->GetStats().promotions, 0u);
  // And a put fails cleanly rather than evict a chunk being read.
  EXPECT_EQ(Put(Id(99)).code(), absl::StatusCode::kResourceExhausted);
  held.clear();
  PutOk(Id(99));
}

TEST_F(TieredStoreWriteBackTest, APromotionTheAdmissionRefusesIsServedUnpromoted) {
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  std::vector<std::pair<uint64_t, uint64_t>> asked;  // (namespace, bytes) per call.
  bool admit = false;
  o.admit_promotion = [&](TieredStore& store, uint64_t ns, uint64_t bytes) {
    EXPECT_EQ(&store, store_.get());
    asked.emplace_back(ns, bytes);
    return admit;
  };
  OpenWith(o);
  ns_ = Register();
  for (uint64_t i = 0; i < kRamChunks + 1; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 1);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  EXPECT_TRUE(asked.empty()) << "puts do not ask";
  // Refused: served from SSD, RAM untouched (a Pin, which needs it in RAM, is refused).
  ExpectReadable(Id(0), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  EXPECT_EQ(store_->GetStats().promotions, 0u);
  EXPECT_EQ(store_->Pin(Id(0), absl::ZeroDuration()).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_EQ(asked[0], std::make_pair(ns_, kChunkBytes));
  // Admitted: promoted as usual.
  admit = true;
  ExpectReadable(Id(0), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kRam);
  EXPECT_EQ(store_->GetStats().promotions, 1u);
  EXPECT_EQ(asked.size(), 3u);
}

// Clear counts each chunk once, wherever it was. It once answered the most any one tier
// held: here RAM and SSD hold different halves of the older chunks (RAM kept the ones
// read, SSD the ones not), and a Clear of 1.5 x kRamChunks chunks said kRamChunks.
TEST_F(TieredStoreWriteBackTest, ClearCountsEveryChunkOnceWhereverItWas) {
  TieredStoreOptions o = Options(WriteMode::kWriteThrough);
  o.ssd.capacity_bytes = kRamChunks * kChunkBytes;
  o.ssd.path = dir_.path() + "/db-clear";
  OpenWith(o);
  ns_ = Register();
  for (uint64_t i = 0; i < kRamChunks; ++i) PutOk(Id(i));
  for (uint64_t i = 0; i < kRamChunks / 2; ++i) ExpectReadable(Id(i), Tier::kRam);  // Kept in RAM.
  for (uint64_t i = kRamChunks; i < kRamChunks + kRamChunks / 2; ++i) PutOk(Id(i));
  // RAM: the first half (read) and the new ones; SSD: the second half and the new ones.
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kRam);
  ASSERT_FALSE(store_->Locate(Id(kRamChunks - 1)) == Tier::kNone);
  ASSERT_EQ(store_->GetStats().ram.chunks, kRamChunks);
  ASSERT_EQ(store_->GetStats().ssd.chunks, kRamChunks);
  auto cleared = store_->Clear(ns_);
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, kRamChunks + kRamChunks / 2);
  for (uint64_t i = 0; i < kRamChunks + kRamChunks / 2; ++i) {
    EXPECT_EQ(store_->Locate(Id(i)), Tier::kNone) << i;
  }
}

// A chunk deleted while a read was promoting it from SSD stays deleted: the read is
// served, but not kept in RAM. It once was, clean and on no SSD: the deleted chunk was
// back, and the next Put of its key answered "already present" and stored nothing, so
// that chunk was lost once RAM evicted it.
TEST_F(TieredStoreWriteBackTest, AChunkDeletedWhileItIsPromotedStaysDeleted) {
  for (uint64_t i = 0; i < kRamChunks + 1; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 1);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  bool deleted = false;
  ops_->BeforeNextRead([&] {
    auto d = store_->Delete(Id(0));  // Between the read's meta lookup and its bytes.
    deleted = d.ok() && *d;
  });
  ExpectReadable(Id(0), Tier::kSsd);
  ASSERT_TRUE(deleted);
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().promotions, 0u);
  // A put of the key stores it afresh.
  auto w = store_->BeginPut(Id(0), 256);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_NE(*w, nullptr) << "answered as already present";
}

// With no room in RAM, SSD reads are served from heap buffers, at most
// max_buffered_reads at once: a further reader waits until a buffer is dropped.
TEST_F(TieredStoreWriteBackTest, BufferedSsdReadsAreBounded) {
  auto o = Options(WriteMode::kWriteBack);
  o.max_buffered_reads = 1;
  OpenWith(o);
  ns_ = Register();
  for (uint64_t i = 0; i < kRamChunks + 2; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 2);
  std::vector<ChunkView> held;  // Pin RAM down: no promotion is possible.
  for (uint64_t i = 2; i < kRamChunks + 2; ++i) {
    auto v = store_->Read(Id(i));
    ASSERT_TRUE(v.ok());
    if (v->tier() == Tier::kRam) held.push_back(*std::move(v));
  }
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  ASSERT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  auto first = store_->Read(Id(0));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->tier(), Tier::kSsd);
  std::atomic<bool> second_done{false};
  std::string second_bytes;
  std::thread t([&] {
    auto second = store_->Read(Id(1));
    if (second.ok()) second_bytes = ReadAll(*second);
    second_done = true;
  });
  // The second reader is parked at the gate (not merely slow to start) before we look.
  ASSERT_TRUE(WaitFor([&] { return store_->buffered_read_waiters() == 1; }));
  EXPECT_FALSE(second_done.load()) << "a second buffer was allowed while one was held";
  EXPECT_TRUE(ReadAll(*first) == Payload(Id(0), first->meta().size));
  first = absl::NotFoundError("dropped");  // Releases the buffer and the gate.
  t.join();
  EXPECT_TRUE(second_done.load());
  EXPECT_TRUE(second_bytes == Payload(Id(1), second_bytes.size()));
}

// The store destroyed while reads wait behind its one read thread (parked at the buffer
// gate, the rest queued): the destructor answers every queued read, with the right
// bytes, before the tiers go, and a view it handed out stays readable after the store
// is gone (its buffer shares the gate, not the store). The test lets go of the gate
// just after starting the destructor, which then meets the queue in either order.
TEST_F(TieredStoreWriteBackTest, DestroyedWithReadsQueuedAnswersEveryOne) {
  auto o = Options(WriteMode::kWriteBack);
  o.max_buffered_reads = 1;
  o.read_threads = 1;
  OpenWith(o);
  ns_ = Register();
  constexpr uint64_t kQueued = 4;
  for (uint64_t i = 0; i < kRamChunks + kQueued + 1; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + kQueued + 1);
  std::vector<ChunkView> held;  // Pin RAM down: no promotion is possible.
  for (uint64_t i = kQueued + 1; i < kRamChunks + kQueued + 1; ++i) {
    auto v = store_->Read(Id(i));
    ASSERT_TRUE(v.ok());
    if (v->tier() == Tier::kRam) held.push_back(*std::move(v));
  }
  for (uint64_t i = 0; i <= kQueued; ++i) ASSERT_EQ(store_->Locate(Id(i)), Tier::kSsd) << i;
  auto first = store_->Read(Id(0));  // Holds the one buffer.
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->tier(), Tier::kSsd);

  absl::Mutex mu;
  std::vector<uint64_t> answered;
  std::vector<std::string> wrong;
  std::optional<ChunkView> kept;  // The last one's view, read after the store is gone.
  for (uint64_t i = 1; i <= kQueued; ++i) {
    store_->ReadAsync(Id(i), [&, i](absl::StatusOr<ChunkView> v) {
      absl::MutexLock lock(&mu);
      answered.push_back(i);
      if (!v.ok()) {
        wrong.push_back(absl::StrCat(i, ": ", v.status().ToString()));
      } else if (ReadAll(*v) != Payload(Id(i), v->meta().size)) {
        wrong.push_back(absl::StrCat(i, ": bytes differ"));
      } else if (i == kQueued) {
        kept = *std::move(v);  // Earlier ones let go of the gate for the next.
      }
    });
  }
  ASSERT_TRUE(WaitFor([&] { return store_->buffered_read_waiters() == 1; }));
  std::thread destroyer([&] { store_.reset(); });
  first = absl::NotFoundError("dropped");  // Lets the parked read, and the queue, go on.
  destroyer.join();
  held.clear();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(answered, (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_TRUE(wrong.empty()) << wrong[0];
  ASSERT_TRUE(kept.has_value());
  EXPECT_TRUE(ReadAll(*kept) == Payload(Id(kQueued), kept->meta().size));
  kept.reset();  // Leaves the gate, which outlived the store with it.
}

TEST_F(TieredStoreWriteBackTest, ReadAsyncRunsSsdReadsOffTheCallersThread) {
  PutOk(Id(0));
  WaitFlushed(1);
  ASSERT_TRUE(store_->Delete(Id(0)).ok());  // Gone from both tiers...
  PutOk(Id(0));
  WaitFlushed(1);
  // ...and now only on SSD: evict it from RAM by filling RAM with other chunks.
  for (uint64_t i = 1; i <= kRamChunks; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 1);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  absl::Notification done;
  std::thread::id ran_on;
  std::string bytes;
  store_->ReadAsync(Id(0), [&](absl::StatusOr<ChunkView> v) {
    ran_on = std::this_thread::get_id();
    if (v.ok()) bytes = ReadAll(*v);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_TRUE(bytes == Payload(Id(0), bytes.size()));
  EXPECT_FALSE(bytes.empty());
  // A RAM hit answers inline.
  bool inline_answer = false;
  store_->ReadAsync(Id(0), [&](absl::StatusOr<ChunkView> v) {
    inline_answer = v.ok() && v->tier() == Tier::kRam;
  });
  EXPECT_TRUE(inline_answer);
}

// A put that finds RAM full of puts in flight waits for one to end (up to put_wait)
// instead of failing at once, without holding the caller's thread.
TEST_F(TieredStoreWriteBackTest, PutWaitsForRoomInsteadOfFailing) {
  auto in_flight = OpenFullOfPutsInFlight(Options(WriteMode::kWriteBack));
  absl::Notification admitted;
  absl::StatusOr<std::unique_ptr<ChunkWriter>> waited;
  const uint64_t ticket =
      store_->BeginPutAsync(Id(100), 256, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
        waited = std::move(w);
        admitted.Notify();
      });
  EXPECT_NE(ticket, 0u) << "no room: the put must wait";
  EXPECT_FALSE(admitted.HasBeenNotified());
  EXPECT_EQ(store_->GetStats().puts_waiting, 1u);
  EXPECT_EQ(store_->GetStats().puts_queued, 1u);
  in_flight.pop_back();  // An abandoned put gives its room back.
  admitted.WaitForNotification();
  ASSERT_TRUE(waited.ok()) << waited.status();
  ASSERT_NE(*waited, nullptr);
  EXPECT_EQ(store_->GetStats().puts_waiting, 0u);
  EXPECT_EQ(store_->GetStats().put_wait_timeouts, 0u);
}

// A waiting put given up (its stream ended) leaves the queue at once; the room it would
// have had goes to the next put.
TEST_F(TieredStoreWriteBackTest, CancelledPutLeavesTheQueue) {
  auto in_flight = OpenFullOfPutsInFlight(Options(WriteMode::kWriteBack));
  absl::Status first;
  const uint64_t ticket = store_->BeginPutAsync(
      Id(100), 256, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) { first = w.status(); });
  ASSERT_NE(ticket, 0u);
  absl::Notification second_admitted;
  store_->BeginPutAsync(Id(101), 256, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
    EXPECT_TRUE(w.ok()) << w.status();
    second_admitted.Notify();
  });
  EXPECT_TRUE(store_->CancelPut(ticket));
  EXPECT_EQ(first.code(), absl::StatusCode::kCancelled) << first;
  EXPECT_FALSE(store_->CancelPut(ticket));
  in_flight.pop_back();
  second_admitted.WaitForNotification();
  EXPECT_EQ(store_->GetStats().puts_waiting, 0u);
}

// put_wait runs on the injected clock: once it has passed, a put still without room is
// refused RESOURCE_EXHAUSTED, and the message says what to do.
TEST_F(TieredStoreWriteBackTest, PutWaitEndsResourceExhausted) {
  auto o = Options(WriteMode::kWriteBack);
  o.now = [this] { return clock_.Now(); };
  auto in_flight = OpenFullOfPutsInFlight(o);
  absl::Notification answered;
  absl::Status status;
  store_->BeginPutAsync(Id(100), 256, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
    status = w.status();
    answered.Notify();
  });
  clock_.Advance(absl::Seconds(10));
  answered.WaitForNotification();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("put_wait"), absl::string_view::npos) << status;
  EXPECT_EQ(store_->GetStats().put_wait_timeouts, 1u);
}

// Write-back runs flush_threads writers: with the device stalled, more than one chunk's
// bytes are on their way to it at once (one writer would have at most one chunk's), and
// everything lands once the device moves again.
TEST_F(TieredStoreWriteBackTest, FlushersWriteSeveralChunksAtOnce) {
  auto o = Options(WriteMode::kWriteBack);
  o.flush_threads = 4;
  OpenWith(o);
  ns_ = Register();
  ops_->HoldWrites();
  for (uint64_t i = 0; i < 4; ++i) PutOk(Id(i));
  const bool concurrent = ops_->WaitForHeldBytes(2 * kChunkBytes);
  ops_->ReleaseWrites();
  EXPECT_TRUE(concurrent) << "never more than one chunk on its way to the device";
  WaitFlushed(4);
  for (uint64_t i = 0; i < 4; ++i) ExpectReadable(Id(i));
}

// The write-back backlog is bounded: with the device held, two chunks fill
// max_dirty_bytes and a third put waits for room though RAM has plenty; it is let in
// once the device moves and the backlog drains. A chunk larger than the bound still
// gets in once nothing else is dirty (it must not wait forever for a retryable answer).
TEST_F(TieredStoreWriteBackTest, BacklogIsBoundedByMaxDirtyBytes) {
  auto o = Options(WriteMode::kWriteBack);
  o.max_dirty_bytes = 2 * kChunkBytes;
  o.put_wait = absl::Seconds(60);  // The test ends it, not the clock.
  OpenWith(o);
  ns_ = Register();
  ops_->HoldWrites();
  PutOk(Id(0));
  PutOk(Id(1));
  EXPECT_EQ(store_->GetStats().writeback_dirty_bytes, 2 * kChunkBytes);
  absl::Notification admitted;
  absl::StatusOr<std::unique_ptr<ChunkWriter>> third;
  store_->BeginPutAsync(Id(2), 256, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
    third = std::move(w);
    admitted.Notify();
  });
  // Refused inline, then again by the admission thread (which may itself be held in a
  // write of the oldest dirty chunk): nothing can make room while the device is held.
  ASSERT_TRUE(WaitFor([&] { return store_->GetStats().writeback_backlog_waits >= 1; }));
  EXPECT_FALSE(admitted.HasBeenNotified()) << "admitted past max_dirty_bytes";
  const TieredStoreStats held = store_->GetStats();
  EXPECT_EQ(held.writeback_dirty_bytes, 2 * kChunkBytes);
  EXPECT_EQ(held.writeback_max_dirty_bytes, 2 * kChunkBytes);
  EXPECT_EQ(held.puts_waiting, 1u);
  EXPECT_LT(held.ram.chunk_bytes, options_.ram.arena.capacity_bytes / 2) << "RAM had room";
  ops_->ReleaseWrites();
  admitted.WaitForNotification();
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_NE(*third, nullptr);
  third->reset();  // Abandoned: gives its slots back.
  WaitFlushed(2);

  // Larger than the bound: admitted alone.
  o.max_dirty_bytes = kChunkBytes / 2;
  OpenWith(o);
  ns_ = Register();
  PutOk(Id(10));
  WaitFlushed(3);
  ExpectReadable(Id(10));
}

// Puts admitted but not yet committed count in the backlog too: with the bound at two
// chunks and two puts still being received (nothing dirty in RAM yet), a third waits.
// An abandoned put gives its bytes back, and a committed one counts as dirty instead.
TEST_F(TieredStoreWriteBackTest, PutsInProgressCountAgainstMaxDirtyBytes) {
  auto o = Options(WriteMode::kWriteBack);
  o.max_dirty_bytes = 2 * kChunkBytes;
  o.put_wait = absl::Seconds(60);
  o.now = [this] { return clock_.Now(); };
  OpenWith(o);
  ns_ = Register();
  auto first = store_->BeginPut(Id(0), 256);
  auto second = store_->BeginPut(Id(1), 256);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(store_->GetStats().writeback_dirty_bytes, 0u) << "nothing committed yet";
  absl::Notification answered;
  absl::StatusOr<std::unique_ptr<ChunkWriter>> third;
  const uint64_t ticket =
      store_->BeginPutAsync(Id(2), 256, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
        third = std::move(w);
        answered.Notify();
      });
  EXPECT_NE(ticket, 0u) << "admitted past max_dirty_bytes: two puts in progress fill it";
  EXPECT_FALSE(answered.HasBeenNotified());
  EXPECT_EQ(store_->GetStats().writeback_backlog_waits, 1u);
  // Dropping a put in progress makes room for the one waiting.
  first->reset();
  answered.WaitForNotification();
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_NE(*third, nullptr);
  // Committed, the second counts as dirty, and still fills the bound with the third.
  ops_->HoldWrites();
  const std::string data = Payload(Id(1), kChunkBytes);
  ASSERT_TRUE((*second)->Append(data).ok());
  ASSERT_TRUE(store_->CommitPut(*std::move(second), crc32c::Value(data)).ok());
  absl::Notification fourth_answered;
  absl::StatusOr<std::unique_ptr<ChunkWriter>> fourth;
  EXPECT_NE(store_->BeginPutAsync(Id(3), 256,
                                  [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
                                    fourth = std::move(w);
                                    fourth_answered.Notify();
                                  }),
            0u);
  ops_->ReleaseWrites();  // The flushers write Id(1): room for the fourth.
  fourth_answered.WaitForNotification();
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  third->reset();
  fourth->reset();
  WaitFlushed(1);
}

// kvtier_writeback_backlog_waits_total counts puts that waited, not the admission
// thread's retries: a put that waits out put_wait behind a backlog that cannot drain
// (the disk is full) counts once, though it was tried at least twice (inline, then by
// the admission thread, whose failed retry after the deadline answers it).
TEST_F(TieredStoreWriteBackTest, APutThatWaitsForTheBacklogCountsOnce) {
  auto o = Options(WriteMode::kWriteBack);
  o.max_dirty_bytes = kChunkBytes;
  o.put_wait = absl::Seconds(1);
  o.now = [this] { return clock_.Now(); };
  OpenWith(o);
  ns_ = Register();
  ops_->SetNoSpace(true);
  PutOk(Id(0));  // Dirty, and it stays dirty: its write-backs fail.
  absl::Notification answered;
  absl::StatusOr<std::unique_ptr<ChunkWriter>> second;
  ASSERT_NE(store_->BeginPutAsync(Id(1), 256,
                                  [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
                                    second = std::move(w);
                                    answered.Notify();
                                  }),
            0u);
  clock_.Advance(absl::Seconds(2));
  answered.WaitForNotification();
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.put_wait_timeouts, 1u);
  EXPECT_EQ(s.writeback_backlog_waits, 1u);
  ops_->SetNoSpace(false);
}

TEST_F(TieredStoreWriteBackTest, PinPromotesFromSsdAndHolds) {
  for (uint64_t i = 0; i < kRamChunks + 1; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 1);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  ASSERT_TRUE(store_->Pin(Id(0), absl::ZeroDuration()).ok());
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kRam);
  EXPECT_EQ(store_->GetStats().promotions, 1u);
  EXPECT_EQ(store_->GetStats().ram.pinned_bytes, kChunkBytes);
  // Pressure does not move it.
  for (uint64_t i = 100; i < 100 + 2 * kRamChunks; ++i) PutOk(Id(i));
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kRam);
  EXPECT_TRUE(store_->Unpin(Id(0)));
  for (uint64_t i = 200; i < 200 + kRamChunks; ++i) PutOk(Id(i));
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kSsd);
}

// A chunk that could not be pinned even alone (its slots exceed max_pinned_fraction of
// the pool) is refused as final, and before it is promoted: promoting it would evict
// another chunk from RAM for nothing.
TEST_F(TieredStoreWriteBackTest, APinThatCanNeverFitIsRefusedBeforeItPromotes) {
  auto o = Options(WriteMode::kWriteBack);
  o.ram.max_pinned_fraction = 0.5 / kRamChunks;  // Half a chunk's slots.
  OpenWith(o);
  ns_ = Register();
  for (uint64_t i = 0; i < kRamChunks + 1; ++i) PutOk(Id(i));
  WaitFlushed(kRamChunks + 1);
  ASSERT_EQ(store_->Locate(Id(0)), Tier::kSsd);
  const absl::Status pin = store_->Pin(Id(0), absl::ZeroDuration());
  EXPECT_EQ(pin.code(), absl::StatusCode::kInvalidArgument) << pin;
  EXPECT_NE(pin.message().find("even with nothing else pinned"), std::string::npos) << pin;
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kSsd) << "promoted for a pin that was refused";
  EXPECT_EQ(store_->GetStats().promotions, 0u);
  EXPECT_EQ(store_->GetStats().ram.evictions, 1u) << "only the put of chunk 8 evicted";
  // The same holds for a chunk in RAM already: the pool refuses it as final too.
  const absl::Status in_ram = store_->Pin(Id(kRamChunks), absl::ZeroDuration());
  EXPECT_EQ(in_ram.code(), absl::StatusCode::kInvalidArgument) << in_ram;
}

TEST_F(TieredStoreWriteBackTest, PinTtlRunsOnTheInjectedClock) {
  PutOk(Id(0));
  ASSERT_TRUE(store_->Pin(Id(0), absl::Seconds(10)).ok());
  for (uint64_t i = 1; i <= 2 * kRamChunks; ++i) PutOk(Id(i));
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kRam) << "pinned";
  clock_.Advance(absl::Seconds(11));
  EXPECT_EQ(store_->GetStats().ram.pinned_bytes, 0u) << "the pin has expired";
  WaitFlushed(2 * kRamChunks + 1);
  for (uint64_t i = 100; i < 100 + kRamChunks; ++i) PutOk(Id(i));
  EXPECT_EQ(store_->Locate(Id(0)), Tier::kSsd) << "evicted once the pin expired";
}

TEST_F(TieredStoreWriteBackTest, DeleteAfterWriteBackDoesNotResurrect) {
  PutOk(Id(1));
  PutOk(Id(2));
  WaitFlushed(2);
  auto d = store_->Delete(Id(1));
  ASSERT_TRUE(d.ok() && *d);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().ssd.chunks, 1u);
  Reopen();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  ExpectReadable(Id(2), Tier::kSsd);
}

// The flusher is held inside its SSD write of chunk 1 (slow WAL) while the chunk is
// deleted: when the write lands it must be undone, not left to come back.
TEST_F(TieredStoreWriteBackTest, DeleteDuringWriteBackDoesNotResurrect) {
  PutOk(Id(2));
  WaitFlushed(1);
  fs_->SetWalWriteDelay(absl::Milliseconds(100));
  PutOk(Id(1));
  ASSERT_TRUE(WaitFor([&] { return fs_->wal_appends_in_flight() > 0; }))
      << "the flusher never started writing";
  auto d = store_->Delete(Id(1));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(*d);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  fs_->SetWalWriteDelay(absl::ZeroDuration());
  ASSERT_TRUE(store_->Close().ok());  // Joins the flusher: its clean-up is done.
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().ssd.chunks, 1u);
  OpenWith(options_);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  ExpectReadable(Id(2));
}

// A Delete of a chunk whose write-back is in flight waits for that write and then
// deletes what it wrote. It once returned before the write landed: the SSD then held
// the deleted chunk until the flusher removed it, and a put of the key in that window
// was answered "already stored" from the copy about to go, so it was lost.
TEST_F(TieredStoreWriteBackTest, ADeleteWaitsForTheWriteBackInFlight) {
  std::atomic<bool> delete_returned{false};
  absl::Notification delete_waits_or_returned;
  std::atomic<bool> landed_after_the_delete_returned{false};
  TieredStoreOptions o = Options(WriteMode::kWriteBack);
  // Both on the deleting thread, one after the other.
  const auto notify = [&] {
    if (!delete_waits_or_returned.HasBeenNotified()) delete_waits_or_returned.Notify();
  };
  o.ram.before_fence_wait = [&](const ChunkId&) { notify(); };
  absl::Notification landed;
  o.after_write_back = [&](const ChunkId& id) {
    if (id != Id(1) || landed.HasBeenNotified()) return;
    landed_after_the_delete_returned = delete_returned.load();
    landed.Notify();
  };
  OpenWith(o);
  ns_ = Register();
  std::thread deleter;
  bool deleted = false;
  ops_->BeforeNextWrite([&] {  // Id(1)'s write-back is in flight.
    deleter = std::thread([&] {
      auto d = store_->Delete(Id(1));
      deleted = d.ok() && *d;
      delete_returned.store(true);
      notify();
    });
    delete_waits_or_returned.WaitForNotification();
  });
  PutOk(Id(1));
  ASSERT_TRUE(WaitFor([&] { return deleter.joinable(); }));
  deleter.join();
  EXPECT_TRUE(deleted);
  landed.WaitForNotification();
  EXPECT_FALSE(landed_after_the_delete_returned.load());
  Settle();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().ssd.chunks, 0u);
  // A put of the key stores it afresh, and it stays.
  PutOk(Id(1));
  WaitFlushed(1);
  ExpectReadable(Id(1));
}

TEST_F(TieredStoreWriteBackTest, ClearDuringWriteBackDoesNotResurrect) {
  fs_->SetWalWriteDelay(absl::Milliseconds(100));
  PutOk(Id(1));
  ASSERT_TRUE(WaitFor([&] { return fs_->wal_appends_in_flight() > 0; }));
  PutOk(Id(2));  // Dirty, queued behind 1.
  auto n = store_->Clear(ns_);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 2u);
  fs_->SetWalWriteDelay(absl::ZeroDuration());
  ASSERT_TRUE(store_->Close().ok());
  EXPECT_EQ(store_->GetStats().ssd.chunks, 0u);
  OpenWith(options_);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().ssd.chunks, 0u);
}

TEST_F(TieredStoreWriteBackTest, ReopenAfterCloseRecoversChunksAndLayouts) {
  const uint64_t ns_a = ns_;
  const uint64_t ns_b = Register(SmallLayout("test/second-model"));
  for (uint64_t i = 0; i < 5; ++i) PutOk(Id(i));  // Maybe still dirty at Close.
  ns_ = ns_b;
  PutOk(Id(0));
  ASSERT_TRUE(store_->Close().ok());
  EXPECT_TRUE(store_->Close().ok()) << "Close is idempotent";
  EXPECT_EQ(store_->GetStats().writeback_queue_depth, 0u) << "Close flushed everything";

  OpenWith(options_);
  EXPECT_EQ(store_->GetStats().namespaces, 2u);
  auto layout = store_->FindLayout(ns_b);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(*layout, SmallLayout("test/second-model"));
  auto again = store_->RegisterLayout(SmallLayout());
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_registered);
  EXPECT_EQ(store_->GetStats().ssd.chunks, 6u);
  ns_ = ns_a;
  for (uint64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(store_->Locate(Id(i)), Tier::kSsd) << i;
    ExpectReadable(Id(i), Tier::kSsd);
  }
  ns_ = ns_b;
  ExpectReadable(Id(0));
  // Puts of recovered chunks are recognised as present.
  auto w = store_->BeginPut(Id(0), 256);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(*w, nullptr);
}

// A RAM copy that no longer matches its checksum when the flusher writes it back (memory
// corruption, here a flipped byte) is dropped: the SSD refuses bytes its CRC32C does not
// vouch for, and a write-back that failed that way would fail again on every retry.
TEST_F(TieredStoreWriteBackTest, ARamCopyThatChangedIsDroppedNotWrittenBack) {
  auto o = Options(WriteMode::kWriteBack);
  o.flush_threads = 1;
  OpenWith(o);
  ns_ = Register();
  ops_->HoldWrites();
  PutOk(Id(0));
  // The one flusher is writing chunk 0 (held in the device), so chunk 1 waits in RAM.
  ASSERT_TRUE(ops_->WaitForHeldBytes(kChunkBytes));
  PutOk(Id(1));
  {
    auto v = store_->Read(Id(1));
    ASSERT_TRUE(v.ok()) << v.status();
    v->ForEachPiece(0, 1, [](absl::string_view p) { const_cast<char*>(p.data())[0] ^= 0x5a; });
  }
  ops_->ReleaseWrites();
  Settle();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone) << "written back, or kept, with wrong bytes";
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.checksum_failures, 1u);
  EXPECT_EQ(s.ssd.chunks, 1u);
  EXPECT_EQ(s.writeback_dirty_bytes, 0u);
  ExpectReadable(Id(0));
  Reopen();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
  ExpectReadable(Id(0), Tier::kSsd);
}

TEST_F(TieredStoreWriteBackTest, CorruptSsdChunkIsDataLossNeverServed) {
  PutOk(Id(1));
  PutOk(Id(2));
  Reopen();  // RAM starts empty; Close flushed the chunks to SSD.
  ops_->SetCorruptReads(true);
  auto v = store_->Read(Id(1));
  ops_->SetCorruptReads(false);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone) << "deleted";
  EXPECT_EQ(store_->GetStats().checksum_failures, 1u);
  EXPECT_EQ(store_->GetStats().promotions, 0u);
  ExpectReadable(Id(2), Tier::kSsd);
  // The client recomputes and puts it again.
  PutOk(Id(1));
  ExpectReadable(Id(1), Tier::kRam);
}

// A corrupt SSD copy is one event however it was found. Found by a promotion's read, the
// chunk is gone from every tier: DELETED. Dropped by a streamed read (DropCorrupt, which
// several frames of one Get may call): one event, not one per call. Dropped while RAM
// still holds a copy: it only left the SSD, EVICTED there.
TEST_F(TieredStoreWriteBackTest, ACorruptSsdCopyIsOneEventOnEveryPath) {
  EventLog events(1000);
  auto o = Options(WriteMode::kWriteBack);
  o.events = &events;
  OpenWith(o);
  ns_ = Register();
  for (uint64_t i = 1; i <= 3; ++i) PutOk(Id(i));
  Reopen();  // RAM starts empty; Close flushed the chunks to SSD.
  ExpectReadable(Id(3), Tier::kSsd);  // Promoted: in RAM and on SSD now.
  ASSERT_EQ(store_->Locate(Id(3)), Tier::kRam);
  const uint64_t start = events.last_sequence();
  ops_->SetCorruptReads(true);
  EXPECT_EQ(store_->Read(Id(1)).status().code(), absl::StatusCode::kDataLoss);
  ops_->SetCorruptReads(false);
  auto meta = [](const ChunkId& id) {
    const std::string bytes = Payload(id, kChunkBytes);
    return ChunkMeta{bytes.size(), crc32c::Value(bytes), 256, 0};
  };
  EXPECT_EQ(store_->DropCorrupt(Id(2), meta(Id(2))).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(store_->DropCorrupt(Id(2), meta(Id(2))).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(store_->DropCorrupt(Id(3), meta(Id(3))).code(), absl::StatusCode::kDataLoss);
  std::vector<std::tuple<ChunkEventKind, ChunkId, Tier>> got;
  for (const ChunkEvent& e : events.Read(start, 0, 100).events) {
    got.emplace_back(e.kind, e.id, e.tier);
  }
  EXPECT_EQ(got, (std::vector<std::tuple<ChunkEventKind, ChunkId, Tier>>{
                     {ChunkEventKind::kDeleted, Id(1), Tier::kNone},
                     {ChunkEventKind::kDeleted, Id(2), Tier::kNone},
                     {ChunkEventKind::kEvicted, Id(3), Tier::kSsd}}));
  EXPECT_EQ(store_->GetStats().checksum_failures, 3u);
  ExpectReadable(Id(3), Tier::kRam);
  store_.reset();  // Before `events`, which it appends to.
}

// A reader that copied a RAM chunk whole (a Get into a client's region, a Prefill into
// its target) and found its CRC32C wrong drops the RAM copy it read. It once dropped the
// SSD copy instead: the good copy went, and the bad one stayed to be served again.
TEST_F(TieredStoreWriteBackTest, ACorruptRamCopyAReaderFoundGoesAndTheSsdCopyStays) {
  ASSERT_NO_FATAL_FAILURE(WriteThroughHolding(1));
  {
    auto v = store_->Read(Id(1));
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->tier(), Tier::kRam);
    const absl::Status s = FlipAByteAndDrop(Id(1), *v);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("RAM copy"), std::string::npos) << s;
  }
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  ExpectReadable(Id(1), Tier::kSsd);
}

// The same for a view of a chunk promoted from SSD by the read that gave it: it names
// the SSD tier (where its bytes came from), but holds the RAM copy made of them. The
// SSD copy was once dropped for it, and the RAM copy that failed stayed to be served.
TEST_F(TieredStoreWriteBackTest, ACorruptPromotedCopyGoesFromRamAndTheSsdCopyStays) {
  ASSERT_NO_FATAL_FAILURE(WriteThroughHolding(1));
  Reopen();  // RAM starts empty: the next read promotes the chunk.
  {
    auto v = store_->Read(Id(1));
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->tier(), Tier::kSsd);
    ASSERT_EQ(store_->Locate(Id(1)), Tier::kRam);
    const absl::Status s = FlipAByteAndDrop(Id(1), *v);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("RAM copy"), std::string::npos) << s;
  }
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  const TieredStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.ram_checksum_failures, 1u);
  EXPECT_EQ(stats.checksum_failures, 1u);  // That one: none of the SSD tier's.
  ExpectReadable(Id(1), Tier::kSsd);
}

// A reader whose copy failed its CRC32C after the chunk left RAM (deleted here; or
// replaced by a newer put, or a promotion's buffer never inserted) found no stored copy
// bad: Aborted (read it again), and nothing is counted or dropped. It once answered
// DATA_LOSS, which tells the client a stored chunk is gone and to recompute it.
TEST_F(TieredStoreWriteBackTest, ACorruptCopyNoLongerStoredIsAbortedNotDataLoss) {
  ASSERT_NO_FATAL_FAILURE(WriteThroughHolding(1));
  auto v = store_->Read(Id(1));
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->tier(), Tier::kRam);
  auto deleted = store_->Delete(Id(1));
  ASSERT_TRUE(deleted.ok() && *deleted);
  const absl::Status s = FlipAByteAndDrop(Id(1), *v);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(store_->GetStats().ram_checksum_failures, 0u);
}

// ---------------------------------------------------------------------------------
// Write-through and RAM-only.

class TieredStoreWriteThroughTest : public TieredStoreTestBase {
 protected:
  void SetUp() override {
    TieredStoreTestBase::SetUp();
    Open(WriteMode::kWriteThrough);
    ns_ = Register();
  }
};

TEST_F(TieredStoreWriteThroughTest, OnSsdWhenAcknowledged) {
  PutOk(Id(1));
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.ssd.chunks, 1u);
  EXPECT_EQ(s.ram.dirty_chunks, 0u);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  // RAM pressure evicts without demoting.
  for (uint64_t i = 2; i < 2 + kRamChunks; ++i) PutOk(Id(i));
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kSsd);
  EXPECT_EQ(store_->GetStats().demotions, 0u);
  EXPECT_EQ(store_->GetStats().ram.evictions, 1u);
  ExpectReadable(Id(1), Tier::kSsd);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kRam);
  EXPECT_EQ(store_->GetStats().promotions, 1u);
}

// CommitPutAsync runs a write-through commit (its SSD write) on the commit threads, not
// the caller's; the chunk is on SSD when `done` runs.
TEST_F(TieredStoreWriteThroughTest, AsyncCommitRunsOffTheCallersThread) {
  auto w = store_->BeginPut(Id(1), 256);
  ASSERT_TRUE(w.ok() && *w != nullptr);
  const std::string data = Payload(Id(1), (*w)->size());
  ASSERT_TRUE((*w)->Append(data).ok());
  absl::Notification committed;
  absl::Status status;
  std::thread::id thread;
  store_->CommitPutAsync(*std::move(w), crc32c::Value(data), [&](absl::StatusOr<bool> s) {
    status = s.status();
    EXPECT_TRUE(!s.ok() || *s) << "the only put of this chunk stored it";
    thread = std::this_thread::get_id();
    committed.Notify();
  });
  committed.WaitForNotification();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_NE(thread, std::this_thread::get_id());
  EXPECT_EQ(store_->GetStats().ssd.chunks, 1u);
  ExpectReadable(Id(1));
}

TEST_F(TieredStoreWriteThroughTest, SsdFullFailsThePutAndStoresNothing) {
  PutOk(Id(1));
  fs_->SetNoSpace(true);
  const absl::Status s = Put(Id(2));
  fs_->SetNoSpace(false);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(store_->Locate(Id(2)), Tier::kNone);
  EXPECT_EQ(store_->GetStats().ram.chunks, 1u);
  EXPECT_EQ(store_->GetStats().ram.used_bytes, kChunkBytes) << "its RAM was given back";
  ExpectReadable(Id(1));
}

class TieredStoreRamOnlyTest : public TieredStoreTestBase {
 protected:
  void SetUp() override {
    TieredStoreTestBase::SetUp();
    Open(WriteMode::kRamOnly);
    ns_ = Register();
  }
};

TEST_F(TieredStoreRamOnlyTest, EvictionDrops) {
  for (uint64_t i = 0; i < kRamChunks + 3; ++i) PutOk(Id(i));
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(store_->Locate(Id(i)), Tier::kNone) << i;
    EXPECT_EQ(store_->Read(Id(i)).status().code(), absl::StatusCode::kNotFound);
  }
  for (uint64_t i = 3; i < kRamChunks + 3; ++i) ExpectReadable(Id(i), Tier::kRam);
  const TieredStoreStats s = store_->GetStats();
  EXPECT_EQ(s.ram.evictions, 3u);
  EXPECT_EQ(s.ram.dirty_chunks, 0u);
  EXPECT_EQ(s.ssd.chunks, 0u);
  EXPECT_EQ(s.demotions, 0u);
  EXPECT_FALSE(std::filesystem::exists(options_.ssd.path)) << "no SSD tier was opened";
  EXPECT_TRUE(store_->Close().ok());
}

TEST_F(TieredStoreRamOnlyTest, NothingSurvivesARestart) {
  PutOk(Id(1));
  Reopen();
  EXPECT_EQ(store_->GetStats().namespaces, 0u);
  EXPECT_EQ(store_->Locate(Id(1)), Tier::kNone);
}

}  // namespace
}  // namespace kvtier
