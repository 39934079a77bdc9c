// Integration tests: a real kvtierd on port 0 with a temp data dir, driven through the
// C++ client (and the raw stub where a test must send what the client never would).
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "client/layout_convert.h"
#include "health.grpc.pb.h"
#include "storage/chunk_key.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;

class DaemonTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> args = {}) {
    if (data_dir_.empty()) data_dir_ = MakeTempDir("kvtierd");
    auto d = DaemonProcess::Start(data_dir_, std::move(args));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    auto c = KvTierClient::Connect(daemon_->target());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  void StopDaemon() {
    client_.reset();
    auto code = daemon_->Terminate();
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << daemon_->ReadLog();
    daemon_.reset();
  }

  uint64_t Register(uint32_t chunk_mib) {
    auto r = client_->RegisterLayout(LayoutOfMiB(chunk_mib));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->namespace_id : 0;
  }

  absl::Status PutOne(uint64_t ns, uint64_t i, size_t bytes) {
    const std::string data = PatternBytes(i, bytes);
    ChunkToPut c{KeyOf(i), data, 256};
    auto r = client_->Put(ns, {&c, 1});
    return r.status();
  }

  uint64_t RamUsedBytes() { return RamStats().used_bytes(); }
  v1::TierStats RamStats() {
    auto s = client_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    for (const auto& t : s->tiers()) {
      if (t.tier() == v1::TIER_RAM) return t;
    }
    return {};
  }

  std::string data_dir_;
  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
};

TEST_F(DaemonTest, PutsAndGets32MiBChunksByteIdentical) {
  StartDaemon({"--ram-capacity=256MiB"});
  const uint64_t ns = Register(32);
  const std::string a = PatternBytes(1, 32 << 20), b = PatternBytes(2, 32 << 20);
  std::vector<ChunkToPut> chunks = {{KeyOf(1), a, 256}, {KeyOf(2), b, 256}};
  auto put = client_->Put(ns, chunks);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 2u);

  std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(2), KeyOf(3)};
  auto lookup = client_->Lookup(ns, keys);
  ASSERT_TRUE(lookup.ok()) << lookup.status();
  EXPECT_EQ(lookup->prefix_hits, 2u);
  EXPECT_EQ(lookup->tiers[0], v1::TIER_RAM);
  EXPECT_EQ(lookup->tiers[2], v1::TIER_UNSPECIFIED);

  auto got = client_->Get(ns, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 3u);
  EXPECT_TRUE((*got)[0].found);
  EXPECT_TRUE((*got)[0].data == a);
  EXPECT_TRUE((*got)[1].data == b);
  EXPECT_TRUE((*got)[0].crc_verified);
  EXPECT_FALSE((*got)[2].found);

  // A layer range returns exactly those layers' bytes (1 MiB per layer here).
  std::vector<ChunkKey> one = {KeyOf(2)};
  auto layers = client_->Get(ns, one, LayerRange{3, 7});
  ASSERT_TRUE(layers.ok()) << layers.status();
  EXPECT_TRUE((*layers)[0].data == b.substr(3 << 20, 4 << 20));

  // Idempotent put.
  auto again = client_->Put(ns, chunks);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->stored, 0u);
  EXPECT_EQ(again->already_present, 2u);
}

TEST(ClientOptionsTest, ReceiveWindowIsValidated) {
  ClientOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.receive_window_bytes = 0;  // gRPC's BDP-probed default.
  EXPECT_TRUE(o.Validate().ok());
  for (int bad : {1, (64 << 10) - 1, 1 << 30, -5}) {
    o.receive_window_bytes = bad;
    const absl::Status s = o.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("receive_window_bytes"), std::string::npos) << s;
    EXPECT_FALSE(KvTierClient::Connect("127.0.0.1:1", o).ok());
  }
}

TEST(ClientOptionsTest, Http2MaxFrameIsValidated) {
  ClientOptions o;
  EXPECT_EQ(o.http2_max_frame_bytes, 1 << 20);
  for (int good : {0, 16 << 10, (16 << 20) - 1}) {
    o.http2_max_frame_bytes = good;
    EXPECT_TRUE(o.Validate().ok()) << good;
  }
  for (int bad : {1, (16 << 10) - 1, 16 << 20, -1}) {
    o.http2_max_frame_bytes = bad;
    const absl::Status s = o.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("http2_max_frame_bytes"), std::string::npos) << s;
    EXPECT_FALSE(KvTierClient::Connect("127.0.0.1:1", o).ok());
  }
}

// HTTP/2 frames of every size either end allows, from HTTP/2's smallest to its largest:
// multi-frame chunks move intact both ways. A frame is also bounded by the receiver's
// window, so the large-frame cases keep the default (8 MiB) window, and one case pairs
// the largest frame with the smallest window.
TEST_F(DaemonTest, Http2FrameSizesMoveChunksIntact) {
  const std::string a = PatternBytes(22, 8 << 20);
  uint64_t next_key = 1000;  // Fresh keys for each daemon (the second recovers the first's).
  for (const char* daemon_frame : {"16KiB", "16777215"}) {
    SCOPED_TRACE(daemon_frame);
    StartDaemon({"--ram-capacity=256MiB", absl::StrCat("--http2-max-frame=", daemon_frame)});
    const uint64_t ns = Register(8);
    struct Case {
      int frame;
      int window;
    };
    for (Case k : {Case{0, 8 << 20}, Case{16 << 10, 8 << 20}, Case{1 << 20, 8 << 20},
                   Case{(16 << 20) - 1, 8 << 20}, Case{(16 << 20) - 1, 64 << 10}}) {
      const int frame = k.frame;
      ClientOptions o;
      o.http2_max_frame_bytes = frame;
      o.receive_window_bytes = k.window;
      auto client = KvTierClient::Connect(daemon_->target(), o);
      ASSERT_TRUE(client.ok()) << client.status();
      const ChunkKey key = KeyOf(next_key++);
      ChunkToPut c{key, a, 256};
      auto put = (*client)->Put(ns, {&c, 1});
      ASSERT_TRUE(put.ok()) << put.status() << " frame " << frame;
      EXPECT_EQ(put->stored, 1u) << "frame " << frame;
      auto got = (*client)->Get(ns, std::vector<ChunkKey>{key});
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE((*got)[0].found);
      EXPECT_TRUE((*got)[0].data == a) << "frame " << frame;
    }
    StopDaemon();
  }
}

// Every receive window a client may choose moves a multi-frame chunk intact, both ways,
// with several streams of one connection in flight at once.
TEST_F(DaemonTest, ClientReceiveWindowsMoveChunksIntact) {
  StartDaemon({"--ram-capacity=256MiB"});
  const uint64_t ns = Register(8);
  const std::string a = PatternBytes(21, 8 << 20);
  ChunkToPut c{KeyOf(21), a, 256};
  ASSERT_TRUE(client_->Put(ns, {&c, 1}).ok());
  for (int window : {0, 64 << 10, 8 << 20}) {
    ClientOptions o;
    o.receive_window_bytes = window;
    auto client = KvTierClient::Connect(daemon_->target(), o);
    ASSERT_TRUE(client.ok()) << client.status();
    std::vector<std::thread> readers;
    std::atomic<int> intact{0};
    for (int t = 0; t < 3; ++t) {
      readers.emplace_back([&] {
        std::vector<ChunkKey> keys = {KeyOf(21)};
        auto got = (*client)->Get(ns, keys);
        if (got.ok() && (*got)[0].found && (*got)[0].data == a) intact++;
      });
    }
    for (auto& r : readers) r.join();
    EXPECT_EQ(intact.load(), 3) << "window " << window;
  }
}

// A pool full of pinned chunks leaves no room to promote: SSD chunks are then streamed
// a frame at a time (ssd_stream_buffer). One Get mixes RAM hits, streamed SSD chunks and
// an absent key, in several frames each, with a stream budget of a single frame, so the
// read-ahead always waits on the budget and every frame's buffer must come back to it.
// This is also the Get that once deadlocked: several SSD-resident keys in one call, the
// sent frame holding the buffer the next chunk waited for.
class StreamedGetTest : public DaemonTest {
 protected:
  static constexpr uint64_t kChunk = 8ull << 20;
  void SetUp() override {
    StartDaemon({"--ram-capacity=16MiB", "--max-pinned-fraction=1", "--write-mode=write-through",
                 "--ssd-stream-buffer=4MiB"});
    ns_ = Register(8);
    for (uint64_t i = 1; i <= 4; ++i) {
      data_[i] = PatternBytes(100 + i, kChunk);
      ChunkToPut c{KeyOf(i), data_[i], 256};
      ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
    }
    // 3 and 4 are the newest (in RAM); pinning them fills the pool.
    std::vector<ChunkKey> pin = {KeyOf(3), KeyOf(4)};
    auto p = client_->Pin(ns_, pin, 0);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->pinned, 2u);
  }
  uint64_t ns_ = 0;
  std::string data_[5];
};

TEST_F(StreamedGetTest, MixedGetStreamsSsdChunksIntact) {
  std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(3), KeyOf(9), KeyOf(2), KeyOf(4)};
  ClientOptions o;
  o.max_frame_bytes = 1 << 20;  // 8 frames per chunk.
  auto small_frames = KvTierClient::Connect(daemon_->target(), o);
  ASSERT_TRUE(small_frames.ok());
  for (KvTierClient* c : {client_.get(), small_frames->get()}) {
    auto got = c->Get(ns_, keys);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 5u);
    const int expect[] = {1, 3, 0, 2, 4};
    for (int i = 0; i < 5; ++i) {
      if (expect[i] == 0) {
        EXPECT_FALSE((*got)[i].found);
        continue;
      }
      EXPECT_TRUE((*got)[i].found) << i;
      EXPECT_TRUE((*got)[i].data == data_[expect[i]]) << i;
      EXPECT_TRUE((*got)[i].crc_verified) << i;
    }
    EXPECT_EQ((*got)[0].tier, v1::TIER_SSD);
    EXPECT_EQ((*got)[1].tier, v1::TIER_RAM);
    EXPECT_EQ((*got)[3].tier, v1::TIER_SSD);
  }
  // Streamed, not promoted: the pool had no room.
  auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(1), KeyOf(2)});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->tiers[0], v1::TIER_SSD);
  EXPECT_EQ(l->tiers[1], v1::TIER_SSD);

  // A layer range of a streamed chunk that starts and ends inside frames.
  auto layers = small_frames->get()->Get(ns_, std::vector<ChunkKey>{KeyOf(2)}, LayerRange{1, 6});
  ASSERT_TRUE(layers.ok()) << layers.status();
  const uint64_t layer = kChunk / 8;
  EXPECT_TRUE((*layers)[0].data == data_[2].substr(layer, 5 * layer));
}

// Layer-major order over the same mix: layer 0 of every key, then layer 1, ...; each
// piece in several frames; the absent key answered once; the streamed SSD chunks read
// layer by layer from the one location found at their first piece.
TEST_F(StreamedGetTest, LayerMajorStreamsEveryLayerOfEveryKeyInLayerOrder) {
  const std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(3), KeyOf(9), KeyOf(2), KeyOf(4)};
  const int expect[] = {1, 3, 0, 2, 4};
  constexpr uint64_t kLayer = kChunk / 8;  // LayoutOfMiB(8): 8 layers of 1 MiB.
  ClientOptions o;
  o.max_frame_bytes = 256 << 10;  // 4 frames per piece.
  auto c = KvTierClient::Connect(daemon_->target(), o);
  ASSERT_TRUE(c.ok());

  struct Seen {
    uint32_t key, layer;
    uint64_t offset, n;
    bool found, last;
  };
  std::vector<Seen> seen;
  std::vector<std::string> assembled(keys.size());
  absl::Status s = (*c)->GetStreamRaw(
      ns_, keys, std::nullopt,
      [&](uint32_t i, const GetFrameHeader& h, absl::Span<const absl::string_view> data) {
        uint64_t n = 0;
        for (absl::string_view piece : data) {
          assembled[i].append(piece.data(), piece.size());
          n += piece.size();
        }
        seen.push_back({i, h.layer(), h.offset(), n, h.found(), h.last()});
        return absl::OkStatus();
      },
      v1::GET_ORDER_LAYER_MAJOR);
  ASSERT_TRUE(s.ok()) << s;

  // The expected sequence, built independently: the absent key's single frame sits in
  // the first pass, at its place among the keys.
  std::vector<Seen> want;
  for (uint32_t l = 0; l < 8; ++l) {
    for (uint32_t i = 0; i < keys.size(); ++i) {
      if (expect[i] == 0) {
        if (l == 0) want.push_back({i, 0, 0, 0, false, true});
        continue;
      }
      for (uint64_t off = 0; off < kLayer; off += o.max_frame_bytes) {
        want.push_back({i, l, off, o.max_frame_bytes, true, off + o.max_frame_bytes == kLayer});
      }
    }
  }
  ASSERT_EQ(seen.size(), want.size());
  for (size_t f = 0; f < want.size(); ++f) {
    EXPECT_EQ(seen[f].key, want[f].key) << f;
    EXPECT_EQ(seen[f].layer, want[f].layer) << f;
    EXPECT_EQ(seen[f].offset, want[f].offset) << f;
    EXPECT_EQ(seen[f].n, want[f].n) << f;
    EXPECT_EQ(seen[f].found, want[f].found) << f;
    EXPECT_EQ(seen[f].last, want[f].last) << f;
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (expect[i] != 0) { EXPECT_TRUE(assembled[i] == data_[expect[i]]) << i; }
  }

  // Get() assembles the same chunks, CRC-checked, with the same tiers as chunk-major.
  auto got = (*c)->Get(ns_, keys, std::nullopt, nullptr, v1::GET_ORDER_LAYER_MAJOR);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_EQ((*got)[i].found, expect[i] != 0) << i;
    if (expect[i] == 0) continue;
    EXPECT_TRUE((*got)[i].data == data_[expect[i]]) << i;
    EXPECT_TRUE((*got)[i].crc_verified) << i;
    EXPECT_EQ((*got)[i].tier, expect[i] <= 2 ? v1::TIER_SSD : v1::TIER_RAM) << i;
  }

  // A layer range: layers 2..4 of each key, pass by pass, not CRC-checked.
  auto range = (*c)->Get(ns_, keys, LayerRange{2, 5}, nullptr, v1::GET_ORDER_LAYER_MAJOR);
  ASSERT_TRUE(range.ok()) << range.status();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (expect[i] == 0) continue;
    EXPECT_TRUE((*range)[i].data == data_[expect[i]].substr(2 * kLayer, 3 * kLayer)) << i;
    EXPECT_FALSE((*range)[i].crc_verified) << i;
  }
}

// Only absent keys: one pass of found = false frames, nothing else.
TEST_F(StreamedGetTest, LayerMajorWithNoKeyFoundAnswersEachOnce) {
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7), KeyOf(8)}, std::nullopt,
                          nullptr, v1::GET_ORDER_LAYER_MAJOR);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE((*got)[0].found);
  EXPECT_FALSE((*got)[1].found);
}

TEST_F(StreamedGetTest, ConcurrentAndCancelledStreamsGiveTheirBuffersBack) {
  // Clients that walk away after the first frame must not keep the one-frame budget.
  ClientOptions o;
  o.max_frame_bytes = 1 << 20;
  o.rpc_deadline = absl::Seconds(30);
  auto c = KvTierClient::Connect(daemon_->target(), o);
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 5; ++i) {
    int frames = 0;
    absl::Status s = (*c)->GetStreamRaw(
        ns_, std::vector<ChunkKey>{KeyOf(1 + i % 2)}, std::nullopt,
        [&](uint32_t, const GetFrameHeader&, absl::Span<const absl::string_view>) {
          return ++frames == 1 ? absl::OkStatus() : absl::CancelledError("walk away");
        });
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(frames, 2);
  }
  std::vector<std::thread> readers;
  std::atomic<int> intact{0};
  for (int t = 0; t < 6; ++t) {
    readers.emplace_back([&, t] {
      const uint64_t k = 1 + t % 2;
      auto got = (*c)->Get(ns_, std::vector<ChunkKey>{KeyOf(k), KeyOf(3)});
      if (got.ok() && (*got)[0].data == data_[k] && (*got)[1].data == data_[3]) intact++;
    });
  }
  for (auto& r : readers) r.join();
  EXPECT_EQ(intact.load(), 6);
}

TEST_F(StreamedGetTest, CorruptStreamedChunkEndsDataLossAndIsDeleted) {
  // Corrupt every payload file while the daemon is down, then fill the pool with pinned
  // chunks written after the restart (in fresh files), and stream chunk 1.
  client_.reset();
  StopDaemon();
  // Every MiB, so every chunk in a file has bad bytes.
  const int corrupted = testing::CorruptPayloadFiles(data_dir_ + "/ssd", [](uint64_t size) {
    std::vector<uint64_t> at;
    for (uint64_t off = 512 << 10; off + 64 < size; off += 1 << 20) at.push_back(off);
    return at;
  });
  ASSERT_GT(corrupted, 0) << "no payload file found";
  StartDaemon({"--ram-capacity=16MiB", "--max-pinned-fraction=1", "--write-mode=write-through",
               "--ssd-stream-buffer=4MiB"});
  ns_ = Register(8);
  for (uint64_t i = 5; i <= 6; ++i) {
    const std::string d = PatternBytes(100 + i, kChunk);
    ChunkToPut c{KeyOf(i), d, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  }
  auto p = client_->Pin(ns_, std::vector<ChunkKey>{KeyOf(5), KeyOf(6)}, 0);
  ASSERT_TRUE(p.ok() && p->pinned == 2u) << p.status();

  const uint64_t before = client_->Stats()->checksum_failures();
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(1)});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(1)});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->tiers[0], v1::TIER_UNSPECIFIED);  // Deleted: never served again.
  EXPECT_EQ(client_->Stats()->checksum_failures(), before + 1);
}

// The streamed chunk's CRC32C covers its whole bytes, read layer by layer: a corrupt
// one ends a layer-major Get DATA_LOSS too, and is deleted.
TEST_F(StreamedGetTest, CorruptStreamedChunkInLayerMajorOrderEndsDataLoss) {
  client_.reset();
  StopDaemon();
  const int corrupted = testing::CorruptPayloadFiles(data_dir_ + "/ssd", [](uint64_t size) {
    std::vector<uint64_t> at;
    for (uint64_t off = 512 << 10; off + 64 < size; off += 1 << 20) at.push_back(off);
    return at;
  });
  ASSERT_GT(corrupted, 0) << "no payload file found";
  StartDaemon({"--ram-capacity=16MiB", "--max-pinned-fraction=1", "--write-mode=write-through",
               "--ssd-stream-buffer=4MiB"});
  ns_ = Register(8);
  for (uint64_t i = 5; i <= 6; ++i) {
    const std::string d = PatternBytes(100 + i, kChunk);
    ChunkToPut c{KeyOf(i), d, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  }
  auto p = client_->Pin(ns_, std::vector<ChunkKey>{KeyOf(5), KeyOf(6)}, 0);
  ASSERT_TRUE(p.ok() && p->pinned == 2u) << p.status();

  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(5), KeyOf(1)}, std::nullopt,
                          nullptr, v1::GET_ORDER_LAYER_MAJOR);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  auto l = client_->Lookup(ns_, std::vector<ChunkKey>{KeyOf(1), KeyOf(5)});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->tiers[0], v1::TIER_UNSPECIFIED);  // Deleted: never served again.
  EXPECT_EQ(l->tiers[1], v1::TIER_RAM);          // The good chunk stays.
}

// Keys whose chunks together exceed max_pinned_fraction of the pool can never all be
// pinned: INVALID_ARGUMENT before any is pinned. Pinning the first ones and then
// answering RESOURCE_EXHAUSTED ("retry") left the pin share full and the client retrying.
TEST_F(DaemonTest, KeysThatCanNeverBePinnedTogetherAreRefusedAndNoneIsPinned) {
  StartDaemon({"--ram-capacity=8MiB", "--write-mode=ram-only", "--max-pinned-fraction=0.5"});
  const uint64_t ns = Register(1);
  std::vector<ChunkKey> keys;
  for (uint64_t i = 1; i <= 5; ++i) {
    ASSERT_TRUE(PutOne(ns, i, 1 << 20).ok());
    keys.push_back(KeyOf(i));
  }
  auto p = client_->Pin(ns, keys, 0);  // 5 MiB of slots against 4 MiB.
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
  EXPECT_NE(p.status().message().find("5 chunks together"), std::string::npos) << p.status();
  EXPECT_EQ(RamStats().pinned_bytes(), 0u);
  keys.pop_back();
  p = client_->Pin(ns, keys, 0);  // 4 MiB: fits.
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->pinned, 4u);
  EXPECT_EQ(RamStats().pinned_bytes(), 4u << 20);
}

// A Lookup lease holds the looked-up hits in RAM through puts that need their room,
// until the Get that names it ends; a released lease holds nothing. Stats shows them.
TEST_F(DaemonTest, LookupLeaseHoldsHitsUntilTheirGet) {
  StartDaemon({"--ram-capacity=6MiB", "--write-mode=ram-only", "--max-leases=2",
               "--max-lease-bytes=6MiB"});
  const uint64_t ns = Register(1);
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(PutOne(ns, i, 1 << 20).ok());
  const std::vector<ChunkKey> leased = {KeyOf(1), KeyOf(2)};
  auto lk = client_->Lookup(ns, leased, /*lease_seconds=*/60);
  ASSERT_TRUE(lk.ok()) << lk.status();
  ASSERT_EQ(lk->prefix_hits, 2u);
  ASSERT_NE(lk->lease_id, 0u);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->leases(), 1u);
  EXPECT_EQ(stats->lease_held_bytes(), 2u << 20);

  auto churn = [&](uint64_t first) {
    for (uint64_t i = first; i < first + 6; ++i) ASSERT_TRUE(PutOne(ns, i, 1 << 20).ok()) << i;
  };
  churn(100);  // Six more chunks through a six-chunk pool.
  auto after = client_->Lookup(ns, std::vector<ChunkKey>{KeyOf(1), KeyOf(2), KeyOf(3)});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tiers[0], v1::TIER_RAM);
  EXPECT_EQ(after->tiers[1], v1::TIER_RAM);
  EXPECT_EQ(after->tiers[2], v1::TIER_UNSPECIFIED);  // Not leased: evicted.

  // A layer-major Get names the lease; the lease ends with it.
  auto got = client_->Get(ns, leased, std::nullopt, nullptr, v1::GET_ORDER_LAYER_MAJOR,
                          lk->lease_id);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)[0].found && (*got)[0].data == PatternBytes(1, 1 << 20));
  EXPECT_TRUE((*got)[1].found && (*got)[1].data == PatternBytes(2, 1 << 20));
  stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->leases(), 0u);
  EXPECT_EQ(stats->lease_held_bytes(), 0u);
  auto released = client_->ReleaseLease(ns, lk->lease_id);
  ASSERT_TRUE(released.ok());
  EXPECT_FALSE(*released);  // Already ended by the Get.
  churn(200);
  after = client_->Lookup(ns, leased);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->prefix_hits, 0u);  // No longer held: evicted like any other.

  // Released without a Get; and max_leases = 2 refuses a third (an answer, no lease).
  for (uint64_t i = 1; i <= 2; ++i) ASSERT_TRUE(PutOne(ns, i, 1 << 20).ok());
  auto a = client_->Lookup(ns, leased, 60);
  auto b = client_->Lookup(ns, leased, 60);
  auto c = client_->Lookup(ns, leased, 60);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(a->lease_id, 0u);
  EXPECT_NE(b->lease_id, 0u);
  EXPECT_EQ(c->lease_id, 0u);
  EXPECT_EQ(c->prefix_hits, 2u);
  EXPECT_TRUE(*client_->ReleaseLease(ns, a->lease_id));
  EXPECT_TRUE(*client_->ReleaseLease(ns, b->lease_id));
  EXPECT_EQ(client_->Stats()->leases(), 0u);
  // A lease of an unknown namespace is NOT_FOUND; a lookup of misses gets no lease.
  EXPECT_EQ(client_->ReleaseLease(ns + 1, 1).status().code(), absl::StatusCode::kNotFound);
  auto miss = client_->Lookup(ns, std::vector<ChunkKey>{KeyOf(999)}, 60);
  ASSERT_TRUE(miss.ok());
  EXPECT_EQ(miss->lease_id, 0u);
}

// A Get that names a lease and is cancelled mid-stream still ends the lease.
TEST_F(DaemonTest, CancelledGetEndsItsLease) {
  StartDaemon({"--ram-capacity=16MiB", "--write-mode=ram-only"});
  const uint64_t ns = Register(4);
  for (uint64_t i = 1; i <= 2; ++i) ASSERT_TRUE(PutOne(ns, i, 4 << 20).ok());
  const std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(2)};
  auto lk = client_->Lookup(ns, keys, 60);
  ASSERT_TRUE(lk.ok() && lk->lease_id != 0) << lk.status();
  ClientOptions o;
  o.max_frame_bytes = 256 << 10;
  auto c = KvTierClient::Connect(daemon_->target(), o);
  ASSERT_TRUE(c.ok());
  int frames = 0;
  absl::Status s = (*c)->GetStreamRaw(
      ns, keys, std::nullopt,
      [&](uint32_t, const GetFrameHeader&, absl::Span<const absl::string_view>) {
        return ++frames == 1 ? absl::OkStatus() : absl::CancelledError("walk away");
      },
      v1::GET_ORDER_CHUNK_MAJOR, lk->lease_id);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  // The lease was taken when the Get started: it is over whatever became of the call.
  auto released = client_->ReleaseLease(ns, lk->lease_id);
  ASSERT_TRUE(released.ok());
  EXPECT_FALSE(*released);
}

TEST_F(DaemonTest, RestartServesSsdResidentChunks) {
  StartDaemon({"--write-mode=write-back", "--ram-capacity=64MiB"});
  const uint64_t ns = Register(4);
  for (uint64_t i = 0; i < 8; ++i) ASSERT_TRUE(PutOne(ns, i, 4 << 20).ok());
  StopDaemon();  // Graceful: flushes write-back to SSD.

  StartDaemon({"--write-mode=write-back", "--ram-capacity=64MiB"});
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 8; ++i) keys.push_back(KeyOf(i));
  auto lookup = client_->Lookup(ns, keys);  // The layout survived the restart too.
  ASSERT_TRUE(lookup.ok()) << lookup.status();
  EXPECT_EQ(lookup->prefix_hits, 8u);
  for (auto t : lookup->tiers) EXPECT_EQ(t, v1::TIER_SSD);
  auto got = client_->Get(ns, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  for (uint64_t i = 0; i < 8; ++i) {
    EXPECT_EQ((*got)[i].tier, v1::TIER_SSD);
    EXPECT_TRUE((*got)[i].data == PatternBytes(i, 4 << 20)) << i;
  }
  // Read once: promoted to RAM.
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->promotions(), 8u);
  auto again = client_->Lookup(ns, keys);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->tiers[0], v1::TIER_RAM);
}

// kill -9 while Put streams of four chunks each are mid-batch, in both modes that keep
// chunks across a restart, with a pool small enough that eviction (write-back: demotion)
// and the flusher run meanwhile. After the restart every chunk any stream began is either
// absent or exactly its bytes (nothing torn is ever visible), and in write-through mode
// every acknowledged chunk is there.
TEST_F(DaemonTest, KillNineMidBatchShowsNothingTornInEitherMode) {
  constexpr uint64_t kChunkBytes = 2 << 20;
  constexpr int kBatch = 4;
  for (const std::string mode : {"write-back", "write-through"}) {
    SCOPED_TRACE(mode);
    data_dir_ = MakeTempDir("kvtierd-kill9-" + mode);
    const std::vector<std::string> args = {"--write-mode=" + mode, "--ram-capacity=32MiB"};
    StartDaemon(args);
    const uint64_t ns = Register(2);
    std::atomic<uint64_t> acked{0};
    std::atomic<bool> stop{false};
    std::mutex mu;
    std::vector<uint64_t> acked_ids, begun_ids;
    std::atomic<int> writers_ended{0};
    std::string writer_error;  // Guarded by mu: the first writer's reason to stop.
    std::vector<std::thread> writers;
    for (int w = 0; w < 3; ++w) {
      writers.emplace_back([&, w] {
        const absl::Status ended = [&]() -> absl::Status {
          auto c = KvTierClient::Connect(daemon_->target());
          if (!c.ok()) return c.status();
          for (uint64_t i = w * 100000; !stop.load(); i += kBatch) {
            std::vector<std::string> data;
            std::vector<ChunkToPut> batch;
            {
              std::lock_guard<std::mutex> lock(mu);
              for (int j = 0; j < kBatch; ++j) begun_ids.push_back(i + j);
            }
            for (int j = 0; j < kBatch; ++j) data.push_back(PatternBytes(i + j, kChunkBytes));
            for (int j = 0; j < kBatch; ++j) {
              batch.push_back(ChunkToPut{KeyOf(i + j), data[j], 256});
            }
            auto put = (*c)->Put(ns, batch);
            if (!put.ok()) return put.status();  // The daemon died mid-batch.
            std::lock_guard<std::mutex> lock(mu);
            for (int j = 0; j < kBatch; ++j) acked_ids.push_back(i + j);
            acked.fetch_add(kBatch);
          }
          return absl::OkStatus();
        }();
        std::lock_guard<std::mutex> lock(mu);
        if (!ended.ok() && writer_error.empty()) writer_error = ended.ToString();
        ++writers_ended;
      });
    }
    // Well past the pool (16 chunks): eviction and write-back are busy when it dies.
    // Bounded, and writers that all stopped early (a refused Put) end the wait at once.
    testing::Eventually([&] { return acked.load() >= 48 || writers_ended.load() == 3; });
    const uint64_t acked_before_kill = acked.load();
    std::string why_short;
    {
      std::lock_guard<std::mutex> lock(mu);
      why_short = writer_error.empty() ? "the writers were still at it after 30 s" : writer_error;
    }
    daemon_->Kill();
    stop = true;
    for (auto& t : writers) t.join();
    daemon_.reset();
    ASSERT_GE(acked_before_kill, 48u)
        << "only " << acked_before_kill << " chunks acknowledged before the kill: " << why_short;

    StartDaemon(args);
    std::vector<ChunkKey> keys;
    for (uint64_t i : begun_ids) keys.push_back(KeyOf(i));
    absl::flat_hash_set<uint64_t> acked_set(acked_ids.begin(), acked_ids.end());
    uint64_t found = 0;
    for (size_t at = 0; at < keys.size(); at += 8) {
      auto part = absl::MakeConstSpan(keys).subspan(at, 8);
      auto got = client_->Get(ns, part);
      ASSERT_TRUE(got.ok()) << got.status();
      for (size_t j = 0; j < part.size(); ++j) {
        const uint64_t id = begun_ids[at + j];
        if ((*got)[j].found) {
          ++found;
          ASSERT_TRUE((*got)[j].data == PatternBytes(id, kChunkBytes)) << "chunk " << id << " torn";
        } else if (mode == "write-through") {
          ASSERT_FALSE(acked_set.contains(id)) << "acknowledged chunk " << id << " lost";
        }
      }
    }
    EXPECT_GT(found, 0u) << "the restart found none of the chunks: the check checked nothing";
    StopDaemon();
  }
}

TEST_F(DaemonTest, SixteenConcurrentClientsMixPutsAndGets) {
  // Room for all 192 chunks: none evicted. 16 clients and 10 Put places make a line; a
  // client thread the loaded test machine leaves unscheduled for put_place_idle between
  // its headers and its frame would lose its Put, which is not what this test is about.
  StartDaemon({"--ram-capacity=256MiB", "--put-place-idle=0"});
  const uint64_t ns = Register(1);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      auto c = KvTierClient::Connect(daemon_->target());
      if (!c.ok()) {
        failures++;
        return;
      }
      for (int i = 0; i < 12; ++i) {
        const uint64_t id = t * 1000 + i;
        const std::string data = PatternBytes(id, 1 << 20);
        ChunkToPut chunk{KeyOf(id), data, 256};
        if (!(*c)->Put(ns, {&chunk, 1}).ok()) failures++;
        // Read back own chunk and one of another client's (may or may not exist yet).
        std::vector<ChunkKey> keys = {KeyOf(id), KeyOf(((t + 1) % 16) * 1000 + i)};
        auto got = (*c)->Get(ns, keys);
        if (!got.ok() || !(*got)[0].found || (*got)[0].data != data) failures++;
        if (got.ok() && (*got)[1].found &&
            (*got)[1].data != PatternBytes(((t + 1) % 16) * 1000 + i, 1 << 20)) {
          failures++;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->tiers(0).chunks(), 16u * 12u);
}

TEST_F(DaemonTest, SigtermStopsCleanly) {
  StartDaemon();
  const uint64_t ns = Register(1);
  ASSERT_TRUE(PutOne(ns, 1, 1 << 20).ok());
  // A lease still live at shutdown holds a pool chunk: it must be given back before the
  // pool goes (it once was not, and the daemon's heap was corrupted on the way out).
  auto looked = client_->Lookup(ns, std::vector<ChunkKey>{KeyOf(1)}, /*lease_seconds=*/60);
  ASSERT_TRUE(looked.ok()) << looked.status();
  ASSERT_NE(looked->lease_id, 0u);
  client_.reset();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_NE(daemon_->ReadLog().find("stopped cleanly"), std::string::npos);
  daemon_.reset();
}

// SIGHUP (the terminal of a daemon started in one closed) is a graceful shutdown like
// SIGTERM: write-back chunks are flushed. Its default action once killed the daemon on
// the spot, losing most of the acknowledged write-back chunks.
TEST_F(DaemonTest, SighupStopsCleanlyAndKeepsWriteBackChunks) {
  const std::vector<std::string> args = {"--write-mode=write-back", "--writeback-threads=1"};
  StartDaemon(args);
  const uint64_t ns = Register(1);
  for (uint64_t i = 1; i <= 16; ++i) ASSERT_TRUE(PutOne(ns, i, 1 << 20).ok()) << i;
  client_.reset();
  ASSERT_EQ(kill(daemon_->pid(), SIGHUP), 0);
  auto code = daemon_->Terminate();  // Waits for the exit SIGHUP began.
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << daemon_->ReadLog();
  EXPECT_NE(daemon_->ReadLog().find("received SIGHUP"), std::string::npos);
  EXPECT_NE(daemon_->ReadLog().find("stopped cleanly"), std::string::npos);
  daemon_.reset();
  StartDaemon(args);
  std::vector<ChunkKey> keys;
  for (uint64_t i = 1; i <= 16; ++i) keys.push_back(KeyOf(i));
  auto found = client_->Lookup(ns, keys);
  ASSERT_TRUE(found.ok()) << found.status();
  for (uint64_t i = 0; i < 16; ++i) EXPECT_NE(found->tiers[i], v1::TIER_UNSPECIFIED) << i;
}

// A second kvtierd on the same data_dir, the same port or the same socket path is
// refused before it touches what the first one uses. It once unlinked the first one's
// Unix sockets on its way to failing on the store's lock, and with its own data_dir
// started on the same port (SO_REUSEPORT) and took part of the first one's calls.
TEST_F(DaemonTest, ASecondDaemonCannotTakeTheFirstOnesDataDirPortOrSocket) {
  const std::string socket_dir = MakeTempDir("kvtierd-sockets");
  const std::string unix_socket = socket_dir + "/kvtierd.sock";
  const std::string shm_socket = socket_dir + "/kvtierd-shm.sock";
  StartDaemon({"--listen-unix=" + unix_socket, "--shm-socket=" + shm_socket});
  const uint64_t ns = Register(1);
  ASSERT_TRUE(PutOne(ns, 1, 1 << 20).ok());
  auto second = [&](std::vector<std::string> args) {
    args.insert(args.begin(), KVTIERD_PATH);
    return testing::RunCommand(args);
  };
  // The same data_dir: refused at once, naming the first daemon.
  const auto same_dir = second({"--data-dir=" + data_dir_, "--listen=127.0.0.1:0",
                                "--listen-unix=" + unix_socket, "--shm-socket=" + shm_socket});
  EXPECT_EQ(same_dir.exit_code, 1) << same_dir.output;
  EXPECT_NE(same_dir.output.find("is in use by another kvtierd (pid " +
                                 std::to_string(daemon_->pid()) + ")"),
            std::string::npos)
      << same_dir.output;
  // Its own data_dir, but the first one's socket paths or port: refused, naming them.
  const std::string other_dir = MakeTempDir("kvtierd-second");
  const auto same_unix = second({"--data-dir=" + other_dir, "--listen=127.0.0.1:0",
                                 "--listen-unix=" + unix_socket});
  EXPECT_EQ(same_unix.exit_code, 1) << same_unix.output;
  EXPECT_NE(same_unix.output.find("option listen_unix: " + unix_socket + " is in use"),
            std::string::npos)
      << same_unix.output;
  const auto same_shm = second({"--data-dir=" + other_dir, "--listen=127.0.0.1:0",
                                "--shm-socket=" + shm_socket});
  EXPECT_EQ(same_shm.exit_code, 1) << same_shm.output;
  EXPECT_NE(same_shm.output.find("option shm_socket: " + shm_socket + " is in use"),
            std::string::npos)
      << same_shm.output;
  const auto same_port =
      second({"--data-dir=" + other_dir, "--listen=127.0.0.1:" + std::to_string(daemon_->port())});
  EXPECT_EQ(same_port.exit_code, 1) << same_port.output;
  // The first daemon still answers on all three.
  auto over_unix = KvTierClient::Connect("unix:" + unix_socket);
  ASSERT_TRUE(over_unix.ok());
  auto found = (*over_unix)->Lookup(ns, std::vector<ChunkKey>{KeyOf(1)});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->tiers[0], v1::TIER_RAM);
  struct stat st {};
  EXPECT_EQ(lstat(shm_socket.c_str(), &st), 0) << "the region socket is still there";
  for (int i = 0; i < 8; ++i) {  // Every call to the port reaches the first daemon.
    auto again = client_->Lookup(ns, std::vector<ChunkKey>{KeyOf(1)});
    ASSERT_TRUE(again.ok()) << again.status();
  }
}

// Out of descriptors (any local user can hold connections to the Unix socket open),
// the Unix listener once stopped accepting for good: every later client waited in the
// backlog until its deadline, whatever had been freed since. It now tries again.
TEST_F(DaemonTest, TheUnixListenerAcceptsAgainOnceDescriptorsAreFree) {
  const std::string unix_socket = MakeTempDir("kvtierd-sockets") + "/kvtierd.sock";
  StartDaemon({"--listen-unix=" + unix_socket});
  const pid_t pid = daemon_->pid();
  // The daemon may open 4 descriptors more than it has now.
  rlim_t open = 0;
  for ([[maybe_unused]] const auto& fd :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    ++open;
  }
  rlimit old{};
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, nullptr, &old), 0) << std::strerror(errno);
  const rlimit tight{open + 4, old.rlim_max};
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, &tight, nullptr), 0) << std::strerror(errno);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(unix_socket.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, unix_socket.data(), unix_socket.size());
  std::vector<int> held;
  for (int i = 0; i < 16; ++i) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    held.push_back(fd);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
  }
  EXPECT_TRUE(testing::Eventually([&] {
    return daemon_->ReadLog().find("listen_unix: accept: Too many open files") != std::string::npos;
  })) << daemon_->ReadLog();
  for (int fd : held) close(fd);
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, &old, nullptr), 0) << std::strerror(errno);
  ClientOptions o;
  o.rpc_deadline = absl::Seconds(30);
  auto over_unix = KvTierClient::Connect("unix:" + unix_socket, o);
  ASSERT_TRUE(over_unix.ok()) << over_unix.status();
  // A call that writes nothing (RocksDB may have met the limit too, in the background).
  auto stats = (*over_unix)->Stats();
  EXPECT_TRUE(stats.ok()) << stats.status() << "\n" << daemon_->ReadLog();
}

// Connected clients with no call in flight do not hold up SIGTERM: with an hour of
// shutdown_grace the daemon closes their connections once no call is open, and exits.
TEST_F(DaemonTest, SigtermIsNotHeldUpByIdleConnections) {
  StartDaemon({"--shutdown-grace=1h"});
  const uint64_t ns = Register(1);
  ASSERT_TRUE(PutOne(ns, 1, 1 << 20).ok());
  auto idle = KvTierClient::Connect(daemon_->target());
  ASSERT_TRUE(idle.ok());
  ASSERT_TRUE((*idle)->Stats().ok());  // Its connection is up, then idle; so is client_'s.
  auto code = daemon_->Terminate(/*timeout_seconds=*/60);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << daemon_->ReadLog();
  EXPECT_EQ(*code, 0);
  const std::string log = daemon_->ReadLog();
  EXPECT_NE(log.find("RPCs drained"), std::string::npos) << log;
  EXPECT_NE(log.find("stopped cleanly"), std::string::npos) << log;
  // Not waited out: once no call was open the daemon closed them. (gRPC's graceful
  // GOAWAY waits for each connection's ping answer, which an idle C++ client, like the
  // two here, sends only when its backup poller runs, 5 s later; a gRPC whose idle
  // clients answer at once would not need the close, and this line would be missing.)
  EXPECT_NE(log.find("no RPC in flight: closing the idle client connections"),
            std::string::npos)
      << log;
  daemon_.reset();
}

// SIGTERM while a put stream is half sent: health turns NOT_SERVING at once, the put is
// allowed to finish within shutdown_grace and is acknowledged, the daemon exits 0 after
// flushing, and the chunk is there after a restart.
TEST_F(DaemonTest, SigtermFinishesInFlightPutsAndFlushes) {
  StartDaemon({"--write-mode=write-back"});
  const uint64_t ns = Register(4);
  auto channel = grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto check = [&](const std::string& service = "") {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = health->Check(&ctx, req, &resp);  // Refused once shut down.
    return s.ok() ? resp.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  };
  EXPECT_EQ(check(), grpc::health::v1::HealthCheckResponse::SERVING);
  // The service by name answers too (load balancers ask for it).
  EXPECT_EQ(check("kvtier.v1.KvCache"), grpc::health::v1::HealthCheckResponse::SERVING);

  const std::string data = PatternBytes(77, 4 << 20);
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto writer = client_->stub()->Put(&ctx, &resp);
  auto frame = [&](uint64_t off, bool last) {
    v1::PutFrame f;
    f.set_namespace_id(ns);
    f.set_key(KeyOf(77).ToByteString());
    f.set_offset(off);
    f.set_data(data.substr(off, 1 << 20));
    if (last) f.set_crc32c(crc32c::Value(data));
    return f;
  };
  ASSERT_TRUE(writer->Write(frame(0, false)));
  ASSERT_TRUE(writer->Write(frame(1 << 20, false)));

  kill(daemon_->pid(), SIGTERM);
  // Polled (testing::Eventually: up to 30 s) for the daemon's own shutdown to begin.
  EXPECT_TRUE(testing::Eventually([&] {
    auto h = testing::HttpGet(daemon_->metrics_port(), "/healthz");
    return h.ok() && h->status == 503;
  })) << "/healthz never reported 503 during shutdown";
  EXPECT_NE(check(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_NE(check("kvtier.v1.KvCache"), grpc::health::v1::HealthCheckResponse::SERVING);

  ASSERT_TRUE(writer->Write(frame(2 << 20, false)));
  ASSERT_TRUE(writer->Write(frame(3 << 20, true)));
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(resp.chunks_stored(), 1u);

  client_.reset();
  auto code = daemon_->Terminate();  // Already signalled; this waits for the exit.
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0) << daemon_->ReadLog();
  daemon_.reset();

  StartDaemon({"--write-mode=write-back"});
  auto got = client_->Get(ns, std::vector<ChunkKey>{KeyOf(77)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE((*got)[0].found);
  EXPECT_EQ((*got)[0].tier, v1::TIER_SSD);
  EXPECT_TRUE((*got)[0].data == data);
}

TEST(DaemonConfigTest, BadOptionStopsStartupNamingIt) {
  auto r = testing::RunCommand({KVTIERD_PATH, "--ram-capacity=lots"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("ram_capacity"), std::string::npos) << r.output;

  auto r2 = testing::RunCommand({KVTIERD_PATH, "--write-mode=sometimes"});
  EXPECT_EQ(r2.exit_code, 2);
  EXPECT_NE(r2.output.find("write_mode"), std::string::npos) << r2.output;

  const std::string dir = MakeTempDir("cfg");
  const std::string cfg = dir + "/kvtierd.toml";
  std::ofstream(cfg) << "listen = \"127.0.0.1:0\"\nram_capasity = \"1GiB\"\n";
  auto r3 = testing::RunCommand({KVTIERD_PATH, "--config", cfg});
  EXPECT_EQ(r3.exit_code, 2);
  EXPECT_NE(r3.output.find("ram_capasity"), std::string::npos) << r3.output;

  auto r4 = testing::RunCommand({KVTIERD_PATH, "--listen=127.0.0.1:0", "--ram-slot-size=1000"});
  EXPECT_EQ(r4.exit_code, 2);
  EXPECT_NE(r4.output.find("ram_slot_size"), std::string::npos) << r4.output;
}

// A file the configuration names but the machine does not provide yet (a Redis
// password a secrets agent writes at boot) is not a configuration error: exit 1, which
// the systemd unit restarts, not 2 (RestartPreventExitStatus), which left the daemon
// down for good after such a boot.
TEST(DaemonConfigTest, AMissingSecretFileIsNotAConfigurationError) {
  const std::string dir = MakeTempDir("cfg-secret");
  auto r = testing::RunCommand({KVTIERD_PATH, "--listen=127.0.0.1:0", "--data-dir=" + dir,
                                "--remote-seeds=127.0.0.1:1",
                                "--remote-password-file=" + dir + "/not-yet"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("remote_password_file"), std::string::npos) << r.output;
}

// A port file whose bytes cannot be written (a full disk: here its temporary name links
// to /dev/full, which takes the open and fails the flush at close) stops the daemon,
// naming it. The check once came before the close: the write error went unnoticed and
// an empty port file was renamed in for a supervisor to read.
TEST(PortFileTest, AFailedWriteStopsTheDaemon) {
  const std::string dir = MakeTempDir("kvtierd-port-file");
  const std::string port_file = dir + "/port";
  ASSERT_EQ(symlink("/dev/full", (port_file + ".tmp").c_str()), 0) << std::strerror(errno);
  auto d = DaemonProcess::Start(MakeTempDir("kvtierd-port-file-data"),
                                {"--port-file=" + port_file});
  ASSERT_FALSE(d.ok()) << "started, with no port file to show for it";
  EXPECT_NE(d.status().message().find("port_file: cannot write " + port_file + ".tmp: "),
            std::string::npos)
      << d.status();
  struct stat st {};
  EXPECT_NE(lstat(port_file.c_str(), &st), 0) << "nothing was renamed into its place";
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// The daemon tells its limits at RegisterLayout, and the client cuts Put frames to fit
// them: a client sending 4 MiB frames stores chunks on a daemon that takes 64 KiB.
TEST_F(DaemonTest, ClientsSizeTheirFramesToTheDaemonsLimits) {
  StartDaemon({"--max-frame-size=64KiB", "--max-keys-per-request=100"});
  v1::RegisterLayoutRequest req;
  *req.mutable_layout() = LayoutToProto(LayoutOfMiB(1));
  v1::RegisterLayoutResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(client_->stub()->RegisterLayout(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.max_frame_bytes(), 64u << 10);
  EXPECT_EQ(resp.max_keys_per_request(), 100u);
  EXPECT_GT(resp.max_message_bytes(), uint64_t{64} << 10);

  ASSERT_EQ(client_->options().max_frame_bytes, 4u << 20);
  const uint64_t ns = Register(1);
  ASSERT_TRUE(PutOne(ns, 1, 1 << 20).ok());
  auto got = client_->Get(ns, {KeyOf(1)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].data, PatternBytes(1, 1 << 20));
}

// A client generated from the proto with stock channel options (gRPC's 4 MiB receive
// limit) that leaves max_frame_bytes unset reads Get and Prefill streams of 8 MiB chunks:
// the daemon's default frames (max_frame_size, 4 MiB) would be 4 MiB plus the frame's
// other fields, which such a client cuts off with RESOURCE_EXHAUSTED on every try.
TEST_F(DaemonTest, AStockGrpcClientReadsFramesOfLargeChunks) {
  StartDaemon();
  constexpr uint64_t kChunk = 8 << 20;
  const uint64_t ns = Register(8);
  for (uint64_t i = 1; i <= 2; ++i) ASSERT_TRUE(PutOne(ns, i, kChunk).ok()) << i;
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  {
    v1::GetRequest req;
    req.set_namespace_id(ns);
    for (uint64_t i = 1; i <= 2; ++i) req.add_keys(KeyOf(i).ToByteString());
    grpc::ClientContext ctx;
    auto reader = stub->Get(&ctx, req);
    std::map<uint32_t, std::string> chunks;
    v1::GetFrame frame;
    size_t frames = 0;
    while (reader->Read(&frame)) {
      ++frames;
      EXPECT_LT(frame.ByteSizeLong(), size_t{4} << 20);
      chunks[frame.key_index()] += frame.data();
    }
    const grpc::Status s = reader->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(frames, 6u);  // Three per chunk: 8 MiB is just over two frames.
    EXPECT_TRUE(chunks[0] == PatternBytes(1, kChunk));
    EXPECT_TRUE(chunks[1] == PatternBytes(2, kChunk));
  }
  {
    grpc::ClientContext ctx;
    auto stream = stub->Prefill(&ctx);
    v1::PrefillClientMessage open;
    open.mutable_open()->set_namespace_id(ns);
    for (uint64_t i = 1; i <= 2; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
    // A slow worker: the daemon streams both chunks.
    open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);
    ASSERT_TRUE(stream->Write(open));
    std::map<uint32_t, std::string> chunks;
    std::optional<v1::PrefillDone> done;
    v1::PrefillServerMessage m;
    while (stream->Read(&m)) {
      EXPECT_LT(m.ByteSizeLong(), size_t{4} << 20);
      if (m.has_chunk()) chunks[m.chunk().index()] += m.chunk().data();
      if (m.has_done()) {
        done = m.done();
        stream->WritesDone();
      }
    }
    const grpc::Status s = stream->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(done.has_value());
    EXPECT_EQ(done->first_streamed(), 0u);
    EXPECT_TRUE(chunks[0] == PatternBytes(1, kChunk));
    EXPECT_TRUE(chunks[1] == PatternBytes(2, kChunk));
  }
}

}  // namespace
}  // namespace kvtier
