// Integration tests of the same-host data plane: a real kvtierd with a region socket,
// clients registering memfds over it, and Get/Put/Prefill naming registered memory.
// Every bad-input case of the issue has a test here: each gets a clear status, nothing
// partial is reported, and the daemon keeps serving.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/call_cancellation.h"
#include "client/kvtier_client.h"
#include "client/prefill_session.h"
#include "client/region_channel.h"
#include "client/shared_buffer.h"
#include "client/shared_memory_plane.h"
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
using kvtier::PrefillOptions;

constexpr uint64_t kMiB = 1 << 20;

// A sealed, populated memfd of `bytes`, mapped here; closes and unmaps on destruction.
struct Memfd {
  explicit Memfd(uint64_t n, unsigned seals = F_SEAL_SHRINK | F_SEAL_GROW) : bytes(n) {
    fd = memfd_create("test-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(n)), 0);
    if (seals != 0) { EXPECT_EQ(fcntl(fd, F_ADD_SEALS, seals), 0); }
    data = static_cast<char*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_NE(data, MAP_FAILED);
  }
  ~Memfd() {
    if (data != nullptr && data != MAP_FAILED) munmap(data, bytes);
    if (fd >= 0) close(fd);
  }
  uint64_t bytes;
  int fd = -1;
  char* data = nullptr;
};

// Whether every thread of `pid` is stopped (state T in /proc), polled for up to 20 s.
bool AllThreadsStopped(pid_t pid) {
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  for (int i = 0; i < 2000; ++i) {
    bool all = true;
    for (const auto& t : std::filesystem::directory_iterator(tasks)) {
      std::ifstream in(t.path() / "stat");
      std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const size_t paren = stat.rfind(')');  // The state follows the command's ')'.
      if (paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'T') {
        all = false;
        break;
      }
    }
    if (all) return true;
    absl::SleepFor(absl::Milliseconds(10));  // Polls a condition; nothing to wait on.
  }
  return false;
}

// SIGSTOPs a process until destroyed (then SIGCONT). kill() returns before every thread
// has stopped, and a region thread already running could still answer the next request:
// stopped() says all of them reached state T.
class ScopedStop {
 public:
  explicit ScopedStop(pid_t pid) : pid_(pid) {
    stopped_ = kill(pid_, SIGSTOP) == 0 && AllThreadsStopped(pid_);
  }
  ~ScopedStop() { kill(pid_, SIGCONT); }
  ScopedStop(const ScopedStop&) = delete;
  ScopedStop& operator=(const ScopedStop&) = delete;
  bool stopped() const { return stopped_; }

 private:
  const pid_t pid_;
  bool stopped_ = false;
};

class ShmTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> args = {}) {
    data_dir_ = MakeTempDir("kvtierd-shm");
    args.insert(args.begin(), "--shm-socket=auto");
    auto d = DaemonProcess::Start(data_dir_, std::move(args));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    client_ = Connect();
    ASSERT_NE(client_, nullptr);
    ns_ = Register(*client_);
  }

  std::unique_ptr<KvTierClient> Connect(ClientOptions options = {}) {
    auto c = KvTierClient::Connect(daemon_->target(), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  static uint64_t Register(KvTierClient& client, uint32_t mib = 4) {
    auto r = client.RegisterLayout(LayoutOfMiB(mib));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->namespace_id : 0;
  }

  v1::DataPlaneResponse DataPlane() {
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    v1::DataPlaneResponse resp;
    EXPECT_TRUE(client_->stub()->DataPlane(&ctx, v1::DataPlaneRequest(), &resp).ok());
    return resp;
  }

  std::shared_ptr<RegionChannel> Channel() {
    const v1::DataPlaneResponse info = DataPlane();
    auto c = RegionChannel::Connect(info.region_socket(), info.instance_id());
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : nullptr;
  }

  v1::StatsResponse Stats() {
    auto s = client_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::StatsResponse();
  }

  // Waits (bounded) until the daemon holds `n` regions: the region socket notices a
  // closed connection asynchronously, so this polls a condition.
  bool WaitForRegions(uint64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      if (Stats().regions() == n) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  // Puts chunk i (4 MiB pattern) through the client.
  void PutChunk(uint64_t i) {
    const std::string data = PatternBytes(i, 4 * kMiB);
    ChunkToPut c{KeyOf(i), data, 256};
    auto r = client_->Put(ns_, {&c, 1});
    ASSERT_TRUE(r.ok()) << r.status();
  }

  // A Get into registered memory through the raw stub: the status, and the frames.
  grpc::Status RawGet(const v1::GetRequest& req, std::vector<v1::GetFrame>* frames = nullptr) {
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    auto reader = client_->stub()->Get(&ctx, req);
    v1::GetFrame f;
    while (reader->Read(&f)) {
      if (frames) frames->push_back(f);
    }
    return reader->Finish();
  }

  v1::GetRequest GetRequestFor(std::initializer_list<uint64_t> keys, uint64_t region_id,
                               uint64_t token, std::initializer_list<uint64_t> offsets) {
    v1::GetRequest req;
    req.set_namespace_id(ns_);
    for (uint64_t k : keys) req.add_keys(KeyOf(k).ToByteString());
    req.mutable_target()->set_region_id(region_id);
    req.mutable_target()->set_token(token);
    for (uint64_t o : offsets) req.mutable_target()->add_offsets(o);
    return req;
  }

  // A Put of one chunk (key i) named by a region range; returns the status.
  grpc::Status RawPutRegion(uint64_t i, const v1::RegionRef& ref, uint32_t crc,
                            const std::string& data = "") {
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    v1::PutResponse resp;
    auto writer = client_->stub()->Put(&ctx, &resp);
    v1::PutFrame f;
    f.set_namespace_id(ns_);
    f.set_key(KeyOf(i).ToByteString());
    *f.mutable_region() = ref;
    f.set_data(data);
    f.set_crc32c(crc);
    writer->Write(f);
    writer->WritesDone();
    return writer->Finish();
  }

  bool Present(uint64_t i) {
    const ChunkKey k = KeyOf(i);
    auto r = client_->Lookup(ns_, {&k, 1});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && r->prefix_hits == 1;
  }

  std::string data_dir_;
  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> client_;
  uint64_t ns_ = 0;
};

TEST_F(ShmTest, PutAndGetIntoAllocatedMemoryMoveBytesThroughTheRegion) {
  StartDaemon();
  ASSERT_EQ(client_->data_path(), DataPath::kSharedMemory) << client_->data_path_detail();
  auto buf = client_->AllocateShared(16 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  for (uint64_t i = 0; i < 2; ++i) {
    const std::string data = PatternBytes(i, 4 * kMiB);
    std::memcpy((*buf)->data() + i * 4 * kMiB, data.data(), data.size());
  }
  ChunkToPut chunks[2] = {{KeyOf(0), {(*buf)->data(), 4 * kMiB}, 256},
                          {KeyOf(1), {(*buf)->data() + 4 * kMiB, 4 * kMiB}, 256}};
  auto put = client_->Put(ns_, chunks);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 2u);
  EXPECT_EQ(put->bytes, 8 * kMiB);
  EXPECT_EQ(Stats().regions(), 1u);

  const ChunkKey keys[3] = {KeyOf(0), KeyOf(9), KeyOf(1)};  // One absent.
  std::vector<uint32_t> items;
  auto big = client_->AllocateShared(12 * kMiB);
  ASSERT_TRUE(big.ok()) << big.status();
  auto got = client_->GetInto(ns_, keys, {(*big)->data(), 12 * kMiB}, std::nullopt,
                         v1::GET_ORDER_CHUNK_MAJOR, 0,
                         [&](uint32_t k, uint32_t) {
                           items.push_back(k);
                           return absl::OkStatus();
                         });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, DataPath::kSharedMemory);
  EXPECT_EQ(got->found, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(got->tiers[0], v1::TIER_RAM);
  EXPECT_EQ(items, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(std::string((*big)->data(), 4 * kMiB), PatternBytes(0, 4 * kMiB));
  EXPECT_EQ(std::string((*big)->data() + 8 * kMiB, 4 * kMiB), PatternBytes(1, 4 * kMiB));
  EXPECT_EQ(Stats().regions(), 2u);
  buf->reset();
  big->reset();
  EXPECT_EQ(Stats().regions(), 0u);  // Remove is answered before the buffer is gone.
}

TEST_F(ShmTest, LargeChunksMoveExactlyThroughSeveralCopyThreadsAndPutPieces) {
  // 24 MiB chunks: the client puts each as three 8 MiB region frames (checksumming
  // piece k + 1 while the daemon copies piece k), and the daemon copies each piece and
  // each get on four threads (forced: this host may have one core). The bytes and the
  // CRC32C must come out exactly as a single-threaded copy's, and a wrong CRC32C on
  // the last piece must still store nothing.
  StartDaemon({"--shm-copy-threads=4"});
  const uint64_t ns = Register(*client_, 24);
  const uint64_t chunk = 24 * kMiB;
  auto buf = client_->AllocateShared(3 * chunk);
  ASSERT_TRUE(buf.ok()) << buf.status();
  for (uint64_t i = 0; i < 2; ++i) {
    const std::string data = PatternBytes(100 + i, chunk);
    std::memcpy((*buf)->data() + i * chunk, data.data(), chunk);
  }
  ChunkToPut chunks[2] = {{KeyOf(100), {(*buf)->data(), chunk}, 256},
                          {KeyOf(101), {(*buf)->data() + chunk, chunk}, 256}};
  auto put = client_->Put(ns, chunks);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 2u);
  EXPECT_EQ(put->bytes, 2 * chunk);

  // Read back over the gRPC stream (the client checks each chunk's CRC32C) and into
  // registered memory (the daemon checks it as it copies).
  ClientOptions streamed;
  streamed.data_plane = ClientOptions::DataPlane::kStream;
  auto other = Connect(streamed);
  ASSERT_NE(other, nullptr);
  const ChunkKey keys[2] = {KeyOf(100), KeyOf(101)};
  auto got = other->Get(ns, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  for (uint64_t i = 0; i < 2; ++i) {
    EXPECT_TRUE((*got)[i].crc_verified);
    EXPECT_TRUE((*got)[i].data == PatternBytes(100 + i, chunk)) << i;
  }
  std::memset((*buf)->data(), 0, 3 * chunk);
  auto into = client_->GetInto(ns, keys, {(*buf)->data(), 2 * chunk});
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_EQ(into->path, DataPath::kSharedMemory);
  for (uint64_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(std::string((*buf)->data() + i * chunk, chunk) == PatternBytes(100 + i, chunk));
  }

  // Pieces sent by hand: a region put in three frames whose CRC32C is wrong stores
  // nothing, and the same frames with the right one store the chunk.
  const std::string data = PatternBytes(102, chunk);
  std::memcpy((*buf)->data() + 2 * chunk, data.data(), chunk);
  for (const uint32_t crc : {crc32c::Value(data) ^ 1, crc32c::Value(data)}) {
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    v1::PutResponse resp;
    auto writer = client_->stub()->Put(&ctx, &resp);
    for (uint64_t off = 0; off < chunk; off += 8 * kMiB) {
      v1::PutFrame f;
      f.set_namespace_id(ns);
      f.set_key(KeyOf(102).ToByteString());
      f.set_token_count(256);
      f.set_offset(off);
      f.mutable_region()->set_region_id((*buf)->region_id());
      f.mutable_region()->set_token((*buf)->token());
      f.mutable_region()->set_offset(2 * chunk + off);
      f.mutable_region()->set_length(8 * kMiB);
      if (off + 8 * kMiB == chunk) f.set_crc32c(crc);
      if (!writer->Write(f)) break;
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    if (crc != crc32c::Value(data)) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      auto look = other->Get(ns, std::vector<ChunkKey>{KeyOf(102)});
      ASSERT_TRUE(look.ok()) << look.status();
      EXPECT_FALSE((*look)[0].found);
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.chunks_stored(), 1u);
      auto look = other->Get(ns, std::vector<ChunkKey>{KeyOf(102)});
      ASSERT_TRUE(look.ok()) << look.status();
      ASSERT_TRUE((*look)[0].found);
      EXPECT_TRUE((*look)[0].data == data);
    }
  }
}

TEST_F(ShmTest, TransparentForTheCallersOwnMemory) {
  StartDaemon();
  for (uint64_t i = 0; i < 3; ++i) PutChunk(i);  // From std::string: staged.
  const ChunkKey keys[3] = {KeyOf(0), KeyOf(1), KeyOf(2)};
  auto got = client_->Get(ns_, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE((*got)[i].found);
    EXPECT_TRUE((*got)[i].crc_verified);
    EXPECT_EQ((*got)[i].data, PatternBytes(i, 4 * kMiB));
  }
  // A layer range, chunk-major and layer-major.
  for (v1::GetOrder order : {v1::GET_ORDER_CHUNK_MAJOR, v1::GET_ORDER_LAYER_MAJOR}) {
    auto part = client_->Get(ns_, keys, LayerRange{1, 3}, nullptr, order);
    ASSERT_TRUE(part.ok()) << part.status();
    for (uint64_t i = 0; i < 3; ++i) {
      EXPECT_EQ((*part)[i].data, PatternBytes(i, 4 * kMiB).substr(kMiB, 2 * kMiB)) << i;
    }
  }
  // Layer-major GetInto the caller's memory: items per (key, layer), in layer order.
  std::string out(12 * kMiB, '\0');
  std::vector<std::pair<uint32_t, uint32_t>> items;
  auto into = client_->GetInto(ns_, keys, absl::MakeSpan(out), std::nullopt,
                               v1::GET_ORDER_LAYER_MAJOR, 0,
                               [&](uint32_t k, uint32_t l) {
                                 items.emplace_back(k, l);
                                 return absl::OkStatus();
                               });
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_EQ(into->path, DataPath::kSharedMemory);
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(out.substr(i * 4 * kMiB, 4 * kMiB), PatternBytes(i, 4 * kMiB)) << i;
  }
  ASSERT_EQ(items.size(), 12u);
  EXPECT_EQ(items[0], std::make_pair(0u, 0u));
  EXPECT_EQ(items[3], std::make_pair(0u, 1u));
  EXPECT_EQ(items[11], std::make_pair(2u, 3u));
}

TEST_F(ShmTest, LayerMajorIntoRegisteredMemoryAnnouncesEachPieceInPlace) {
  StartDaemon();
  for (uint64_t i = 0; i < 2; ++i) PutChunk(i);
  auto buf = client_->AllocateShared(8 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const ChunkKey keys[2] = {KeyOf(0), KeyOf(1)};
  std::vector<std::pair<uint32_t, uint32_t>> items;
  auto got = client_->GetInto(ns_, keys, {(*buf)->data(), 8 * kMiB}, std::nullopt,
                              v1::GET_ORDER_LAYER_MAJOR, 0, [&](uint32_t k, uint32_t l) {
                                // The piece is in place when it is announced.
                                const std::string want =
                                    PatternBytes(k, 4 * kMiB).substr(l * kMiB, kMiB);
                                EXPECT_EQ(std::string((*buf)->data() + k * 4 * kMiB + l * kMiB,
                                                      kMiB),
                                          want);
                                items.emplace_back(k, l);
                                return absl::OkStatus();
                              });
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(items.size(), 8u);
  EXPECT_EQ(items[1], std::make_pair(1u, 0u));
  EXPECT_EQ(items[2], std::make_pair(0u, 1u));
}

TEST_F(ShmTest, PrefillCopiesStreamedChunksIntoTheRegion) {
  StartDaemon();
  for (uint64_t i = 0; i < 3; ++i) PutChunk(i);
  auto buf = client_->AllocateShared(12 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  auto stream = client_->stub()->Prefill(&ctx);
  v1::PrefillClientMessage open;
  open.mutable_open()->set_namespace_id(ns_);
  for (uint64_t i = 0; i < 3; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
  // Compute is forecast to be very slow: the daemon streams every cached chunk.
  open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);
  open.mutable_open()->mutable_target()->set_region_id((*buf)->region_id());
  open.mutable_open()->mutable_target()->set_token((*buf)->token());
  open.mutable_open()->mutable_target()->add_offsets(0);
  ASSERT_TRUE(stream->Write(open));
  v1::PrefillServerMessage msg;
  std::vector<uint32_t> chunks;
  v1::PrefillDone done;
  while (stream->Read(&msg)) {
    if (msg.has_chunk()) {
      EXPECT_TRUE(msg.chunk().last());
      EXPECT_TRUE(msg.chunk().data().empty());
      const uint32_t j = msg.chunk().index();
      EXPECT_EQ(std::string((*buf)->data() + j * 4 * kMiB, 4 * kMiB), PatternBytes(j, 4 * kMiB));
      EXPECT_EQ(msg.chunk().crc32c(), crc32c::Value(PatternBytes(j, 4 * kMiB)));
      chunks.push_back(j);
    }
    if (msg.has_done()) {
      done = msg.done();
      stream->WritesDone();
    }
  }
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(chunks, (std::vector<uint32_t>{2, 1, 0}));
  EXPECT_EQ(done.first_streamed(), 0u);
  EXPECT_EQ(done.reason(), v1::PrefillDone::ALL_STREAMED);
}

// A session into a region paced by its own max_bytes_per_second records its copies'
// speed, not the pacing's: the next session on the connection is planned at the copy's
// pace. The pacing's waits were recorded as the connection's (and the daemon's) speed,
// so later sessions forecast the limit and streamed little or nothing.
TEST_F(ShmTest, APacedRegionSessionDoesNotTeachTheDaemonItsLimit) {
  StartDaemon();
  constexpr int kChunks = 4;
  for (uint64_t i = 0; i < kChunks; ++i) PutChunk(i);
  std::shared_ptr<RegionChannel> channel = Channel();
  ASSERT_NE(channel, nullptr);
  auto buf = SharedBuffer::Create(channel, kChunks * 4 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const auto session = [&](uint64_t limit) {
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    auto stream = client_->stub()->Prefill(&ctx);
    v1::PrefillClientMessage open;
    open.mutable_open()->set_namespace_id(ns_);
    for (uint64_t i = 0; i < kChunks; ++i) {
      open.mutable_open()->add_keys(KeyOf(i).ToByteString());
      open.mutable_open()->mutable_target()->add_offsets(i * 4 * kMiB);
    }
    open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);  // Stream all.
    open.mutable_open()->set_max_bytes_per_second(limit);
    open.mutable_open()->mutable_target()->set_region_id((*buf)->region_id());
    open.mutable_open()->mutable_target()->set_token((*buf)->token());
    EXPECT_TRUE(stream->Write(open));
    v1::PrefillServerMessage msg;
    v1::PrefillPlan plan;
    while (stream->Read(&msg)) {
      if (msg.has_plan()) plan = msg.plan();
      if (msg.has_done()) stream->WritesDone();
    }
    EXPECT_TRUE(stream->Finish().ok());
    return plan;
  };
  // 16 MiB at 8 MiB/s: two seconds of pacing, a copy of a few milliseconds.
  const v1::PrefillPlan first = session(8 * kMiB);
  EXPECT_GT(first.stream_bytes_per_second(), 0);
  const v1::PrefillPlan second = session(0);
  // Recorded as paced, 16 MiB (weight 1 - 2^(-16/64) against the 64 MiB half-life)
  // would have brought the estimate under 53 MB/s whatever it was before; the copy
  // alone keeps it above 120 MB/s unless it ran slower than about 21 MB/s (a loaded
  // machine once copied at 80: the bound is that far from either side).
  EXPECT_GT(second.stream_bytes_per_second(), 120e6);
}

// A remove answered OK means the daemon will not write into the region again: while a
// Prefill session still writes into it, the remove is refused (FAILED_PRECONDITION)
// and the region stays registered; once the session is over, it goes.
TEST_F(ShmTest, ARegionAPrefillSessionWritesIntoCannotBeRemovedUntilItEnds) {
  StartDaemon();
  for (uint64_t i = 0; i < 3; ++i) PutChunk(i);
  std::shared_ptr<RegionChannel> channel = Channel();
  ASSERT_NE(channel, nullptr);
  auto buf = SharedBuffer::Create(channel, 12 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  auto stream = client_->stub()->Prefill(&ctx);
  v1::PrefillClientMessage open;
  open.mutable_open()->set_namespace_id(ns_);
  for (uint64_t i = 0; i < 3; ++i) open.mutable_open()->add_keys(KeyOf(i).ToByteString());
  open.mutable_open()->mutable_compute_estimate()->set_a_seconds(100);  // Stream all.
  open.mutable_open()->set_max_bytes_per_second(8 * kMiB);  // Half a second a chunk.
  open.mutable_open()->mutable_target()->set_region_id((*buf)->region_id());
  open.mutable_open()->mutable_target()->set_token((*buf)->token());
  open.mutable_open()->mutable_target()->add_offsets(0);
  ASSERT_TRUE(stream->Write(open));
  v1::PrefillServerMessage msg;
  int chunks = 0;
  bool tried = false;
  while (stream->Read(&msg)) {
    if (msg.has_chunk() && ++chunks == 1) {
      // The session is under way and has chunks left to write into the region.
      const absl::Status busy = channel->Remove((*buf)->region_id(), absl::ZeroDuration());
      EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
      EXPECT_NE(busy.message().find("in use"), std::string::npos) << busy;
      tried = true;
    }
    if (msg.has_done()) stream->WritesDone();
  }
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_TRUE(tried);
  EXPECT_EQ(chunks, 3) << "the session went on into the region";
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(std::string((*buf)->data() + j * 4 * kMiB, 4 * kMiB), PatternBytes(j, 4 * kMiB));
  }
  // The session lets go of the region as it ends, a moment after the stream's status:
  // the client's Remove waits that out.
  const absl::Status removed = channel->Remove((*buf)->region_id());
  EXPECT_TRUE(removed.ok()) << removed;
}

// A Get into a region, then at once a remove: the call is over, so the remove succeeds
// (the client's Remove waits out the moment the daemon takes to let go), every time.
TEST_F(ShmTest, ARegionIsRemovableOnceTheGetIntoItReturned) {
  StartDaemon();
  PutChunk(0);
  std::shared_ptr<RegionChannel> channel = Channel();
  ASSERT_NE(channel, nullptr);
  for (int i = 0; i < 20; ++i) {
    auto buf = SharedBuffer::Create(channel, 4 * kMiB);
    ASSERT_TRUE(buf.ok()) << buf.status();
    ASSERT_TRUE(RawGet(GetRequestFor({0}, (*buf)->region_id(), (*buf)->token(), {0})).ok());
    EXPECT_EQ(std::string((*buf)->data(), 4 * kMiB), PatternBytes(0, 4 * kMiB));
    const absl::Status removed = channel->Remove((*buf)->region_id());
    ASSERT_TRUE(removed.ok()) << i << ": " << removed;
  }
}

// A daemon that stops answering (SIGSTOP here; wedged, in production) must not hang a
// client on the region socket: the request gives up at rpc_deadline, DeadlineExceeded,
// and the client's puts go on by the stream once the daemon is back.
TEST_F(ShmTest, AStoppedDaemonTimesOutTheRegionSocketInsteadOfHanging) {
  StartDaemon();
  ClientOptions options;
  options.rpc_deadline = absl::Seconds(2);
  std::unique_ptr<KvTierClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(client->data_path(), DataPath::kSharedMemory);
  auto mine = client->AllocateShared(4 * kMiB);  // Registered before the daemon stops.
  ASSERT_TRUE(mine.ok()) << mine.status();
  ScopedStop stop(daemon_->pid());
  ASSERT_TRUE(stop.stopped());
  auto buf = client->AllocateShared(4 * kMiB);  // A registration: one region request.
  EXPECT_EQ(buf.status().code(), absl::StatusCode::kDeadlineExceeded) << buf.status();
  EXPECT_NE(buf.status().message().find("region socket"), std::string::npos) << buf.status();
  ASSERT_EQ(kill(daemon_->pid(), SIGCONT), 0);
  // The region socket is closed for this client now, and the daemon forgot its regions:
  // its transfers take the stream, from its own memory and from the buffer it had
  // registered alike (naming that region would fail: the daemon no longer has it).
  EXPECT_EQ(client->data_path(), DataPath::kStream);
  EXPECT_NE(client->data_path_detail().find("timed out"), std::string::npos)
      << client->data_path_detail();
  const std::string data = PatternBytes(7, 4 * kMiB);
  std::memcpy((*mine)->data(), data.data(), data.size());
  const std::string other = PatternBytes(8, 4 * kMiB);
  const ChunkToPut chunks[] = {{KeyOf(7), absl::string_view((*mine)->data(), 4 * kMiB), 256},
                               {KeyOf(8), other, 256}};
  auto put = client->Put(ns_, chunks);
  ASSERT_TRUE(put.ok()) << put.status();
  auto got_into = client->GetInto(ns_, std::vector<ChunkKey>{KeyOf(8)},
                                  absl::Span<char>((*mine)->data(), 4 * kMiB));
  ASSERT_TRUE(got_into.ok()) << got_into.status();
  EXPECT_EQ(std::string((*mine)->data(), 4 * kMiB), other);
  auto got = client_->Get(ns_, std::vector<ChunkKey>{KeyOf(7), KeyOf(8)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE((*got)[0].found && (*got)[1].found);
  EXPECT_TRUE((*got)[0].data == data);
  EXPECT_TRUE((*got)[1].data == other);
}

// How many SOCK_SEQPACKET Unix sockets (region sockets) this process holds open.
int OpenRegionSockets() {
  std::set<std::string> seqpacket;  // Inodes, from /proc/net/unix.
  std::ifstream unix_sockets("/proc/net/unix");
  std::string line;
  std::getline(unix_sockets, line);  // Num RefCount Protocol Flags Type St Inode Path
  while (std::getline(unix_sockets, line)) {
    std::istringstream fields(line);
    std::string num, refs, protocol, flags, type, state, inode;
    fields >> num >> refs >> protocol >> flags >> type >> state >> inode;
    if (type == "0005") seqpacket.insert(inode);
  }
  int open = 0;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (ec || !absl::StartsWith(target, "socket:[")) continue;
    if (seqpacket.count(target.substr(8, target.size() - 9)) > 0) ++open;
  }
  return open;
}

// The staging budget: a failed call's (discarded) buffer gives its room to a later
// call that needs it (it once held it until a staged call succeeded, and none could:
// staging was off for good), and a request that cannot fit even after every free buffer
// is given up gives none up.
TEST_F(ShmTest, StagingRoomComesBackFromDiscardedBuffersAndIsNotGivenUpInVain) {
  StartDaemon();
  auto plane = SharedMemoryPlane::Open(DataPlane(), 16 * kMiB, absl::Seconds(30));
  ASSERT_TRUE(plane.ok()) << plane.status();
  std::shared_ptr<SharedBuffer> failed = (*plane)->AcquireStaging(9 * kMiB);
  ASSERT_NE(failed, nullptr);
  EXPECT_EQ(failed->size(), 16 * kMiB);
  (*plane)->DiscardStaging(std::move(failed));
  std::shared_ptr<SharedBuffer> next = (*plane)->AcquireStaging(4 * kMiB);
  ASSERT_NE(next, nullptr) << "the discarded buffer's room never came back";
  (*plane)->ReleaseStaging(std::move(next));

  // 4 MiB free; 8 MiB lent. 16 MiB cannot fit while the 8 are lent: the free one stays.
  std::shared_ptr<SharedBuffer> lent = (*plane)->AcquireStaging(8 * kMiB);
  ASSERT_NE(lent, nullptr);
  std::shared_ptr<SharedBuffer> free_one = (*plane)->AcquireStaging(4 * kMiB);
  ASSERT_NE(free_one, nullptr);
  const uint64_t kept = free_one->region_id();
  (*plane)->ReleaseStaging(std::move(free_one));
  EXPECT_EQ((*plane)->AcquireStaging(16 * kMiB), nullptr);
  EXPECT_EQ((*plane)->AcquireStaging(uint64_t{1} << 63), nullptr);
  std::shared_ptr<SharedBuffer> again = (*plane)->AcquireStaging(4 * kMiB);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->region_id(), kept) << "a free buffer was given up for a request that did not fit";
}

// Find locks each allocated buffer's weak_ptr under the plane's mutex. For a buffer whose
// owner let go of it in the meantime, Find's reference is the last, and it was dropped
// inside the loop: ~SharedBuffer (an unregistering round trip to the daemon) ran with
// the mutex held, and from the Python binding with the GIL held too. Find now drops
// the buffers it looked at after it releases the mutex.
TEST_F(ShmTest, FindDestroysABufferItHeldLastOnlyAfterReleasingThePlane) {
  StartDaemon();
  auto plane = SharedMemoryPlane::Open(DataPlane(), 16 * kMiB, absl::Seconds(30));
  ASSERT_TRUE(plane.ok()) << plane.status();
  auto let_go = (*plane)->Allocate(4096);  // Looked at first (allocation order).
  ASSERT_TRUE(let_go.ok()) << let_go.status();
  auto wanted = (*plane)->Allocate(4096);
  ASSERT_TRUE(wanted.ok()) << wanted.status();
  ASSERT_TRUE(WaitForRegions(2));
  const SharedBuffer* let_go_raw = let_go->get();
  std::weak_ptr<SharedBuffer> let_go_weak = *let_go;
  bool saw_wanted = false;
  bool destroyed_under_lock = false;
  (*plane)->SetFindHookForTest([&](const SharedBuffer& b) {
    if (&b == let_go_raw) {
      let_go->reset();  // Its owner lets go while Find holds it: Find's is the last.
    } else if (&b == wanted->get()) {
      saw_wanted = true;  // Still under the mutex: was the other one destroyed already?
      destroyed_under_lock = let_go_weak.expired();
    }
  });
  EXPECT_EQ((*plane)->Find((*wanted)->data(), 16), *wanted);
  (*plane)->SetFindHookForTest(nullptr);
  EXPECT_TRUE(saw_wanted);
  EXPECT_FALSE(destroyed_under_lock)
      << "a buffer Find held last was destroyed (and unregistered) under the plane's mutex";
  EXPECT_TRUE(let_go_weak.expired()) << "Find kept a buffer after it returned";
  EXPECT_TRUE(WaitForRegions(1)) << "the buffer Find held last was not unregistered";
}

// A daemon restarted on the same address knows none of the old one's regions. The
// client once kept the dead region socket: AllocateShared failed "Broken pipe" for good,
// and a GetInto through a staging buffer registered with the old daemon failed
// FAILED_PRECONDITION ("not registered"). It now notices the old socket closed and
// opens the new daemon's; buffers of the old plane go by the stream. The old socket is
// closed (it once stayed open: two descriptors more per restart in a long-lived worker).
TEST_F(ShmTest, ARestartedDaemonGetsANewPlaneAndOldBuffersStream) {
  StartDaemon();
  ASSERT_EQ(client_->data_path(), DataPath::kSharedMemory);
  ASSERT_EQ(OpenRegionSockets(), 1);
  const std::string before = client_->data_path_detail();
  auto old_buf = client_->AllocateShared(4 * kMiB);
  ASSERT_TRUE(old_buf.ok()) << old_buf.status();
  const std::string warm = PatternBytes(1, 4 * kMiB);
  std::string into(4 * kMiB, '\0');
  {
    const ChunkToPut c{KeyOf(1), warm, 256};
    ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
    auto got = client_->GetInto(ns_, std::vector<ChunkKey>{KeyOf(1)}, absl::MakeSpan(into));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->path, DataPath::kSharedMemory);  // A staging buffer: now registered.
  }
  const int port = daemon_->port();
  ASSERT_TRUE(daemon_->Terminate().ok());
  auto again = DaemonProcess::Start(MakeTempDir("kvtierd-shm-restart"),
                                    {"--shm-socket=auto", absl::StrCat("--listen=127.0.0.1:", port)});
  ASSERT_TRUE(again.ok()) << again.status();
  daemon_.emplace(*std::move(again));
  {
    // gRPC reconnects on its own schedule: a call that waits for it.
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::StatsResponse stats;
    ASSERT_TRUE(client_->stub()->Stats(&ctx, v1::StatsRequest(), &stats).ok());
  }
  ASSERT_EQ(Register(*client_), ns_);

  const std::string data = PatternBytes(2, 4 * kMiB);
  const ChunkToPut c{KeyOf(2), data, 256};
  auto put = client_->Put(ns_, {&c, 1});
  ASSERT_TRUE(put.ok()) << put.status();
  auto got = client_->GetInto(ns_, std::vector<ChunkKey>{KeyOf(2)}, absl::MakeSpan(into));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, DataPath::kSharedMemory);
  EXPECT_EQ(into, data);
  EXPECT_NE(client_->data_path_detail(), before);  // The new daemon's socket.
  EXPECT_EQ(OpenRegionSockets(), 1);  // ... and not the old one's.
  auto new_buf = client_->AllocateShared(4 * kMiB);
  ASSERT_TRUE(new_buf.ok()) << new_buf.status();
  // The old buffer still works, by the stream.
  auto old_got = client_->GetInto(ns_, std::vector<ChunkKey>{KeyOf(2)},
                                  absl::Span<char>((*old_buf)->data(), 4 * kMiB));
  ASSERT_TRUE(old_got.ok()) << old_got.status();
  EXPECT_EQ(std::string((*old_buf)->data(), 4 * kMiB), data);
}

// How many memfds named `name` the daemon maps (one per region it holds): distinct
// inodes, since one mapping may show as several lines.
int MappedMemfds(pid_t pid, const std::string& name) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::set<std::string> inodes;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:" + name) == std::string::npos) continue;
    // address perms offset dev inode path
    std::istringstream fields(line);
    std::string address, perms, offset, dev, inode;
    fields >> address >> perms >> offset >> dev >> inode;
    inodes.insert(inode);
  }
  return static_cast<int>(inodes.size());
}

// A caller cancels calls waiting on a daemon that does not answer (stopped here): a
// Get through a staging buffer, one that must first register a new one (a region
// request), and a streamed Get all end Cancelled at once, not at the 10-minute deadline.
// The client then goes on by shared memory once the daemon answers again: the region
// socket survives (the cancelled request's answer is read and dropped), and with it
// the buffer this client registered before.
TEST_F(ShmTest, CallsWaitingOnAStoppedDaemonAreCancelledAtOnce) {
  StartDaemon();
  const std::string data = PatternBytes(3, 4 * kMiB);
  const ChunkToPut c{KeyOf(3), data, 256};
  ASSERT_TRUE(client_->Put(ns_, {&c, 1}).ok());
  ClientOptions stream_options;
  stream_options.data_plane = ClientOptions::DataPlane::kStream;
  stream_options.rpc_deadline = absl::Minutes(10);
  std::unique_ptr<KvTierClient> streamed = Connect(stream_options);
  ASSERT_NE(streamed, nullptr);
  ClientOptions shm_options;
  shm_options.rpc_deadline = absl::Minutes(10);
  std::unique_ptr<KvTierClient> shm = Connect(shm_options);
  ASSERT_NE(shm, nullptr);
  std::string into(4 * kMiB, '\0');
  ASSERT_TRUE(shm->GetInto(ns_, std::vector<ChunkKey>{KeyOf(3)}, absl::MakeSpan(into)).ok());
  ASSERT_EQ(shm->data_path(), DataPath::kSharedMemory);
  auto mine = shm->AllocateShared(4 * kMiB);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const int mapped_before = MappedMemfds(daemon_->pid(), "kvtier-region");
  ASSERT_GT(mapped_before, 0);

  ScopedStop stop(daemon_->pid());
  ASSERT_TRUE(stop.stopped());
  // The first uses the staging buffer registered above; the second needs one more (8 MiB
  // for two keys), so it waits in a region request; the third waits in gRPC.
  std::string into2(8 * kMiB, '\0');
  struct Waiting {
    CallCancellation cancel;
    absl::Status status;
    absl::Notification started, done;
    std::thread thread;
  } calls[3];
  auto run = [](Waiting& w, auto fn) {
    w.thread = std::thread([&w, fn] {
      CallCancellation::Scope scope(&w.cancel);
      w.started.Notify();
      w.status = fn();
      w.done.Notify();
    });
  };
  run(calls[0], [&] {
    return shm->GetInto(ns_, std::vector<ChunkKey>{KeyOf(3)}, absl::MakeSpan(into)).status();
  });
  run(calls[1], [&] {
    return shm->GetInto(ns_, std::vector<ChunkKey>{KeyOf(3), KeyOf(4)}, absl::MakeSpan(into2))
        .status();
  });
  run(calls[2], [&] {
    return streamed->Get(ns_, std::vector<ChunkKey>{KeyOf(3)}).status();
  });
  for (Waiting& w : calls) {
    w.started.WaitForNotification();
    // Cancelled while it waits (not before it starts): polls a condition, bounded.
    for (int i = 0; i < 20000 && !w.cancel.watching(); ++i) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_TRUE(w.cancel.watching());
    EXPECT_FALSE(w.done.HasBeenNotified());
    w.cancel.Cancel();
    w.thread.join();
    EXPECT_EQ(w.status.code(), absl::StatusCode::kCancelled) << w.status;
  }
  // A call cancelled before it starts sends nothing.
  CallCancellation already;
  already.Cancel();
  {
    CallCancellation::Scope scope(&already);
    EXPECT_EQ(streamed->Stats().status().code(), absl::StatusCode::kCancelled);
  }
  ASSERT_EQ(kill(daemon_->pid(), SIGCONT), 0);
  auto again = shm->GetInto(ns_, std::vector<ChunkKey>{KeyOf(3)}, absl::MakeSpan(into));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(into, data);
  EXPECT_EQ(again->path, DataPath::kSharedMemory) << shm->data_path_detail();
  auto into_mine = shm->GetInto(ns_, std::vector<ChunkKey>{KeyOf(3)},
                                absl::Span<char>((*mine)->data(), 4 * kMiB));
  ASSERT_TRUE(into_mine.ok()) << into_mine.status();
  EXPECT_EQ(into_mine->path, DataPath::kSharedMemory);
  EXPECT_EQ(std::string((*mine)->data(), 4 * kMiB), data);
  // The next region request reads the answer the cancelled staging registration was
  // owed, and removes that region (its memory is gone on this side): the daemon maps
  // what it did before, and the new buffer. It once kept the cancelled one mapped until
  // the client's channel closed.
  auto one_more = shm->AllocateShared(kMiB);
  ASSERT_TRUE(one_more.ok()) << one_more.status();
  EXPECT_EQ(MappedMemfds(daemon_->pid(), "kvtier-region"), mapped_before + 1);
}

TEST_F(ShmTest, PrefillSessionIntoSharedMemoryHasTheDaemonCopyTheChunks) {
  // PrefillSession with `into` in AllocateShared memory: the daemon writes the streamed
  // chunks there (no data on the stream); `into` in the caller's own memory: the same
  // chunks, written by the session as frames arrive. Either way on_chunk_in_place
  // announces each chunk once, whole and verified, in decreasing order.
  StartDaemon();
  for (uint64_t i = 0; i < 3; ++i) PutChunk(i);
  const std::vector<ChunkKey> keys = {KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(50)};  // h = 3.
  auto shared = client_->AllocateShared(4 * 4 * kMiB);
  ASSERT_TRUE(shared.ok()) << shared.status();
  std::string own(4 * 4 * kMiB, '\0');
  for (char* into : {(*shared)->data(), own.data()}) {
    std::memset(into, 0, 4 * 4 * kMiB);
    std::vector<uint32_t> announced;
    PrefillOptions options;
    options.into = absl::Span<char>(into, 4 * 4 * kMiB);
    options.on_chunk_in_place = [&](uint32_t i, v1::Tier tier) {
      EXPECT_EQ(tier, v1::TIER_RAM);
      // In place when announced.
      EXPECT_TRUE(std::string(into + i * 4 * kMiB, 4 * kMiB) == PatternBytes(i, 4 * kMiB)) << i;
      announced.push_back(i);
    };
    options.compute_estimate = ComputeEstimate{100, 0};  // Slow worker: all streamed.
    auto session = PrefillSession::Start(*client_, ns_, keys, std::move(options));
    ASSERT_TRUE(session.ok()) << session.status();
    auto r = (*session)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->path, into == own.data() ? DataPath::kStream : DataPath::kSharedMemory);
    EXPECT_EQ(r->first_streamed, 0u);
    EXPECT_EQ(r->chunks_streamed, 3u);
    EXPECT_EQ(r->bytes_streamed, 3 * 4 * kMiB);
    EXPECT_EQ(announced, (std::vector<uint32_t>{2, 1, 0}));
    EXPECT_EQ(std::string(into + 3 * 4 * kMiB, 4 * kMiB), std::string(4 * kMiB, '\0'));
  }
  // Bad options: both callbacks, a callback without into, and into too small for the
  // request's chunks: refused before anything is sent when into is shared memory (the
  // daemon bounds its copies by the whole region, so chunk 2 would land past an 8 MiB
  // into), at the plan on the stream; either way nothing lands past into's end.
  PrefillOptions both;
  both.into = absl::Span<char>(own.data(), own.size());
  both.on_chunk = [](uint32_t, std::string, v1::Tier) {};
  EXPECT_EQ(PrefillSession::Start(*client_, ns_, keys, both).status().code(),
            absl::StatusCode::kInvalidArgument);
  PrefillOptions orphan;
  orphan.on_chunk_in_place = [](uint32_t, v1::Tier) {};
  EXPECT_EQ(PrefillSession::Start(*client_, ns_, keys, orphan).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (char* into : {(*shared)->data(), own.data()}) {
    std::memset(into, 'x', 4 * 4 * kMiB);
    PrefillOptions small;
    small.into = absl::Span<char>(into, 2 * 4 * kMiB);
    small.compute_estimate = ComputeEstimate{100, 0};
    EXPECT_EQ(PrefillSession::Start(*client_, ns_, keys, small).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(into, 4 * 4 * kMiB), std::string(4 * 4 * kMiB, 'x'));
  }
}

// A Get refused before it started (here a target out of range) leaves the Lookup lease
// it names: the lease was once taken first, so a refusal the client retries (a
// region's events in use) had used it up.
TEST_F(ShmTest, ARefusedGetLeavesTheLeaseItNames) {
  StartDaemon();
  PutChunk(0);
  const ChunkKey key = KeyOf(0);
  auto looked = client_->Lookup(ns_, {&key, 1}, /*lease_seconds=*/60);
  ASSERT_TRUE(looked.ok()) << looked.status();
  ASSERT_NE(looked->lease_id, 0u);
  auto buf = client_->AllocateShared(6 * kMiB);
  ASSERT_TRUE(buf.ok());
  v1::GetRequest refused =
      GetRequestFor({0}, (*buf)->region_id(), (*buf)->token(), {(*buf)->size() - kMiB});
  refused.set_lease_id(looked->lease_id);
  EXPECT_EQ(RawGet(refused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GetRequest good = GetRequestFor({0}, (*buf)->region_id(), (*buf)->token(), {0});
  good.set_lease_id(looked->lease_id);
  ASSERT_TRUE(RawGet(good).ok());
  auto released = client_->ReleaseLease(ns_, looked->lease_id);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_FALSE(*released) << "the Get that started did not take the lease";
  auto again = client_->Lookup(ns_, {&key, 1}, 60);
  ASSERT_TRUE(again.ok()) << again.status();
  refused.set_lease_id(again->lease_id);
  EXPECT_EQ(RawGet(refused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  released = client_->ReleaseLease(ns_, again->lease_id);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(*released) << "the refused Get used up the lease";
}

TEST_F(ShmTest, RegionTooSmallOrOutOfRangeIsInvalidArgument) {
  StartDaemon();
  PutChunk(0);
  PutChunk(1);
  auto buf = client_->AllocateShared(6 * kMiB);
  ASSERT_TRUE(buf.ok());
  const uint64_t id = (*buf)->region_id(), token = (*buf)->token();
  const uint64_t size = (*buf)->size();
  // Two 4 MiB keys back to back need 8 MiB.
  EXPECT_EQ(RawGet(GetRequestFor({0, 1}, id, token, {0})).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Past the end, overflowing, overlapping, the wrong number of offsets.
  EXPECT_EQ(RawGet(GetRequestFor({0}, id, token, {size - 4 * kMiB + 1})).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(RawGet(GetRequestFor({0}, id, token, {UINT64_MAX - 10})).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(RawGet(GetRequestFor({0, 1}, id, token, {0, 1})).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(RawGet(GetRequestFor({0, 1}, id, token, {0, 1, 2})).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Puts: overflowing and out-of-range references, a zero length, data and a region at
  // once, a reference longer than the chunk. Nothing is stored.
  const uint32_t crc = crc32c::Value(PatternBytes(5, 4 * kMiB));
  v1::RegionRef ref;
  ref.set_region_id(id);
  ref.set_token(token);
  ref.set_offset(UINT64_MAX - 100);
  ref.set_length(4 * kMiB);
  EXPECT_EQ(RawPutRegion(5, ref, crc).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ref.set_offset(size - kMiB);
  EXPECT_EQ(RawPutRegion(5, ref, crc).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ref.set_offset(0);
  ref.set_length(0);
  EXPECT_EQ(RawPutRegion(5, ref, crc).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ref.set_length(4 * kMiB);
  EXPECT_EQ(RawPutRegion(5, ref, crc, "x").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ref.set_length(5 * kMiB);
  EXPECT_EQ(RawPutRegion(5, ref, crc).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(Present(5));
  // A wrong CRC: INVALID_ARGUMENT (the request's bytes and checksum disagree), nothing
  // stored. The right one stores it.
  const std::string data = PatternBytes(5, 4 * kMiB);
  std::memcpy((*buf)->data(), data.data(), data.size());
  ref.set_length(4 * kMiB);
  EXPECT_EQ(RawPutRegion(5, ref, crc ^ 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(Present(5));
  EXPECT_TRUE(RawPutRegion(5, ref, crc).ok());
  EXPECT_TRUE(Present(5));
}

// A Put naming far more of a region than the chunk holds is refused before the daemon
// faults any of it in: faulting in a memfd's holes allocates them (a sparse region of
// any size, sealed and never touched, once cost the daemon that much memory).
TEST_F(ShmTest, AnOversizedPutRangeIsRefusedBeforeItsPagesAreFaultedIn) {
  StartDaemon();
  auto channel = Channel();
  ASSERT_NE(channel, nullptr);
  constexpr uint64_t kSparse = 256 * kMiB;
  Memfd sparse(kSparse);  // Mapped here, never touched: no pages.
  auto reg = channel->Add(sparse.fd, kSparse);
  ASSERT_TRUE(reg.ok()) << reg.status();
  v1::RegionRef ref;
  ref.set_region_id(reg->region_id);
  ref.set_token(reg->token);
  ref.set_offset(0);
  ref.set_length(kSparse);
  const grpc::Status s = RawPutRegion(6, ref, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "payload size wrong")) << s.error_message();
  struct stat st;
  ASSERT_EQ(fstat(sparse.fd, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "the daemon faulted in " << st.st_blocks * 512
                             << " bytes of the region";
  EXPECT_FALSE(Present(6));
}

TEST_F(ShmTest, UnknownRegionIsFailedPreconditionAndForeignTokenIsPermissionDenied) {
  StartDaemon();
  PutChunk(0);
  auto other = Connect();
  auto theirs = other->AllocateShared(4 * kMiB);  // Another client's region.
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  std::memset((*theirs)->data(), 0x5a, 4 * kMiB);
  EXPECT_EQ(RawGet(GetRequestFor({0}, 12345, 1, {0})).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Its id without its token (here: a guess) cannot be read or written.
  EXPECT_EQ(RawGet(GetRequestFor({0}, (*theirs)->region_id(), (*theirs)->token() + 1, {0}))
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::RegionRef ref;
  ref.set_region_id((*theirs)->region_id());
  ref.set_token((*theirs)->token() ^ 0xff);
  ref.set_length(4 * kMiB);
  EXPECT_EQ(RawPutRegion(6, ref, 0).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ((*theirs)->data()[0], 0x5a);  // Untouched.
  EXPECT_FALSE(Present(6));
  // A region removed by its owner is unknown from then on.
  const uint64_t id = (*theirs)->region_id(), token = (*theirs)->token();
  theirs->reset();
  EXPECT_EQ(RawGet(GetRequestFor({0}, id, token, {0})).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(ShmTest, RegistrationsThatCanNeverWorkAreRefused) {
  StartDaemon({"--shm-max-region-bytes=64MiB"});
  auto channel = Channel();
  ASSERT_NE(channel, nullptr);
  {
    Memfd unsealed(kMiB, 0);  // Could be truncated under the daemon.
    auto r = channel->Add(unsealed.fd, kMiB);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("F_SEAL_SHRINK"), std::string::npos);
  }
  {
    Memfd sealed(kMiB);
    EXPECT_EQ(channel->Add(sealed.fd, 2 * kMiB).status().code(),
              absl::StatusCode::kInvalidArgument);  // Size not as said.
  }
  {
    Memfd huge(128 * kMiB);
    EXPECT_EQ(channel->Add(huge.fd, 128 * kMiB).status().code(),
              absl::StatusCode::kInvalidArgument);  // Over shm_max_region_bytes.
  }
  {
    // Sealed, but sent through a read-only descriptor: the daemon cannot map it writable.
    Memfd sealed(kMiB);
    const int ro = open(absl::StrCat("/proc/self/fd/", sealed.fd).c_str(), O_RDONLY);
    ASSERT_GE(ro, 0);
    auto r = channel->Add(ro, kMiB);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("O_RDWR"), std::string::npos) << r.status();
    close(ro);
  }
  {
    // A regular file is not a memfd (anyone with the path could change it).
    const std::string path = data_dir_ + "/plain";
    const int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kMiB), 0);
    EXPECT_EQ(channel->Add(fd, kMiB).status().code(), absl::StatusCode::kInvalidArgument);
    close(fd);
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    EXPECT_EQ(channel->Add(pipefd[0], kMiB).status().code(), absl::StatusCode::kInvalidArgument);
    close(pipefd[0]);
    close(pipefd[1]);
  }
  {
    // Add without a descriptor, and garbage: clear errors, and the channel still works.
    v1::RegionSocketRequest add;
    add.mutable_add()->set_bytes(kMiB);
    auto r = channel->Call(add, -1);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_EQ(Stats().regions(), 0u);
  Memfd good(kMiB);
  auto r = channel->Add(good.fd, kMiB);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Stats().regions(), 1u);
  EXPECT_EQ(Stats().region_bytes(), kMiB);
}

TEST_F(ShmTest, GarbageOnTheRegionSocketGetsAnErrorAndOthersAreServed) {
  StartDaemon();
  const v1::DataPlaneResponse info = DataPlane();
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, info.region_socket().data(), info.region_socket().size());
  addr.sun_path[0] = '\0';
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr),
                    static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) +
                                           info.region_socket().size())),
            0);
  const char junk[] = "\xff\xff\xff\xff not a protobuf";
  ASSERT_GT(send(fd, junk, sizeof(junk), 0), 0);
  char buf[4096];
  const ssize_t n = recv(fd, buf, sizeof(buf), 0);
  ASSERT_GT(n, 0);
  v1::RegionSocketResponse resp;
  ASSERT_TRUE(resp.ParseFromArray(buf, static_cast<int>(n)));
  EXPECT_EQ(resp.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  std::string huge(8192, 'x');  // Longer than any request: truncated, refused.
  ASSERT_GT(send(fd, huge.data(), huge.size(), 0), 0);
  ASSERT_GT(recv(fd, buf, sizeof(buf), 0), 0);
  close(fd);
  PutChunk(0);  // The daemon serves on.
  auto buf2 = client_->AllocateShared(4 * kMiB);
  EXPECT_TRUE(buf2.ok()) << buf2.status();
}

// In a child running as uid nobody with `gid` as its only group: connects to the daemon's
// region socket and registers 1 MiB. Returns the child's exit code: 0 when registered,
// else the status code that refused it (10: it could not change its ids; 20: the
// registration failed; -1: it did not exit).
int RegisterAsMemberOf(const v1::DataPlaneResponse& info, gid_t gid) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    const gid_t groups[1] = {gid};
    if (setgroups(1, groups) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    auto channel = RegionChannel::Connect(info.region_socket(), info.instance_id());
    if (!channel.ok()) _exit(static_cast<int>(channel.status().code()));
    auto buf = SharedBuffer::Create(*channel, kMiB);
    _exit(buf.ok() ? 0 : 20);
  }
  int wstatus = 0;
  if (waitpid(pid, &wstatus, 0) != pid || !WIFEXITED(wstatus)) return -1;
  return WEXITSTATUS(wstatus);
}

// A raw connection to the daemon's abstract region socket (-1 on failure).
int ConnectRegionSocket(const std::string& name) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, name.data(), name.size());
  addr.sun_path[0] = '\0';
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr),
              static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size())) != 0) {
    close(fd);
    return -1;
  }
  // A hang guard for the reads below: no answer within it is a failure.
  timeval tv{60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// The daemon's open descriptors that are memfds named `name`.
int OpenMemfds(pid_t pid, const std::string& name) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().find("memfd:" + name) != std::string::npos) ++n;
  }
  return n;
}

// An empty packet may carry descriptors too: they are closed like any others (they once
// stayed open in the daemon, uncounted, for as long as it ran), and the client's
// connection and regions stay.
TEST_F(ShmTest, DescriptorsOnAnEmptyPacketAreClosedAndAnswered) {
  StartDaemon();
  const v1::DataPlaneResponse info = DataPlane();
  const int sock = ConnectRegionSocket(info.region_socket());
  ASSERT_GE(sock, 0);
  for (int i = 0; i < 5; ++i) {
    const int memfd = memfd_create("kvtier-test-empty", MFD_CLOEXEC);
    ASSERT_GE(memfd, 0);
    ASSERT_EQ(ftruncate(memfd, kMiB), 0);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &memfd, sizeof(int));
    ASSERT_EQ(sendmsg(sock, &msg, 0), 0) << std::strerror(errno);
    close(memfd);
    char buf[4096];
    const ssize_t n = recv(sock, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << "an answer, on a connection that stays open";
    v1::RegionSocketResponse resp;
    ASSERT_TRUE(resp.ParseFromArray(buf, static_cast<int>(n)));
    EXPECT_EQ(resp.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_EQ(OpenMemfds(daemon_->pid(), "kvtier-test-empty"), 0);
  close(sock);
}

// A peer the daemon does not admit is answered PERMISSION_DENIED once and disconnected,
// and such peers hold a few connections at most: they cannot take the places of the
// workers it admits.
TEST_F(ShmTest, PeersNotAdmittedAreAnsweredOnceAndCannotCrowdOutWorkers) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  StartDaemon();
  const v1::DataPlaneResponse info = DataPlane();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(ready[0]);
    // The outcome, as one byte on the pipe: 0 when every check passed.
    auto report = [&](char code) {
      (void)!write(ready[1], &code, 1);
      if (code != 0) _exit(code);
    };
    if (setgid(65534) != 0 || setuid(65534) != 0) report(10);
    v1::RegionSocketRequest hello;
    hello.mutable_hello();
    const std::string out = hello.SerializeAsString();
    char buf[4096];
    // 40 idle connections; then a 41st asks. The daemon accepts in order, so by the
    // time it could answer the 41st it has accepted all 40 and kept 16 of them: the
    // 41st is closed at accept, unanswered.
    std::vector<int> idle;
    for (int i = 0; i < 40; ++i) idle.push_back(ConnectRegionSocket(info.region_socket()));
    const int late = ConnectRegionSocket(info.region_socket());
    (void)!send(late, out.data(), out.size(), MSG_NOSIGNAL);
    const ssize_t answer = recv(late, buf, sizeof(buf), 0);  // 0, or ECONNRESET: closed.
    if (answer > 0 || (answer < 0 && errno != ECONNRESET)) report(20);
    close(late);
    // Every idle one asks now: the 16 kept answer PERMISSION_DENIED, then close.
    for (int k : idle) (void)!send(k, out.data(), out.size(), MSG_NOSIGNAL);
    int kept = 0;
    for (int k : idle) {
      const ssize_t n = recv(k, buf, sizeof(buf), 0);
      v1::RegionSocketResponse resp;
      if (n > 0) {
        if (!resp.ParseFromArray(buf, static_cast<int>(n)) ||
            resp.code() != static_cast<int>(absl::StatusCode::kPermissionDenied)) {
          report(21);
        }
        if (recv(k, buf, sizeof(buf), 0) != 0) report(22);  // Then disconnected.
        ++kept;
      }
      close(k);
    }
    if (kept != 16) report(static_cast<char>(30 + std::min(kept, 60)));
    // Again 40, held open while the parent's worker registers memory.
    idle.clear();
    for (int i = 0; i < 40; ++i) idle.push_back(ConnectRegionSocket(info.region_socket()));
    report(0);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char code = -1;
  ASSERT_EQ(read(ready[0], &code, 1), 1);
  close(ready[0]);
  EXPECT_EQ(code, 0) << "the child's check " << int{code} << " failed";
  // Meanwhile an admitted worker gets shared memory.
  auto worker = Connect();
  ASSERT_NE(worker, nullptr);
  auto buf = worker->AllocateShared(kMiB);
  EXPECT_TRUE(buf.ok()) << buf.status();
  kill(pid, SIGKILL);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
}

// Out of descriptors (RLIMIT_NOFILE), the daemon closes the connections it cannot take
// at once, so their clients fall back to the stream without waiting, and its region
// socket's thread does not spin on a listening socket that stays readable; once
// descriptors are free again it serves as before.
TEST_F(ShmTest, OutOfDescriptorsNewConnectionsAreClosedNotLeftWaiting) {
  StartDaemon();
  const v1::DataPlaneResponse info = DataPlane();
  const pid_t daemon = daemon_->pid();
  const auto open_fds = [&] {
    int n = 0;
    for ([[maybe_unused]] const auto& e :
         std::filesystem::directory_iterator("/proc/" + std::to_string(daemon) + "/fd")) {
      ++n;
    }
    return n;
  };
  rlimit before{};
  ASSERT_EQ(prlimit(daemon, RLIMIT_NOFILE, nullptr, &before), 0);
  rlimit tight = before;
  tight.rlim_cur = static_cast<rlim_t>(open_fds() + 2);
  ASSERT_EQ(prlimit(daemon, RLIMIT_NOFILE, &tight, nullptr), 0) << std::strerror(errno);
  v1::RegionSocketRequest hello;
  hello.mutable_hello();
  const std::string out = hello.SerializeAsString();
  std::vector<int> conns;
  int answered = 0, closed = 0;
  // Sixteen: the daemon's other threads may open or close a few descriptors meanwhile.
  for (int i = 0; i < 16; ++i) {
    const int fd = ConnectRegionSocket(info.region_socket());
    ASSERT_GE(fd, 0);
    timeval guard{10, 0};  // The old daemon never answered these: a hang guard.
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &guard, sizeof(guard));
    conns.push_back(fd);
    (void)!send(fd, out.data(), out.size(), MSG_NOSIGNAL);
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      ++answered;
    } else {
      ASSERT_TRUE(n == 0 || errno == ECONNRESET)
          << "connection " << i << " left waiting: " << std::strerror(errno);
      ++closed;
    }
  }
  EXPECT_GE(closed, 8) << answered << " answered";
  for (int fd : conns) close(fd);
  ASSERT_EQ(prlimit(daemon, RLIMIT_NOFILE, &before, nullptr), 0);
  auto worker = Connect();
  ASSERT_NE(worker, nullptr);
  auto buf = worker->AllocateShared(kMiB);
  EXPECT_TRUE(buf.ok()) << buf.status();
  PutChunk(0);
}

// A path socket's group is shm_allowed_group: its members have the write permission
// connect() needs (the mode gives it to the socket's group).
TEST_F(ShmTest, APathSocketBelongsToTheAllowedGroup) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  const std::string dir = MakeTempDir("kvtier-sock-group");
  ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  const std::string path = dir + "/shm.sock";
  StartDaemon({"--shm-socket=" + path, "--shm-allowed-group=4242"});
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, 4242u);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  const v1::DataPlaneResponse info = DataPlane();
  EXPECT_EQ(RegisterAsMemberOf(info, 4242), 0);
}

TEST_F(ShmTest, MoreRegionsThanTheLimitIsResourceExhaustedUntilOneGoes) {
  StartDaemon({"--shm-max-regions=2"});
  auto a = client_->AllocateShared(kMiB);
  auto b = client_->AllocateShared(kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = client_->AllocateShared(kMiB);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  // Staging cannot register either: transfers of the caller's own memory stream.
  PutChunk(0);
  const ChunkKey k = KeyOf(0);
  auto got = client_->Get(ns_, {&k, 1});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0].data, PatternBytes(0, 4 * kMiB));
  a->reset();
  EXPECT_TRUE(client_->AllocateShared(kMiB).ok());
}

TEST_F(ShmTest, ADeadClientsRegionsAreForgottenAndItsIdsStopWorking) {
  StartDaemon();
  PutChunk(0);
  const uint64_t before = Stats().regions();  // This client's staging buffer.
  const v1::DataPlaneResponse info = DataPlane();
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The child registers three regions and dies without a word.
    auto channel = RegionChannel::Connect(info.region_socket(), info.instance_id());
    if (!channel.ok()) _exit(1);
    uint64_t ids[2] = {0, 0};
    for (int i = 0; i < 3; ++i) {
      auto b = SharedBuffer::Create(*channel, 4 * kMiB);
      if (!b.ok()) _exit(2);
      ids[0] = (*b)->region_id();
      ids[1] = (*b)->token();
      new std::shared_ptr<SharedBuffer>(*b);  // Leaked: never unregistered.
    }
    if (write(pipefd[1], ids, sizeof(ids)) != sizeof(ids)) _exit(3);
    kill(getpid(), SIGKILL);
  }
  close(pipefd[1]);
  uint64_t ids[2] = {0, 0};
  ASSERT_EQ(read(pipefd[0], ids, sizeof(ids)), static_cast<ssize_t>(sizeof(ids)));
  close(pipefd[0]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(wstatus));
  ASSERT_TRUE(WaitForRegions(before));
  EXPECT_EQ(RawGet(GetRequestFor({0}, ids[0], ids[1], {0})).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(ShmTest, AClientKilledMidTransferLeavesTheDaemonServing) {
  StartDaemon();
  std::vector<std::string> args = {KVTIER_CLI_PATH, "--target", daemon_->target(), "get",
                                   "--namespace", absl::StrCat(absl::Hex(ns_, absl::kZeroPad16))};
  for (uint64_t i = 0; i < 16; ++i) {
    PutChunk(i);
    args.push_back(absl::StrCat(KeyOf(i).ToHex(), "=", data_dir_, "/out", i));
  }
  const uint64_t before = Stats().regions();
  // The CLI (its own process: gRPC does not survive fork) gets 64 MiB through shared
  // memory; it is killed once it has registered its staging buffer, in the transfer.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  ASSERT_TRUE(WaitForRegions(before + 1));
  kill(pid, SIGKILL);
  ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
  ASSERT_TRUE(WaitForRegions(before));
  // Everything stored is intact and served, through shared memory.
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 16; ++i) keys.push_back(KeyOf(i));
  auto got = client_->Get(ns_, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  for (uint64_t i = 0; i < 16; ++i) EXPECT_EQ((*got)[i].data, PatternBytes(i, 4 * kMiB));
}

TEST_F(ShmTest, OwnerCannotTruncateAndUnmappingItsViewDoesNotAffectTheDaemon) {
  StartDaemon();
  PutChunk(0);
  auto channel = Channel();
  ASSERT_NE(channel, nullptr);
  Memfd region(4 * kMiB);
  auto reg = channel->Add(region.fd, 4 * kMiB);
  ASSERT_TRUE(reg.ok()) << reg.status();
  // The seal holds: the owner cannot shrink the file under the daemon's mapping.
  EXPECT_EQ(ftruncate(region.fd, 0), -1);
  EXPECT_EQ(errno, EPERM);
  // The owner unmaps its only view: the daemon's mapping is its own.
  ASSERT_EQ(munmap(region.data, region.bytes), 0);
  region.data = nullptr;
  EXPECT_TRUE(RawGet(GetRequestFor({0}, reg->region_id, reg->token, {0})).ok());
  char* view = static_cast<char*>(
      mmap(nullptr, 4 * kMiB, PROT_READ, MAP_SHARED, region.fd, 0));
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_EQ(std::string(view, 4 * kMiB), PatternBytes(0, 4 * kMiB));
  munmap(view, 4 * kMiB);
}

TEST_F(ShmTest, AnotherUserIsNotAdmitted) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  StartDaemon();
  const v1::DataPlaneResponse info = DataPlane();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    auto channel = RegionChannel::Connect(info.region_socket(), info.instance_id());
    _exit(channel.ok() ? 0 : static_cast<int>(channel.status().code()));
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), static_cast<int>(absl::StatusCode::kPermissionDenied));
}

TEST_F(ShmTest, AnAllowedGroupIsAdmitted) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  StartDaemon({"--shm-allowed-group=4242"});
  const v1::DataPlaneResponse info = DataPlane();
  EXPECT_EQ(RegisterAsMemberOf(info, 4242), 0);
}

TEST_F(ShmTest, ASocketOfAnotherDaemonIsNotUsed) {
  StartDaemon();
  const v1::DataPlaneResponse info = DataPlane();
  auto c = RegionChannel::Connect(info.region_socket(), info.instance_id() + 1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  auto none = RegionChannel::Connect("@kvtier-test-no-such-socket", 1);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
}

TEST_F(ShmTest, WithoutARegionSocketClientsStream) {
  StartDaemon({"--shm-socket=off"});
  EXPECT_EQ(client_->data_path(), DataPath::kStream);
  EXPECT_NE(client_->data_path_detail().find("shm_socket = off"), std::string::npos)
      << client_->data_path_detail();
  PutChunk(0);
  const ChunkKey k = KeyOf(0);
  auto got = client_->Get(ns_, {&k, 1});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0].data, PatternBytes(0, 4 * kMiB));
  std::string out(4 * kMiB, '\0');
  auto into = client_->GetInto(ns_, {&k, 1}, absl::MakeSpan(out));
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_EQ(into->path, DataPath::kStream);
  EXPECT_EQ(out, PatternBytes(0, 4 * kMiB));
  EXPECT_EQ(client_->AllocateShared(kMiB).status().code(), absl::StatusCode::kFailedPrecondition);
  // A target or a region reference is refused with the reason.
  EXPECT_EQ(RawGet(GetRequestFor({0}, 1, 1, {0})).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Asked for shared memory only, a client says why it cannot.
  ClientOptions options;
  options.data_plane = ClientOptions::DataPlane::kSharedMemory;
  auto strict = Connect(options);
  const std::string data = PatternBytes(1, 4 * kMiB);
  ChunkToPut c{KeyOf(1), data, 256};
  EXPECT_EQ(strict->Put(ns_, {&c, 1}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ShmTest, APathSocketHasTheConfiguredModeAndIsRemovedAtExit) {
  const std::string dir = MakeTempDir("kvtier-sock");
  const std::string path = dir + "/shm.sock";
  StartDaemon({"--shm-socket=" + path});
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(client_->data_path(), DataPath::kSharedMemory) << client_->data_path_detail();
  PutChunk(0);
  client_.reset();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(ShmTest, TheCliSaysWhichPathItTook) {
  for (const char* socket : {"--shm-socket=auto", "--shm-socket=off"}) {
    StartDaemon({socket});
    const bool shared = std::string(socket) == "--shm-socket=auto";
    const std::string in = data_dir_ + "/in", out = data_dir_ + "/out";
    {
      std::ofstream f(in, std::ios::binary);
      f << PatternBytes(0, 4 * kMiB);
    }
    const std::string ns = absl::StrCat(absl::Hex(ns_, absl::kZeroPad16));
    const std::string key = KeyOf(0).ToHex();
    auto put = testing::RunCommand({KVTIER_CLI_PATH, "--target", daemon_->target(), "put",
                                    "--namespace", ns, key + "=" + in});
    EXPECT_EQ(put.exit_code, 0) << put.output;
    auto get = testing::RunCommand({KVTIER_CLI_PATH, "--target", daemon_->target(), "get",
                                    "--namespace", ns, key + "=" + out});
    EXPECT_EQ(get.exit_code, 0) << get.output;
    for (const auto* r : {&put, &get}) {
      EXPECT_NE(r->output.find(shared ? "data path: shared memory" : "data path: stream"),
                std::string::npos)
          << r->output;
    }
    std::ifstream f(out, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(bytes, PatternBytes(0, 4 * kMiB));
    client_.reset();
    daemon_.reset();
  }
}

}  // namespace
}  // namespace kvtier
