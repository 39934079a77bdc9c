// The shared tier through TieredStore, against a real Redis Cluster on loopback: a
// chunk put on one store is read on another (and kept in its RAM), a chunk two stores
// put travels once, and every way a remote copy can be bad (a corrupt or missing
// segment, a damaged record, another layout under the same namespace) is a miss, never
// served. Deletes and clears reach the cluster; a full cluster and a dead one cost the
// puts nothing. The tier works the same over mutual TLS.
#include "storage/tiered_store.h"

#include <hiredis/hiredis.h>

#include <cstring>
#include <set>
#include <string>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/redis/hash_slot.h"
#include "storage/remote_record.h"
#include "tests/support/fake_clock.h"
#include "tests/support/redis_cluster_process.h"

namespace kvtier {
namespace {

using testing::FakeClock;
using testing::RedisClusterProcess;
using testing::RedisClusterSpec;
using testing::TempDir;

constexpr uint64_t kMiB = 1 << 20;

// 4 layers * 2 * 2 heads * 128 dims * 256 tokens * 2 bytes = 1 MiB per chunk.
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
  view.ForEachPiece(0, view.meta().size, [&](absl::string_view p) { out.append(p.data(), p.size()); });
  return out;
}

constexpr uint64_t kNs = 0x7e57;

class RemoteTierTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!RedisClusterProcess::Available()) return;
    auto c = RedisClusterProcess::Start({});
    ASSERT_TRUE(c.ok()) << c.status();
    shared_ = c->release();
  }
  static void TearDownTestSuite() {
    delete shared_;
    shared_ = nullptr;
  }
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    if (!RedisClusterProcess::Available()) GTEST_SKIP() << "redis-server not installed";
    cluster_ = shared_;
    ASSERT_TRUE(cluster_->FlushAll().ok());
  }

  TieredStoreOptions Options(const std::string& dir, WriteMode mode) {
    TieredStoreOptions o;
    o.write_mode = mode;
    o.ram.arena.capacity_bytes = 16 * kMiB;
    o.ram.arena.slot_bytes = 64 << 10;
    o.ssd.path = dir + "/db";
    o.ssd.capacity_bytes = 256 * kMiB;
    o.max_chunk_bytes = 4 * kMiB;
    o.put_wait = absl::Milliseconds(50);
    o.remote.cluster.seeds = cluster_->Seeds();
    o.remote.cluster.tls = cluster_->ClientTls();  // Not enabled for a plaintext cluster.
    o.remote.cluster.now = clock_.AsFunction();
    o.remote.cluster.io_timeout = absl::Milliseconds(500);
    o.remote.cluster.min_refresh_interval = absl::ZeroDuration();
    o.remote.segment_bytes = 64 << 10;  // 16 segments per chunk.
    o.remote.ttl = absl::Hours(1);
    return o;
  }
  std::unique_ptr<TieredStore> Open(const TieredStoreOptions& o, const LayoutSpec& layout = SmallLayout()) {
    auto s = TieredStore::Open(o);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    auto r = (*s)->RegisterLayout(layout, kNs);
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(s);
  }
  // Store A writes back to its SSD; store B is RAM only. Both share the cluster.
  void OpenBoth() {
    a_ = Open(Options(dir_a_.path(), WriteMode::kWriteBack));
    b_ = Open(Options(dir_b_.path(), WriteMode::kRamOnly));
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
  }

  static ChunkId Id(uint64_t n) { return ChunkId{kNs, ChunkKey{0xc0ffee0000000000ull | n, n}}; }

  absl::Status Put(TieredStore* store, const ChunkId& id) {
    auto w = store->BeginPut(id, 256);
    if (!w.ok()) return w.status();
    if (*w == nullptr) return absl::AlreadyExistsError("present");
    const std::string data = Payload(id, (*w)->size());
    if (absl::Status s = (*w)->Append(data); !s.ok()) return s;
    return store->CommitPut(*std::move(w), crc32c::Value(data));
  }

  // The commit record as stored.
  RemoteRecord Record(const ChunkId& id) {
    const std::string key = RemoteRecordKey("kvt", id);
    auto m = cluster_->MasterOf(RedisHashSlot(key));
    EXPECT_TRUE(m.ok());
    auto r = cluster_->Call(*m, {"GET", key});
    EXPECT_TRUE(r.ok());
    auto rec = DecodeRemoteRecord(ReplyString(**r));
    EXPECT_TRUE(rec.ok()) << rec.status();
    return rec.ok() ? *rec : RemoteRecord{};
  }
  // A command on the master of `key`.
  RedisReplyPtr OnOwner(const std::string& key, const std::vector<std::string>& argv) {
    auto m = cluster_->MasterOf(RedisHashSlot(key));
    EXPECT_TRUE(m.ok());
    auto r = cluster_->Call(*m, argv);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }
  // Closes every client connection of every live node (CLIENT KILL, from a connection
  // of its own), as a server's `timeout` closes idle clients.
  void CloseClientConnections() {
    for (int i = 0; i < cluster_->size(); ++i) {
      if (!cluster_->alive(i)) continue;
      auto r = cluster_->Call(i, {"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"});
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
  bool RecordExists(const ChunkId& id) {
    const std::string key = RemoteRecordKey("kvt", id);
    return OnOwner(key, {"EXISTS", key})->integer == 1;
  }
  // Keys on every master (records and segments alike).
  long long KeysOnMasters() {
    long long keys = 0;
    for (int i = 0; i < cluster_->size(); ++i) {
      if (!cluster_->alive(i)) continue;
      auto role = cluster_->Call(i, {"ROLE"});
      EXPECT_TRUE(role.ok());
      if (!role.ok() || ReplyString(*(*role)->element[0]) != "master") continue;
      keys += (*cluster_->Call(i, {"DBSIZE"}))->integer;
    }
    return keys;
  }

  // The tier on its own (no TieredStore), for what the store hides: Clear's count, the
  // status of one read, the cluster's view of the map.
  static constexpr uint64_t kFingerprint = 0xf1f1;
  RemoteTierOptions TierOptions() {
    RemoteTierOptions o;
    o.cluster.seeds = cluster_->Seeds();
    o.cluster.tls = cluster_->ClientTls();
    o.cluster.now = clock_.AsFunction();
    o.cluster.io_timeout = absl::Milliseconds(500);
    o.cluster.min_refresh_interval = absl::ZeroDuration();
    o.segment_bytes = 64 << 10;
    o.ttl = absl::Hours(1);
    return o;
  }
  std::unique_ptr<RemoteTier> OpenTier(RemoteTierOptions o) {
    auto t = RemoteTier::Open(std::move(o));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  std::unique_ptr<RemoteTier> OpenTier() { return OpenTier(TierOptions()); }
  // Writes Payload(id, kMiB) through `tier`; returns how the write ended.
  static absl::Status WriteChunk(RemoteTier& tier, const ChunkId& id) {
    auto data = std::make_shared<std::string>(Payload(id, kMiB));
    ChunkMeta meta;
    meta.size = data->size();
    meta.crc32c = crc32c::Value(*data);
    meta.token_count = 256;
    absl::Notification done;
    absl::Status result;
    tier.WriteAsync(id, meta, kFingerprint, {*data}, data, [&](absl::Status s) {
      result = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    return result;
  }
  // ReadRecord then ReadPayload; the payload, or the first failure.
  static absl::StatusOr<std::string> ReadChunk(RemoteTier& tier, const ChunkId& id) {
    auto record = tier.ReadRecord(id, RemoteLayout{kFingerprint, 0});
    if (!record.ok()) return record.status();
    std::string out(record->meta.size, '\0');
    StringSink sink(&out);
    if (absl::Status s = tier.ReadPayload(id, *record, sink); !s.ok()) return s;
    return out;
  }

  static RedisClusterProcess* shared_;
  RedisClusterProcess* cluster_ = nullptr;
  FakeClock clock_;
  TempDir dir_a_{"remote-a"}, dir_b_{"remote-b"}, dir_c_{"remote-c"};
  std::unique_ptr<TieredStore> a_, b_;
};

RedisClusterProcess* RemoteTierTest::shared_ = nullptr;

TEST_F(RemoteTierTest, AChunkPutOnOneStoreIsReadOnAnother) {
  OpenBoth();
  const ChunkId id = Id(1);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  EXPECT_EQ(a_->GetStats().remote.writes, 1u);
  EXPECT_EQ(a_->GetStats().remote.bytes_written, kMiB);

  EXPECT_EQ(b_->Locate(id), Tier::kNone);  // Locally nothing...
  const ChunkId ids[] = {id, Id(2)};
  EXPECT_EQ(b_->LocateMany(ids), (std::vector<Tier>{Tier::kRemote, Tier::kNone}));
  auto view = b_->Read(id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->tier(), Tier::kRemote);
  EXPECT_EQ(ReadAll(*view), Payload(id, kMiB));
  EXPECT_EQ(view->meta().token_count, 256u);
  EXPECT_EQ(b_->Locate(id), Tier::kRam);  // ...then kept in RAM.
  const TieredStoreStats s = b_->GetStats();
  EXPECT_EQ(s.remote.hits, 1u);
  EXPECT_EQ(s.remote.bytes_read, kMiB);
  EXPECT_EQ(s.remote_promotions, 1u);
  EXPECT_EQ(s.remote.writes, 0u);  // A chunk read from the tier is not written back to it.
  EXPECT_FALSE(b_->Read(Id(2)).ok());

  // Its 16 segments are spread over the masters, and expire after their record.
  const RemoteRecord rec = Record(id);
  ASSERT_EQ(rec.segments(), 16u);
  std::set<int> masters;
  for (uint32_t i = 0; i < rec.segments(); ++i) {
    auto m = cluster_->MasterOf(RedisHashSlot(RemoteSegmentKey("kvt", id, rec.generation, i)));
    ASSERT_TRUE(m.ok());
    masters.insert(*m);
  }
  EXPECT_EQ(masters.size(), 3u);
  const std::string rkey = RemoteRecordKey("kvt", id);
  const std::string skey = RemoteSegmentKey("kvt", id, rec.generation, 0);
  const long long record_ttl = OnOwner(rkey, {"PTTL", rkey})->integer;
  const long long segment_ttl = OnOwner(skey, {"PTTL", skey})->integer;
  EXPECT_GT(record_ttl, 0);
  EXPECT_LE(record_ttl, 3600 * 1000);
  EXPECT_GT(segment_ttl, record_ttl);
}

// A chunk larger than max_pending_bytes is shared when nothing else is pending; it
// was refused on every write (the default bound is an eighth of the pool, which a
// 128 MiB chunk of a 1 GiB pool passes).
TEST_F(RemoteTierTest, AChunkLargerThanThePendingBoundIsSharedAlone) {
  TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kWriteBack);
  o.remote.max_pending_bytes = 64 << 10;  // A sixteenth of a chunk.
  a_ = Open(o);
  b_ = Open(Options(dir_b_.path(), WriteMode::kRamOnly));
  ASSERT_NE(a_, nullptr);
  ASSERT_NE(b_, nullptr);
  ASSERT_TRUE(Put(a_.get(), Id(1)).ok());
  a_->WaitForRemoteWrites();
  EXPECT_EQ(a_->GetStats().remote.writes, 1u);
  EXPECT_EQ(a_->GetStats().remote.writes_dropped, 0u);
  auto view = b_->Read(Id(1));
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->tier(), Tier::kRemote);
  EXPECT_EQ(ReadAll(*view), Payload(Id(1), kMiB));
}

// A put that commits while a Clear clears the shared tier leaves the chunk where a
// put after the Clear would: held locally (and shared). The Clear once cleared the
// shared tier first: such a put's shared write was queued after the Clear had
// cancelled writes and landed after it had looked, and the local clear then removed
// the local copy, so the chunk came back from the shared tier alone.
TEST_F(RemoteTierTest, APutDuringAClearIsNeverLeftInTheSharedTierAlone) {
  TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kWriteBack);
  absl::Notification cleared;
  bool put_ok = false;
  o.remote.before_commit = [&](const ChunkId& id) {
    if (id == Id(7)) cleared.WaitForNotification();  // Lands once Clear has returned.
  };
  o.remote.after_clear_cancel = [&](uint64_t) {
    if (!put_ok) put_ok = Put(a_.get(), Id(7)).ok();
  };
  a_ = Open(o);
  ASSERT_NE(a_, nullptr);
  ASSERT_TRUE(Put(a_.get(), Id(1)).ok());
  a_->WaitForRemoteWrites();
  auto n = a_->Clear(kNs);
  cleared.Notify();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_GE(*n, 1u);
  ASSERT_TRUE(put_ok);
  a_->WaitForRemoteWrites();
  const ChunkId ids[] = {Id(1), Id(7)};
  EXPECT_EQ(a_->LocateMany(ids)[0], Tier::kNone);
  EXPECT_NE(a_->Locate(Id(7)), Tier::kNone) << "in the shared tier alone";
  auto view = a_->Read(Id(7));
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(ReadAll(*view), Payload(Id(7), kMiB));
}

// A streaming reader (a Get; layer-major keeps each key's chunk until its last pass)
// holding the only buffer for shared-tier reads RAM has no room for is not made to wait
// for another: it would wait on itself, on a read thread, forever, and every buffered
// read of every tenant behind it. Its next such read is a miss instead; a plain read
// still waits its turn.
TEST_F(RemoteTierTest, AStreamingReaderHoldingTheOnlyBufferIsNotMadeToWaitForAnother) {
  a_ = Open(Options(dir_a_.path(), WriteMode::kWriteBack));
  ASSERT_NE(a_, nullptr);
  for (uint64_t i = 1; i <= 2; ++i) ASSERT_TRUE(Put(a_.get(), Id(i)).ok());
  a_->WaitForRemoteWrites();
  TieredStoreOptions o = Options(dir_b_.path(), WriteMode::kRamOnly);
  o.ram.arena.capacity_bytes = kMiB;  // One chunk...
  o.max_buffered_reads = 1;
  b_ = Open(o);
  ASSERT_NE(b_, nullptr);
  ASSERT_TRUE(Put(b_.get(), Id(9)).ok());
  auto held = b_->Read(Id(9));  // ...held by a reader: no room for a promotion.
  ASSERT_TRUE(held.ok()) << held.status();
  struct Call {
    absl::Notification done;
    absl::StatusOr<ChunkView> out = absl::UnknownError("not called");
  };
  const auto read_for_stream = [&](const ChunkId& id) {
    auto call = std::make_shared<Call>();
    b_->ReadForStreamAsync(id, [call](absl::StatusOr<ChunkView> v) {
      call->out = std::move(v);
      call->done.Notify();
    });
    // Ends, or waits for a buffer (the defect): then the test lets the first go.
    while (!call->done.HasBeenNotified() && b_->buffered_read_waiters() == 0) {
      call->done.WaitForNotificationWithTimeout(absl::Milliseconds(1));
    }
    return call;
  };
  std::shared_ptr<Call> first = read_for_stream(Id(1));
  ASSERT_TRUE(first->done.HasBeenNotified());
  ASSERT_TRUE(first->out.ok()) << first->out.status();
  EXPECT_EQ(first->out->tier(), Tier::kRemote);
  EXPECT_EQ(ReadAll(*first->out), Payload(Id(1), kMiB));
  std::shared_ptr<Call> second = read_for_stream(Id(2));
  const bool second_done = second->done.HasBeenNotified();
  EXPECT_TRUE(second_done) << "a streaming read waited for the buffer its caller holds";
  first->out = absl::UnknownError("dropped");  // Lets a waiting read (the defect) go.
  held = absl::UnknownError("dropped");
  second->done.WaitForNotification();
  if (second_done) EXPECT_EQ(second->out.status().code(), absl::StatusCode::kNotFound);
  // A plain read (it holds nothing yet) still waits its turn and is served.
  auto plain = b_->Read(Id(2));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(ReadAll(*plain), Payload(Id(2), kMiB));
}

TEST_F(RemoteTierTest, AGetsMissingChunksAreFetchedTogetherAhead) {
  a_ = Open(Options(dir_a_.path(), WriteMode::kWriteBack));
  TieredStoreOptions ob = Options(dir_b_.path(), WriteMode::kRamOnly);
  ob.remote.batch_bytes = 2 * kMiB;  // Pipelines of two chunks: three groups below.
  b_ = Open(ob);
  ASSERT_NE(a_, nullptr);
  ASSERT_NE(b_, nullptr);
  for (uint64_t n = 10; n <= 15; ++n) ASSERT_TRUE(Put(a_.get(), Id(n)).ok()) << n;
  a_->WaitForRemoteWrites();
  // One chunk is corrupt in the cluster; one B already holds; one nobody has.
  const RemoteRecord rec = Record(Id(12));
  const std::string skey = RemoteSegmentKey("kvt", Id(12), rec.generation, 3);
  std::string bytes(ReplyString(*OnOwner(skey, {"GET", skey})));
  bytes[7] ^= 4;
  OnOwner(skey, {"SET", skey, bytes});
  ASSERT_TRUE(Put(b_.get(), Id(15)).ok());
  b_->WaitForRemoteWrites();

  std::vector<ChunkId> ids;
  for (uint64_t n = 10; n <= 15; ++n) ids.push_back(Id(n));
  ids.push_back(Id(99));
  b_->FetchRemoteAsync(ids);
  b_->WaitForRemoteFetches();
  const TieredStoreStats s = b_->GetStats();
  EXPECT_EQ(s.remote.hits, 4u);
  EXPECT_EQ(s.remote_promotions, 4u);
  EXPECT_EQ(s.remote.checksum_failures, 1u);
  EXPECT_EQ(s.remote.misses, 1u);  // Id(99); Id(15) was not asked for.
  for (uint64_t n : {10, 11, 13, 14, 15}) {
    EXPECT_EQ(b_->Locate(Id(n)), Tier::kRam) << n;
    auto view = b_->Read(Id(n));
    ASSERT_TRUE(view.ok()) << n;
    EXPECT_EQ(view->tier(), Tier::kRam) << n;  // Served from what the fetch landed.
    EXPECT_EQ(ReadAll(*view), Payload(Id(n), kMiB)) << n;
  }
  EXPECT_EQ(b_->Locate(Id(12)), Tier::kNone);  // Never served, and its record is gone.
  EXPECT_FALSE(RecordExists(Id(12)));
  EXPECT_EQ(b_->Locate(Id(99)), Tier::kNone);
  EXPECT_EQ(b_->GetStats().remote.hits, 4u);  // The reads above went to RAM, not Redis.
  // The fetch gave back its claims on the chunks it missed: a reader asks again, and is
  // answered (a claim kept would leave it waiting forever).
  EXPECT_EQ(b_->Read(Id(12)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->Read(Id(99)).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RemoteTierTest, AChunkTwoStoresPutTravelsOnce) {
  OpenBoth();
  const ChunkId id = Id(3);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  ASSERT_TRUE(Put(b_.get(), id).ok());
  b_->WaitForRemoteWrites();
  EXPECT_EQ(b_->GetStats().remote.writes_present, 1u);
  EXPECT_EQ(b_->GetStats().remote.bytes_written, 0u);
}

TEST_F(RemoteTierTest, ACorruptSegmentIsNeverServed) {
  OpenBoth();
  const ChunkId id = Id(4);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  const RemoteRecord rec = Record(id);
  const std::string skey = RemoteSegmentKey("kvt", id, rec.generation, 5);
  std::string bytes(ReplyString(*OnOwner(skey, {"GET", skey})));
  bytes[1000] ^= 1;  // One bit, same length.
  OnOwner(skey, {"SET", skey, bytes});
  auto view = b_->Read(id);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->GetStats().remote.checksum_failures, 1u);
  EXPECT_EQ(b_->GetStats().remote.hits, 0u);
  EXPECT_EQ(b_->Locate(id), Tier::kNone);
  EXPECT_FALSE(RecordExists(id));  // Deleted: no other daemon trips on it.
  // The writer's own copy is untouched.
  auto local = a_->Read(id);
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(ReadAll(*local), Payload(id, kMiB));
}

TEST_F(RemoteTierTest, AMissingSegmentIsAMiss) {
  OpenBoth();
  const ChunkId id = Id(5);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  const RemoteRecord rec = Record(id);
  const std::string skey = RemoteSegmentKey("kvt", id, rec.generation, 15);
  OnOwner(skey, {"DEL", skey});  // As Redis eviction would.
  EXPECT_EQ(b_->Read(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->GetStats().remote.torn, 1u);
  EXPECT_EQ(b_->Locate(id), Tier::kNone);
}

TEST_F(RemoteTierTest, ADamagedRecordIsAMissAndIsDeleted) {
  OpenBoth();
  const ChunkId id = Id(6);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  const std::string rkey = RemoteRecordKey("kvt", id);
  std::string rec(ReplyString(*OnOwner(rkey, {"GET", rkey})));
  rec[12] ^= 0x10;  // The size field.
  OnOwner(rkey, {"SET", rkey, rec});
  EXPECT_EQ(b_->Read(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->GetStats().remote.checksum_failures, 1u);
  EXPECT_FALSE(RecordExists(id));
}

// A record of another version whose CRC holds was written by another release (a
// rolling upgrade runs old and new daemons on one cluster): a miss counted as foreign,
// not corruption, and left in place. Deleting it once made each release delete the
// other's entries.
TEST_F(RemoteTierTest, ARecordOfAnotherVersionIsAMissAndIsKept) {
  auto tier = OpenTier();
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(WriteChunk(*tier, Id(30)).ok());
  const std::string rkey = RemoteRecordKey("kvt", Id(30));
  std::string rec(ReplyString(*OnOwner(rkey, {"GET", rkey})));
  rec[4] = static_cast<char>(rec[4] + 1);  // The version, after the magic.
  const uint32_t crc = crc32c::Value(absl::string_view(rec).substr(0, rec.size() - 4));
  for (int i = 0; i < 4; ++i) rec[rec.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  ASSERT_EQ(ReplyString(*OnOwner(rkey, {"SET", rkey, rec})), "OK");

  auto record = tier->ReadRecord(Id(30), RemoteLayout{kFingerprint, 0});
  EXPECT_EQ(record.status().code(), absl::StatusCode::kNotFound) << record.status();
  EXPECT_TRUE(ReplyString(*OnOwner(rkey, {"GET", rkey})) == rec) << "the record was changed";
  const RemoteTierStats s = tier->GetStats();
  EXPECT_EQ(s.foreign, 1u);
  EXPECT_EQ(s.checksum_failures, 0u);
  EXPECT_FALSE(s.degraded);
}

// A record whose CRC holds but whose size is not the layout's chunk size (a buggy or
// hostile writer re-encoded it) is corrupt: a miss, counted and deleted, and its size
// never reaches an allocation. A 1 TiB size once aborted the reader (std::bad_alloc),
// and a small one was served as a short chunk.
TEST_F(RemoteTierTest, AForgedRecordSizeIsAMissAndIsDeleted) {
  OpenBoth();
  for (const uint64_t forged : {uint64_t{1} << 40, uint64_t{1000}}) {
    const ChunkId id = Id(forged == 1000 ? 21 : 20);
    ASSERT_TRUE(Put(a_.get(), id).ok());
    a_->WaitForRemoteWrites();
    RemoteRecord rec = Record(id);
    rec.meta.size = forged;
    rec.segment_bytes = 1u << 31;  // A segment count that agrees with the size.
    rec.segment_crc32c.resize(RemoteSegmentCount(forged, rec.segment_bytes));
    const std::string rkey = RemoteRecordKey("kvt", id);
    OnOwner(rkey, {"SET", rkey, EncodeRemoteRecord(rec)});
    ASSERT_TRUE(DecodeRemoteRecord(EncodeRemoteRecord(rec)).ok()) << "the CRC must hold";
    const uint64_t failures = b_->GetStats().remote.checksum_failures;
    EXPECT_EQ(b_->Read(id).status().code(), absl::StatusCode::kNotFound) << forged;
    EXPECT_EQ(b_->GetStats().remote.checksum_failures, failures + 1) << forged;
    EXPECT_EQ(b_->Locate(id), Tier::kNone) << forged;
    EXPECT_FALSE(RecordExists(id)) << forged;
  }
  EXPECT_EQ(b_->GetStats().remote.hits, 0u);
}

TEST_F(RemoteTierTest, AnotherLayoutUnderTheSameNamespaceIsAMiss) {
  a_ = Open(Options(dir_a_.path(), WriteMode::kWriteBack));
  // Same namespace id and chunk size, another model: its chunks must not be used.
  b_ = Open(Options(dir_b_.path(), WriteMode::kRamOnly), SmallLayout("test/other-model"));
  const ChunkId id = Id(7);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  EXPECT_EQ(b_->Read(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->GetStats().remote.foreign, 1u);
  EXPECT_TRUE(RecordExists(id));  // Not corrupt: the other layout's readers still use it.
}

TEST_F(RemoteTierTest, DeleteAndClearReachTheCluster) {
  OpenBoth();
  for (uint64_t n = 10; n < 14; ++n) ASSERT_TRUE(Put(a_.get(), Id(n)).ok());
  a_->WaitForRemoteWrites();
  auto deleted = a_->Delete(Id(10));
  ASSERT_TRUE(deleted.ok());
  EXPECT_TRUE(*deleted);
  EXPECT_FALSE(RecordExists(Id(10)));
  EXPECT_EQ(b_->Read(Id(10)).status().code(), absl::StatusCode::kNotFound);
  auto cleared = a_->Clear(kNs);
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, 3u);
  for (uint64_t n = 11; n < 14; ++n) {
    EXPECT_EQ(b_->Read(Id(n)).status().code(), absl::StatusCode::kNotFound) << n;
  }
  // Records and segments alike are gone from every master.
  long long keys = 0;
  for (int i = 0; i < cluster_->size(); ++i) {
    auto role = cluster_->Call(i, {"ROLE"});
    ASSERT_TRUE(role.ok());
    if (ReplyString(*(*role)->element[0]) != "master") continue;
    keys += (*cluster_->Call(i, {"DBSIZE"}))->integer;
  }
  EXPECT_EQ(keys, 0);
}

// A node that answers a read with an error reply (here an ACL refusal, "-NOPERM"; in
// the field also "-ERR max number of clients reached") has not shown the chunk to be
// corrupt: the read fails as on a timeout (counted as failed; the tier goes degraded)
// and the record stays for every other daemon. Both reads once deleted a valid record
// and counted it corrupt: a segment GET's error reply was "the wrong size", a record
// GET's "not a string".
TEST_F(RemoteTierTest, AnErrorReplyIsAFailedReadNotCorruption) {
  auto writer = OpenTier();
  ASSERT_NE(writer, nullptr);
  auto owner = [&](const ChunkId& id) {
    auto m = cluster_->MasterOf(RedisHashSlot(RemoteRecordKey("kvt", id)));
    EXPECT_TRUE(m.ok());
    return m.ok() ? *m : -1;
  };
  // Node `refusing` will refuse the readers' user every key. One chunk's record lives
  // there; another's elsewhere (its segments, spread over every master, have some there).
  const int refusing = owner(Id(1));
  ChunkId elsewhere = Id(2);
  for (uint64_t n = 3; owner(elsewhere) == refusing && n < 200; ++n) elsewhere = Id(n);
  ASSERT_NE(owner(elsewhere), refusing);
  ASSERT_TRUE(WriteChunk(*writer, Id(1)).ok());
  ASSERT_TRUE(WriteChunk(*writer, elsewhere).ok());

  auto acl = [&](int node, std::vector<std::string> argv) {
    auto r = cluster_->Call(node, argv);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_FALSE(IsErrorReply(**r)) << ReplyString(**r);
  };
  absl::Cleanup drop_user = [&] {
    for (int i = 0; i < cluster_->size(); ++i) (void)cluster_->Call(i, {"ACL", "DELUSER", "reader"});
  };
  for (int i = 0; i < cluster_->size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(acl(i, {"ACL", "SETUSER", "reader", "on", "nopass", "allcommands", "allkeys"}));
  }
  ASSERT_NO_FATAL_FAILURE(acl(refusing, {"ACL", "SETUSER", "reader", "resetkeys"}));
  RemoteTierOptions o = TierOptions();
  o.cluster.auth = {"reader", "any"};

  // The record GET.
  auto reader = OpenTier(o);
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(reader->ReadRecord(Id(1), RemoteLayout{kFingerprint, 0}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(reader->GetStats().checksum_failures, 0u);
  EXPECT_EQ(reader->GetStats().read_failures, 1u);
  EXPECT_TRUE(reader->degraded());
  // The segment GETs.
  auto reader2 = OpenTier(o);
  ASSERT_NE(reader2, nullptr);
  EXPECT_EQ(ReadChunk(*reader2, elsewhere).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(reader2->GetStats().checksum_failures, 0u);
  EXPECT_EQ(reader2->GetStats().read_failures, 1u);
  EXPECT_TRUE(reader2->degraded());

  EXPECT_TRUE(RecordExists(Id(1)));
  EXPECT_TRUE(RecordExists(elsewhere));
  auto reader3 = OpenTier();  // The default user: every key.
  ASSERT_NE(reader3, nullptr);
  for (const ChunkId& id : {Id(1), elsewhere}) {
    auto got = ReadChunk(*reader3, id);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == Payload(id, kMiB));
  }
}

// A record whose segments are gone (evicted, a master flushed or restarted empty) is
// removed by the reader that finds it torn, so the chunk can be shared again: before,
// every Lookup still said TIER_REMOTE, every read missed, and a writer skipped the chunk
// as present until the record expired (remote_ttl).
// Redis closes idle clients (its `timeout`, a cloud proxy's idle close, a restart): a
// pooled connection's next command meets EOF before any reply. That is no failure of
// the node: the commands go again on a new connection, and the tier stays healthy.
TEST_F(RemoteTierTest, ConnectionsClosedWhileIdleDoNotFailReadsOrWrites) {
  auto tier = OpenTier();
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(WriteChunk(*tier, Id(1)).ok());
  ASSERT_TRUE(tier->ReadRecord(Id(1), RemoteLayout{kFingerprint, 0}).ok());
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections());
  auto record = tier->ReadRecord(Id(1), RemoteLayout{kFingerprint, 0});
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_FALSE(tier->degraded());
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections());
  auto read = ReadChunk(*tier, Id(1));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(*read == Payload(Id(1), kMiB));
  ASSERT_NO_FATAL_FAILURE(CloseClientConnections());
  EXPECT_TRUE(WriteChunk(*tier, Id(2)).ok());
  const RemoteTierStats s = tier->GetStats();
  EXPECT_FALSE(s.degraded);
  EXPECT_EQ(s.degradations, 0u);
  EXPECT_EQ(s.read_failures, 0u);
  EXPECT_EQ(s.write_failures, 0u);
  EXPECT_EQ(s.writes, 2u);
  EXPECT_EQ(s.cluster.io_failures, 0u);
}

TEST_F(RemoteTierTest, ATornRecordIsRemovedSoTheChunkCanBeSharedAgain) {
  OpenBoth();
  const ChunkId id = Id(8);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  const RemoteRecord rec = Record(id);
  const std::string skey = RemoteSegmentKey("kvt", id, rec.generation, 9);
  OnOwner(skey, {"DEL", skey});
  EXPECT_EQ(b_->Read(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->GetStats().remote.torn, 1u);
  EXPECT_EQ(b_->GetStats().remote.torn_removed, 1u);
  EXPECT_FALSE(RecordExists(id));
  const ChunkId ids[] = {id};
  EXPECT_EQ(b_->LocateMany(ids), std::vector<Tier>{Tier::kNone});
  EXPECT_EQ(KeysOnMasters(), 0) << "the torn generation's other segments stay behind";

  // A daemon that computed the chunk again shares it again.
  auto c = Open(Options(dir_c_.path(), WriteMode::kRamOnly));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(Put(c.get(), id).ok());
  c->WaitForRemoteWrites();
  EXPECT_EQ(c->GetStats().remote.writes, 1u);
  EXPECT_EQ(c->GetStats().remote.writes_present, 0u);
  auto view = b_->Read(id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->tier(), Tier::kRemote);
  EXPECT_EQ(ReadAll(*view), Payload(id, kMiB));
}

// The reader removes the record it read, never a newer one: here the chunk was stored
// again (another generation) between the reader's record GET and its segment GETs.
TEST_F(RemoteTierTest, ATornReadKeepsANewerRecord) {
  auto writer = OpenTier();
  auto reader = OpenTier();
  ASSERT_NE(writer, nullptr);
  ASSERT_NE(reader, nullptr);
  const ChunkId id = Id(9);
  ASSERT_TRUE(WriteChunk(*writer, id).ok());
  auto old_record = reader->ReadRecord(id, RemoteLayout{kFingerprint, 0});
  ASSERT_TRUE(old_record.ok()) << old_record.status();
  const std::string rkey = RemoteRecordKey("kvt", id);
  OnOwner(rkey, {"DEL", rkey});  // Expired, say; then written again.
  ASSERT_TRUE(WriteChunk(*writer, id).ok());
  ASSERT_NE(Record(id).generation, old_record->generation);
  const std::string skey = RemoteSegmentKey("kvt", id, old_record->generation, 0);
  OnOwner(skey, {"DEL", skey});

  std::string out(old_record->meta.size, '\0');
  StringSink sink(&out);
  EXPECT_EQ(reader->ReadPayload(id, *old_record, sink).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reader->GetStats().torn, 1u);
  EXPECT_EQ(reader->GetStats().torn_removed, 0u);
  EXPECT_TRUE(RecordExists(id));
  auto got = ReadChunk(*reader, id);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == Payload(id, kMiB));
}

// A Delete or Clear overtakes the chunks' shared-tier writes: one still queued is
// dropped, and one whose commit was on its way when the Delete ran removes its own
// record once committed. Before, both were committed after the Delete returned, and
// every daemon (the deleting one too) read the deleted chunks back from the cluster.
// Holds the first shared-tier write just before its commit (RemoteTierOptions::
// before_commit) until release, or until it goes out of scope.
// The hook shares its state: the store that calls it may outlive this (a test that
// stops early leaves writes queued).
struct FirstCommitHeld {
  struct State {
    absl::Notification reached, release;
    std::atomic<bool> first{true};
  };
  std::shared_ptr<State> state = std::make_shared<State>();
  absl::Notification& reached = state->reached;
  absl::Notification& release = state->release;
  std::function<void(const ChunkId&)> Hook() {
    return [state = state](const ChunkId&) {
      if (!state->first.exchange(false)) return;
      state->reached.Notify();
      state->release.WaitForNotification();
    };
  }
  ~FirstCommitHeld() {
    if (!release.HasBeenNotified()) release.Notify();
  }
};

// Runs a Delete or Clear on a thread of its own while a write is held before its commit
// (FirstCommitHeld), and releases the write once the Delete or Clear waits for it
// (RemoteTierOptions::cancel_waits) or has returned without waiting. Records, at the
// write's commit (after_commit), whether the Delete or Clear had returned already.
struct RunAgainstAHeldWrite {
  struct State {
    absl::Mutex mu;
    bool waiting ABSL_GUARDED_BY(mu) = false;
    bool returned ABSL_GUARDED_BY(mu) = false;
    std::optional<bool> returned_at_commit ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<State> state = std::make_shared<State>();

  void Hook(RemoteTierOptions& o) {
    o.cancel_waits = [state = state](const ChunkId&) {
      absl::MutexLock l(&state->mu);
      state->waiting = true;
    };
    o.after_commit = [state = state](const ChunkId&) {
      absl::MutexLock l(&state->mu);
      if (!state->returned_at_commit.has_value()) state->returned_at_commit = state->returned;
    };
  }
  void Run(FirstCommitHeld& held, const std::function<void()>& op) {
    std::thread t([&] {
      op();
      absl::MutexLock l(&state->mu);
      state->returned = true;
    });
    {
      absl::MutexLock l(&state->mu);
      state->mu.Await(absl::Condition(
          +[](State* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->waiting || s->returned; },
          state.get()));
    }
    held.release.Notify();
    t.join();
  }
  std::optional<bool> returned_at_commit() {
    absl::MutexLock l(&state->mu);
    return state->returned_at_commit;
  }
};

// Once `held` holds the write of `id` on `store`, deletes the chunk on a thread of its
// own (`run`), which releases the write as the Delete waits for it.
void DeleteWhileItsWriteIsHeld(TieredStore* store, const ChunkId& id, FirstCommitHeld& held,
                               RunAgainstAHeldWrite& run) {
  held.reached.WaitForNotification();
  run.Run(held, [&] {
    auto deleted = store->Delete(id);
    ASSERT_TRUE(deleted.ok()) << deleted.status();
    EXPECT_TRUE(*deleted);
  });
}

class RemoteTierCancelTest : public RemoteTierTest, public ::testing::WithParamInterface<bool> {};

TEST_P(RemoteTierCancelTest, DeleteOrClearCancelsWritesQueuedOrInFlight) {
  const bool clear = GetParam();
  TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kRamOnly);
  o.remote.write_threads = 1;  // The second chunk's write waits behind the first.
  FirstCommitHeld held;
  o.remote.before_commit = held.Hook();
  RunAgainstAHeldWrite run;
  run.Hook(o.remote);
  a_ = Open(o);
  b_ = Open(Options(dir_b_.path(), WriteMode::kRamOnly));
  ASSERT_NE(a_, nullptr);
  ASSERT_NE(b_, nullptr);
  ASSERT_TRUE(Put(a_.get(), Id(1)).ok());
  held.reached.WaitForNotification();  // Id(1)'s segments are in; its commit is next.
  ASSERT_TRUE(Put(a_.get(), Id(2)).ok());  // Queued.
  run.Run(held, [&] {
    if (clear) {
      auto cleared = a_->Clear(kNs);
      ASSERT_TRUE(cleared.ok()) << cleared.status();
      EXPECT_EQ(*cleared, 2u);  // The local copies; the write removed its own record.
    } else {
      for (uint64_t n : {2, 1}) {
        auto deleted = a_->Delete(Id(n));
        ASSERT_TRUE(deleted.ok()) << deleted.status();
        EXPECT_TRUE(*deleted) << n;
      }
    }
  });
  // The Delete or Clear waited for the write on its way to end: its commit landed
  // first, and the record was gone again when the Delete or Clear returned.
  EXPECT_EQ(run.returned_at_commit(), std::optional<bool>(false));
  EXPECT_FALSE(RecordExists(Id(1)));
  a_->WaitForRemoteWrites();
  EXPECT_FALSE(RecordExists(Id(1)));
  EXPECT_FALSE(RecordExists(Id(2)));
  EXPECT_EQ(KeysOnMasters(), 0);
  const ChunkId ids[] = {Id(1), Id(2)};
  EXPECT_EQ(b_->LocateMany(ids), (std::vector<Tier>{Tier::kNone, Tier::kNone}));
  EXPECT_EQ(a_->LocateMany(ids), (std::vector<Tier>{Tier::kNone, Tier::kNone}));
  const RemoteTierStats s = a_->GetStats().remote;
  EXPECT_EQ(s.writes_cancelled, 2u);
  EXPECT_EQ(s.writes, 0u);
}

// A Delete that lands between a Put storing the chunk in RAM and queueing its shared-tier
// write: the write is not queued (the Delete's generation is on the chunk's stripe).
// Before, it was queued after the Delete had cancelled what was queued, and the deleted
// chunk came back from the cluster for every daemon.
class SharedWriteRaceTest : public RemoteTierTest {
 protected:
  // Opens a_ with Puts held between storing a chunk locally and queueing its shared
  // write, and starts a Put of Id(1) on its own thread, returning once it is held.
  void PutHeldBeforeItsSharedWrite() {
    TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kRamOnly);
    o.before_shared_write = [state = held_.state](const ChunkId&) {
      state->reached.Notify();
      state->release.WaitForNotification();
    };
    a_ = Open(o);
    ASSERT_NE(a_, nullptr);
    putter_ = std::thread([this] { put_ = Put(a_.get(), Id(1)); });
    held_.reached.WaitForNotification();  // Id(1) is in RAM; its shared write is next.
  }
  void ReleasePut() {
    held_.release.Notify();
    putter_.join();
  }
  void TearDown() override {
    if (putter_.joinable()) ReleasePut();
    RemoteTierTest::TearDown();
  }

  FirstCommitHeld held_;
  std::thread putter_;
  absl::Status put_;
};

// A Delete that lands between a Put storing the chunk in RAM and queueing its shared-tier
// write: the write is not queued (the Delete's generation is on the chunk's stripe).
// Before, it was queued after the Delete had cancelled what was queued, and the deleted
// chunk came back from the cluster for every daemon.
TEST_F(SharedWriteRaceTest, ADeleteBetweenAPutsStoreAndItsSharedWriteKeepsItDeleted) {
  ASSERT_NO_FATAL_FAILURE(PutHeldBeforeItsSharedWrite());
  auto deleted = a_->Delete(Id(1));
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_TRUE(*deleted);
  ReleasePut();
  ASSERT_TRUE(put_.ok()) << put_;
  a_->WaitForRemoteWrites();
  EXPECT_FALSE(RecordExists(Id(1)));
  EXPECT_EQ(KeysOnMasters(), 0);
}

// A Delete of another chunk, or a Clear of another namespace, in the same window bumps
// the chunk's stripe too, but leaves the chunk: its shared write still goes. Before, it
// was dropped silently, and the chunk never reached the shared tier.
TEST_F(SharedWriteRaceTest, AnotherChunksDeleteOrClearInThatWindowStillSharesIt) {
  ASSERT_NO_FATAL_FAILURE(PutHeldBeforeItsSharedWrite());
  auto deleted = a_->Delete(Id(2));  // Not stored: its stripe is bumped all the same.
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  auto cleared = a_->Clear(kNs + 1);  // Every stripe.
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  ReleasePut();
  ASSERT_TRUE(put_.ok()) << put_;
  a_->WaitForRemoteWrites();
  EXPECT_TRUE(RecordExists(Id(1)));
  EXPECT_EQ(a_->GetStats().remote.writes, 1u);
}

// A read of the shared copy that starts once the Delete has removed the local copies,
// and before it removes the shared one, is served, but does not promote the chunk into
// RAM. It once did (its generation was noted after the Delete's bump): the chunk was
// back in RAM after the Delete returned, served to every Get, and a Put of its key
// answered "already present" and stored nothing.
TEST_F(RemoteTierTest, AReadDuringADeletesSharedPhaseDoesNotBringTheChunkBack) {
  b_ = Open(Options(dir_b_.path(), WriteMode::kRamOnly));
  ASSERT_NE(b_, nullptr);
  ASSERT_TRUE(Put(b_.get(), Id(1)).ok());
  b_->WaitForRemoteWrites();
  ASSERT_TRUE(RecordExists(Id(1)));
  TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kRamOnly);
  absl::Status read_in_window = absl::UnknownError("the sync point never ran");
  TieredStore* store = nullptr;
  o.before_shared_delete = [&](const ChunkId& id) {
    absl::StatusOr<ChunkView> v = store->Read(id);
    read_in_window = v.status();
    if (v.ok()) { EXPECT_EQ(v->tier(), Tier::kRemote); }
  };
  a_ = Open(o);
  ASSERT_NE(a_, nullptr);
  store = a_.get();
  auto deleted = a_->Delete(Id(1));
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_TRUE(*deleted);
  EXPECT_TRUE(read_in_window.ok()) << read_in_window;
  EXPECT_EQ(a_->Locate(Id(1)), Tier::kNone);
  EXPECT_EQ(a_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(RecordExists(Id(1)));
  EXPECT_EQ(a_->GetStats().remote_promotions, 0u);
}

// A cluster whose ACL refuses EVAL (managed services often do): a write whose commit
// was on its way when the Delete ran still removes its own record, by a plain DEL. The
// compare-and-delete's error reply once left the record, and the deleted chunk came back
// from the cluster.
TEST_F(RemoteTierTest, WithoutEvalACancelledWriteStillRemovesItsRecord) {
  absl::Cleanup drop_user = [&] {
    for (int i = 0; i < cluster_->size(); ++i) (void)cluster_->Call(i, {"ACL", "DELUSER", "noeval"});
  };
  for (int i = 0; i < cluster_->size(); ++i) {
    auto r = cluster_->Call(i, {"ACL", "SETUSER", "noeval", "on", "nopass", "allcommands",
                                "-eval", "-evalsha", "allkeys"});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_FALSE(IsErrorReply(**r)) << ReplyString(**r);
  }
  TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kRamOnly);
  o.remote.cluster.auth = {"noeval", "any"};
  o.remote.write_threads = 1;
  FirstCommitHeld held;
  o.remote.before_commit = held.Hook();
  RunAgainstAHeldWrite run;
  run.Hook(o.remote);
  a_ = Open(o);
  ASSERT_NE(a_, nullptr);
  ASSERT_TRUE(Put(a_.get(), Id(1)).ok());
  DeleteWhileItsWriteIsHeld(a_.get(), Id(1), held, run);
  a_->WaitForRemoteWrites();
  EXPECT_FALSE(RecordExists(Id(1)));
  EXPECT_EQ(KeysOnMasters(), 0);
  EXPECT_EQ(a_->GetStats().remote.eval_refusals, 1u);
}

// A Delete that lands while a write's segments travel stops the rest: the write checks
// between batches, removes the segments it sent, and commits nothing.
TEST_F(RemoteTierTest, ADeleteBetweenSegmentBatchesStopsTheRestOfTheWrite) {
  TieredStoreOptions o = Options(dir_a_.path(), WriteMode::kRamOnly);
  o.remote.write_threads = 1;
  o.remote.batch_bytes = 128 << 10;  // Two segments a batch: eight batches a chunk.
  FirstCommitHeld held;              // Here: held after its first batch.
  auto batches = std::make_shared<std::atomic<int>>(0);
  o.remote.after_segment_batch = [batches, hold = held.Hook()](const ChunkId& id) {
    batches->fetch_add(1);
    hold(id);
  };
  RunAgainstAHeldWrite run;
  run.Hook(o.remote);
  a_ = Open(o);
  ASSERT_NE(a_, nullptr);
  ASSERT_TRUE(Put(a_.get(), Id(1)).ok());
  DeleteWhileItsWriteIsHeld(a_.get(), Id(1), held, run);
  a_->WaitForRemoteWrites();
  EXPECT_EQ(batches->load(), 1);  // Not the seven after it.
  EXPECT_EQ(run.returned_at_commit(), std::nullopt);  // No commit record was sent.
  EXPECT_FALSE(RecordExists(Id(1)));
  EXPECT_EQ(KeysOnMasters(), 0);  // The first batch's segments went too.
  const RemoteTierStats s = a_->GetStats().remote;
  EXPECT_EQ(s.writes_cancelled, 1u);
  EXPECT_EQ(s.writes, 0u);
}

INSTANTIATE_TEST_SUITE_P(DeleteAndClear, RemoteTierCancelTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Clear" : "Delete"; });

// Clusters of their own: these tests fill one and kill one.
class RemoteTierFaultTest : public RemoteTierTest {
 protected:
  static void SetUpTestSuite() {}
  static void TearDownTestSuite() {}
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    if (!RedisClusterProcess::Available()) GTEST_SKIP() << "redis-server not installed";
  }
  void StartCluster(RedisClusterSpec spec) {
    auto c = RedisClusterProcess::Start(std::move(spec));
    ASSERT_TRUE(c.ok()) << c.status();
    own_ = *std::move(c);
    cluster_ = own_.get();
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
  }
  // Stores, through a_, one chunk whose record lives on node 0 and one whose record
  // lives elsewhere, then kills node 0. Returns their numbers (Id(n)).
  void PutOnTheDeadNodeAndALiveOne(uint64_t* on_dead, uint64_t* on_live) {
    *on_dead = *on_live = 0;
    for (uint64_t n = 1; n < 200 && (*on_dead == 0 || *on_live == 0); ++n) {
      auto m = cluster_->MasterOf(RedisHashSlot(RemoteRecordKey("kvt", Id(n))));
      ASSERT_TRUE(m.ok()) << m.status();
      if (*m == 0 && *on_dead == 0) *on_dead = n;
      if (*m > 0 && *on_live == 0) *on_live = n;
    }
    ASSERT_NE(*on_dead, 0u);
    ASSERT_NE(*on_live, 0u);
    ASSERT_TRUE(Put(a_.get(), Id(*on_dead)).ok());
    ASSERT_TRUE(Put(a_.get(), Id(*on_live)).ok());
    a_->WaitForRemoteWrites();
    cluster_->Kill(0);
  }
  std::unique_ptr<RedisClusterProcess> own_;
};

TEST_F(RemoteTierFaultTest, AFullClusterDropsWritesNotPuts) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  spec.extra_args = {"--maxmemory", "3mb", "--maxmemory-policy", "noeviction"};
  StartCluster(spec);
  OpenBoth();
  for (uint64_t n = 0; n < 12; ++n) {
    ASSERT_TRUE(Put(a_.get(), Id(n)).ok()) << n;
    a_->WaitForRemoteWrites();
  }
  const RemoteTierStats s = a_->GetStats().remote;
  EXPECT_GE(s.writes_full, 1u);
  EXPECT_GE(s.writes, 1u);
  EXPECT_FALSE(s.degraded);  // Full is not down.
  for (uint64_t n = 0; n < 12; ++n) {
    auto view = a_->Read(Id(n));
    ASSERT_TRUE(view.ok()) << n;
    EXPECT_EQ(ReadAll(*view), Payload(Id(n), kMiB));
  }
  // What did get written reads back whole on the other store; the rest misses.
  uint64_t served = 0;
  for (uint64_t n = 0; n < 12; ++n) {
    auto view = b_->Read(Id(n));
    if (!view.ok()) continue;
    ++served;
    EXPECT_EQ(ReadAll(*view), Payload(Id(n), kMiB));
  }
  EXPECT_EQ(served, s.writes);
}

TEST_F(RemoteTierFaultTest, ANodeDownKeepsTheTierDegradedThoughOthersAnswer) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  StartCluster(spec);
  OpenBoth();
  uint64_t on_dead, on_live;
  ASSERT_NO_FATAL_FAILURE(PutOnTheDeadNodeAndALiveOne(&on_dead, &on_live));

  // The live node answers and the dead one does not: the tier is degraded, and stays
  // so (an answer from another node in the same batch does not clear it).
  const ChunkId ids[] = {Id(on_dead), Id(on_live)};
  (void)b_->LocateMany(ids);
  EXPECT_TRUE(b_->GetStats().remote.degraded);
  EXPECT_EQ(b_->GetStats().remote.degradations, 1u);
}

// With one master down (no replica to take over, and the others serving on without
// full coverage), a probe that reaches a live node only does not end degraded mode:
// every chunk has segments on every master, so each read would wait on the dead one
// again. The probe PINGs every master; it fails, and the backoff grows.
TEST_F(RemoteTierFaultTest, OneLiveNodeAnsweringDoesNotEndDegradedMode) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  spec.extra_args = {"--cluster-require-full-coverage", "no"};
  StartCluster(spec);
  OpenBoth();
  uint64_t on_dead, on_live;
  ASSERT_NO_FATAL_FAILURE(PutOnTheDeadNodeAndALiveOne(&on_dead, &on_live));

  const ChunkId both[] = {Id(on_dead), Id(on_live)};
  (void)b_->LocateMany(both);
  ASSERT_TRUE(b_->GetStats().remote.degraded);
  ASSERT_EQ(b_->GetStats().remote.degradations, 1u);

  // The backoff passes: the next call probes. Its own key lives on a live master, which
  // would answer; the dead one does not, so the tier stays degraded.
  clock_.Advance(absl::Milliseconds(100));
  const ChunkId live[] = {Id(on_live)};
  EXPECT_EQ(b_->LocateMany(live), std::vector<Tier>{Tier::kNone});
  RemoteTierStats s = b_->GetStats().remote;
  EXPECT_TRUE(s.degraded);
  EXPECT_EQ(s.degradations, 1u);

  // So a read of that chunk misses at once rather than fetching segments from the dead
  // node; and the failed probe doubled the backoff (200 ms), so none is due yet.
  const uint64_t io_failures = s.cluster.io_failures;
  const uint64_t read_failures = s.read_failures;
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(b_->Read(Id(on_live)).status().code(), absl::StatusCode::kNotFound);
  (void)b_->LocateMany(live);
  s = b_->GetStats().remote;
  EXPECT_TRUE(s.degraded);
  EXPECT_EQ(s.degradations, 1u);
  EXPECT_EQ(s.read_failures, read_failures);
  EXPECT_EQ(s.cluster.io_failures, io_failures) << "a probe ran within the doubled backoff";

  // Past it, with the node back (empty: persistence is off), the probe reaches every
  // master and the record on the live one is found.
  ASSERT_TRUE(cluster_->Restart(0).ok());
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(b_->LocateMany(live), std::vector<Tier>{Tier::kRemote});
  EXPECT_FALSE(b_->GetStats().remote.degraded);
  EXPECT_EQ(b_->GetStats().remote.degradations, 1u);
}

// A node that fails mid-fetch: the groups after the one that met it miss at once
// instead of each waiting out remote_timeout on it (every chunk has segments on every
// master), and a Delete while degraded leaves the remote copy to expire instead of
// waiting on the cluster key by key.
TEST_F(RemoteTierFaultTest, AFetchStopsAtTheGroupANodeFailedAndDeletesDoNotWait) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  StartCluster(spec);
  a_ = Open(Options(dir_a_.path(), WriteMode::kWriteBack));
  TieredStoreOptions ob = Options(dir_b_.path(), WriteMode::kRamOnly);
  ob.remote.batch_bytes = 2 * kMiB;  // Groups of two chunks: three below.
  b_ = Open(ob);
  ASSERT_NE(a_, nullptr);
  ASSERT_NE(b_, nullptr);
  // Six chunks whose records live on nodes 1 and 2, so that reading them succeeds.
  std::vector<ChunkId> ids;
  for (uint64_t n = 1; n < 500 && ids.size() < 6; ++n) {
    auto m = cluster_->MasterOf(RedisHashSlot(RemoteRecordKey("kvt", Id(n))));
    ASSERT_TRUE(m.ok());
    if (*m != 0) ids.push_back(Id(n));
  }
  ASSERT_EQ(ids.size(), 6u);
  for (const ChunkId& id : ids) ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  cluster_->Kill(0);

  b_->FetchRemoteAsync(ids);
  b_->WaitForRemoteFetches();
  const RemoteTierStats s = b_->GetStats().remote;
  EXPECT_TRUE(s.degraded);
  EXPECT_EQ(s.read_failures, 2u) << "groups after the one that failed were fetched too";
  EXPECT_EQ(s.misses, 4u);
  EXPECT_EQ(s.hits, 0u);
  for (const ChunkId& id : ids) EXPECT_EQ(b_->Locate(id), Tier::kNone);

  // Degraded (the injected clock stands still: no probe is due), B's delete does not
  // reach the cluster, whose live node still holds the record.
  auto deleted = b_->Delete(ids[0]);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_FALSE(*deleted);
  EXPECT_TRUE(RecordExists(ids[0]));
}

TEST_F(RemoteTierFaultTest, ADeadClusterLeavesTheLocalTiersServing) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  StartCluster(spec);
  OpenBoth();
  ASSERT_TRUE(Put(a_.get(), Id(1)).ok());
  a_->WaitForRemoteWrites();
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);

  ASSERT_TRUE(Put(a_.get(), Id(2)).ok());  // The put is unaffected...
  a_->WaitForRemoteWrites();
  EXPECT_TRUE(a_->GetStats().remote.degraded);  // ...its remote write failed.
  EXPECT_EQ(a_->GetStats().remote.degradations, 1u);
  ASSERT_TRUE(Put(a_.get(), Id(3)).ok());
  EXPECT_GE(a_->GetStats().remote.writes_dropped, 1u);  // Degraded: not even queued.
  for (uint64_t n = 1; n <= 3; ++n) {
    auto view = a_->Read(Id(n));
    ASSERT_TRUE(view.ok()) << n;
    EXPECT_EQ(ReadAll(*view), Payload(Id(n), kMiB));
  }
  // The other store misses at once (no wait on a timeout while degraded).
  EXPECT_EQ(b_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->Read(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(b_->GetStats().remote.degraded);
  const ChunkId ids[] = {Id(1)};
  EXPECT_EQ(b_->LocateMany(ids), std::vector<Tier>{Tier::kNone});

  // Every node restarts on its port and cluster state (persistence is off, so the
  // cluster comes back empty).
  for (int i = 0; i < cluster_->size(); ++i) ASSERT_TRUE(cluster_->Restart(i).ok());
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  clock_.Advance(absl::Seconds(11));  // Past the longest backoff: the next call probes.
  ASSERT_TRUE(Put(a_.get(), Id(4)).ok());
  a_->WaitForRemoteWrites();
  EXPECT_FALSE(a_->GetStats().remote.degraded);
  EXPECT_EQ(a_->GetStats().remote.writes, 2u);  // Id(1) before, Id(4) now.
  auto view = b_->Read(Id(4));
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(ReadAll(*view), Payload(Id(4), kMiB));
  EXPECT_FALSE(b_->GetStats().remote.degraded);
}

TEST_F(RemoteTierFaultTest, AChunkTravelsBetweenStoresOverMutualTls) {
  auto certs = testing::MakeRedisTestCerts();
  ASSERT_TRUE(certs.ok()) << certs.status();
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  spec.tls_dir = *certs;
  spec.tls_auth_clients = true;  // The stores must present client-a's certificate.
  StartCluster(spec);
  ASSERT_TRUE(cluster_->ClientTls().enabled);
  OpenBoth();
  const ChunkId id = Id(1);
  ASSERT_TRUE(Put(a_.get(), id).ok());
  a_->WaitForRemoteWrites();
  EXPECT_EQ(a_->GetStats().remote.writes, 1u);
  EXPECT_FALSE(a_->GetStats().remote.degraded);

  EXPECT_EQ(b_->Locate(id), Tier::kNone);
  auto view = b_->Read(id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->tier(), Tier::kRemote);
  EXPECT_EQ(ReadAll(*view), Payload(id, kMiB));
  EXPECT_EQ(b_->GetStats().remote.hits, 1u);
  EXPECT_EQ(b_->GetStats().remote.bytes_read, kMiB);
  EXPECT_TRUE(RecordExists(id));  // Through the harness's own TLS connection.
}

// Clear during a slot migration: a key SCAN finds on the importing master is deleted
// there (DEL routed by the cluster, following ASK), and only keys really deleted count.
// Before, the DEL went to the node SCAN used, without ASKING; its MOVED reply was
// ignored, the record stayed, and Clear reported it deleted.
TEST_F(RemoteTierFaultTest, AClearDuringASlotMigrationDeletesTheKeysThatMoved) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  StartCluster(spec);
  auto tier = OpenTier();
  ASSERT_NE(tier, nullptr);
  const ChunkId id = Id(1);
  const int slot = RedisHashSlot(RemoteRecordKey("kvt", id));
  auto src = cluster_->MasterOf(slot);
  ASSERT_TRUE(src.ok());
  int dst = -1;  // Another master.
  for (int probe : {0, 8000, 16383}) {
    auto m = cluster_->MasterOf(probe);
    if (m.ok() && *m != *src && dst < 0) dst = *m;
  }
  ASSERT_GE(dst, 0);
  auto id_of = [&](int node) { return std::string(ReplyString(**cluster_->Call(node, {"CLUSTER", "MYID"}))); };
  const std::string s = std::to_string(slot);
  ASSERT_TRUE(cluster_->Call(dst, {"CLUSTER", "SETSLOT", s, "IMPORTING", id_of(*src)}).ok());
  ASSERT_TRUE(cluster_->Call(*src, {"CLUSTER", "SETSLOT", s, "MIGRATING", id_of(dst)}).ok());
  ASSERT_TRUE(WriteChunk(*tier, id).ok());  // The record goes to `dst` (ASK).
  ASSERT_EQ((*cluster_->Call(dst, {"CLUSTER", "COUNTKEYSINSLOT", s}))->integer, 1);

  auto cleared = tier->Clear(kNs);
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, 1u);
  EXPECT_EQ((*cluster_->Call(dst, {"CLUSTER", "COUNTKEYSINSLOT", s}))->integer, 0);
  EXPECT_EQ(KeysOnMasters(), 0);
}

// Clear reads the slot map afresh and scans every master in it: here one added (and
// given a slot with a record) after the clearing tier had read its map. Before, Clear
// scanned the masters of its cached map only and reported success, and the record on
// the new master stayed readable by every daemon.
TEST_F(RemoteTierFaultTest, AClearScansAMasterAddedAfterTheMapWasRead) {
  RedisClusterSpec spec;
  spec.replicas_per_master = 0;
  StartCluster(spec);
  auto clearer = OpenTier();
  ASSERT_NE(clearer, nullptr);
  ASSERT_EQ(clearer->GetStats().cluster.masters, 3u);
  auto added = cluster_->AddMaster();
  ASSERT_TRUE(added.ok()) << added.status();
  const ChunkId id = Id(1);
  const std::string rkey = RemoteRecordKey("kvt", id);
  const absl::Status moved = cluster_->MoveEmptySlot(RedisHashSlot(rkey), *added);
  ASSERT_TRUE(moved.ok()) << moved;
  auto writer = OpenTier();  // Its map has the new master.
  ASSERT_NE(writer, nullptr);
  const absl::Status written = WriteChunk(*writer, id);
  ASSERT_TRUE(written.ok()) << written;
  ASSERT_EQ((*cluster_->Call(*added, {"EXISTS", rkey}))->integer, 1);

  auto cleared = clearer->Clear(kNs);
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, 1u);
  EXPECT_EQ((*cluster_->Call(*added, {"EXISTS", rkey}))->integer, 0);
  EXPECT_EQ(KeysOnMasters(), 0);
  EXPECT_EQ(clearer->GetStats().cluster.masters, 4u);
  EXPECT_EQ(ReadChunk(*writer, id).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvtier
