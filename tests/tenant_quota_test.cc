// Per-tenant quotas on a real kvtierd (TenantQuotas): a tenant's puts past its RAM or
// SSD quota evict its own chunks and never another tenant's; a chunk larger than a
// quota is INVALID_ARGUMENT; pins past the pinned quota are RESOURCE_EXHAUSTED; the
// metrics show use, quota, evictions and refusals per tenant.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "server/tenant_table.h"
#include "tests/support/daemon_process.h"
#include "tests/support/tenants_file.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::HttpGet;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;
using testing::SeriesValue;
using testing::TokenLine;

constexpr uint64_t kMiB = 1 << 20;

class TenantQuotaTest : public ::testing::Test {
 protected:
  // Tenant "small" has a 3 MiB RAM, 2 MiB SSD and 1 MiB pinned quota, one stream, one
  // lease and one Events subscription at a time, and three layouts; "big" none (and a
  // third of the daemon's Events subscribers, layouts and lease bytes, the default
  // shares: 2 MiB of max_lease_bytes each).
  // `more`: further lines of the tenants file (which change the default shares).
  void Start(const std::string& mode, const std::string& more = "") {
    dir_ = MakeTempDir("kvtierd-quota");
    const std::string tenants = dir_ + ".tenants";
    std::ofstream(tenants) << "tenant small ram_quota=3MiB ssd_quota=2MiB pinned_quota=1MiB "
                              "max_streams=1 max_leases=1 max_subscribers=1 max_layouts=3\n"
                           << "tenant big\n"
                           << "tenant mid ram_quota=2MiB\n"
                           << TokenLine("small", "token-small") << TokenLine("big", "token-big")
                           << TokenLine("mid", "token-mid") << more;
    args_ = {"--tenants-file=" + tenants, "--write-mode=" + mode, "--ram-capacity=64MiB",
             "--max-lease-bytes=6MiB"};
    auto d = DaemonProcess::Start(dir_, args_);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    small_ = Connect("token-small");
    big_ = Connect("token-big");
    ns_ = Register(*small_, 1);
    ASSERT_EQ(Register(*big_, 1), ns_);  // Same public id; separate namespaces inside.
  }

  std::unique_ptr<KvTierClient> Connect(const std::string& token) {
    ClientOptions o;
    o.bearer_token = token;
    auto c = KvTierClient::Connect(daemon_->target(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  static uint64_t Register(KvTierClient& c, uint32_t mib) {
    auto r = c.RegisterLayout(LayoutOfMiB(mib));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->namespace_id : 0;
  }

  static absl::Status Put(KvTierClient& c, uint64_t ns, uint64_t n, uint64_t bytes = kMiB) {
    const std::string data = PatternBytes(n, bytes);
    ChunkToPut chunk{KeyOf(n), data, 256};
    return c.Put(ns, absl::MakeConstSpan(&chunk, 1)).status();
  }

  // Which of keys first..last `c` finds, as a string of tiers ('r', 's', '-').
  std::string Where(KvTierClient& c, uint64_t first, uint64_t last) {
    std::vector<ChunkKey> keys;
    for (uint64_t n = first; n <= last; ++n) keys.push_back(KeyOf(n));
    auto r = c.Lookup(ns_, keys);
    EXPECT_TRUE(r.ok()) << r.status();
    std::string out;
    for (v1::Tier t : r->tiers) {
      out += t == v1::TIER_RAM ? 'r' : t == v1::TIER_SSD ? 's' : t == v1::TIER_GPU ? 'g' : '-';
    }
    return out;
  }

  double Metric(const std::string& series) {
    auto m = HttpGet(daemon_->metrics_port(), "/metrics");
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? SeriesValue(m->body, series) : -1;
  }

  // Stops the daemon cleanly and starts it again on the same data directory.
  void Restart() {
    auto code = daemon_->Terminate();
    ASSERT_TRUE(code.ok()) << code.status();
    daemon_.reset();
    auto d = DaemonProcess::Start(dir_, args_);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
    small_ = Connect("token-small");
    big_ = Connect("token-big");
  }

  std::string dir_;
  std::vector<std::string> args_;
  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<KvTierClient> small_, big_;
  uint64_t ns_ = 0;
};

TEST_F(TenantQuotaTest, RamQuotaEvictsTheTenantsOwnLeastRecentlyUsedChunks) {
  Start("ram-only");
  for (uint64_t n = 1; n <= 4; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok());
  for (uint64_t n = 1; n <= 5; ++n) ASSERT_TRUE(Put(*small_, ns_, n).ok()) << n;
  // small keeps its three newest; big, with more chunks than small's quota, keeps all.
  EXPECT_EQ(Where(*small_, 1, 5), "--rrr");
  EXPECT_EQ(Where(*big_, 1, 4), "rrrr");
  // A read makes chunk 3 the most recently used: the next put evicts 4 instead.
  ASSERT_TRUE(small_->Get(ns_, {KeyOf(3)}).ok());
  ASSERT_TRUE(Put(*small_, ns_, 6).ok());
  EXPECT_EQ(Where(*small_, 3, 6), "r-rr");
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="small",tier="ram"})"), 3.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="big",tier="ram"})"), 4.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_bytes{tenant="small",tier="ram"})"), 3.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_evicted_bytes_total{tenant="small",tier="ram"})"),
            3.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_bytes{tenant="big",tier="ram"})"), -1);  // None set.
}

// A layout of tiny chunks (far smaller than a 64 KiB pool slot). The RAM quota once
// counted their payload bytes while each took a whole slot, so a tenant could take up
// to a slot per few hundred bytes of quota: the whole pool, evicting everyone else's
// chunks. The quota now counts the slots its chunks take.
TEST_F(TenantQuotaTest, TheRamQuotaCountsThePoolSlotsATenantsChunksTake) {
  Start("ram-only");
  auto mid = Connect("token-mid");  // ram_quota=2MiB: 32 slots.
  LayoutSpec tiny = LayoutOfMiB(1, "tiny-model");
  tiny.num_kv_heads = 1;
  tiny.head_dim = 8;
  tiny.tokens_per_chunk = 16;
  const uint64_t chunk = tiny.ChunkBytes();
  ASSERT_LT(chunk, 4096u);
  auto reg = mid->RegisterLayout(tiny);
  ASSERT_TRUE(reg.ok()) << reg.status();
  constexpr uint64_t kChunks = 100;
  for (uint64_t n = 1; n <= kChunks; ++n) {
    ASSERT_TRUE(Put(*mid, reg->namespace_id, n, chunk).ok()) << n;
  }
  std::vector<ChunkKey> keys;
  for (uint64_t n = 1; n <= kChunks; ++n) keys.push_back(KeyOf(n));
  auto found = mid->Lookup(reg->namespace_id, keys);
  ASSERT_TRUE(found.ok()) << found.status();
  uint64_t in_ram = 0;
  for (v1::Tier t : found->tiers) in_ram += t == v1::TIER_RAM;
  EXPECT_EQ(in_ram, 32u) << "one 64 KiB slot each, in a 2 MiB quota";
  EXPECT_EQ(found->tiers.back(), v1::TIER_RAM);  // The newest kept.
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="mid",tier="ram"})"), 2.0 * kMiB);
}

TEST_F(TenantQuotaTest, AChunkLargerThanTheQuotaIsInvalidArgumentAndStoresNothing) {
  Start("ram-only");
  const uint64_t big_ns = Register(*small_, 4);  // 4 MiB chunks; the RAM quota is 3 MiB.
  ASSERT_TRUE(Put(*small_, ns_, 1).ok());
  absl::Status s = Put(*small_, big_ns, 1, 4 * kMiB);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("ram_quota"), std::string::npos) << s;
  EXPECT_EQ(Where(*small_, 1, 1), "r");  // Nothing of the tenant's was evicted for it.
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_refusals_total{quota="ram",tenant="small"})"), 1);
}

// A layout registered under larger limits than the daemon now has: its chunks cannot be
// stored at all, FAILED_PRECONDITION, before the tenant's quota makes room for them.
// Once the quota evicted the tenant's chunks first and could then answer
// RESOURCE_EXHAUSTED ("retry"), so a retrying client emptied its own cache for nothing.
TEST_F(TenantQuotaTest, AChunkTheDaemonCanNoLongerStoreEvictsNothingForItsQuota) {
  Start("write-through");
  const uint64_t two_mib = Register(*small_, 2);
  args_.push_back("--max-chunk-size=1MiB");
  ASSERT_NO_FATAL_FAILURE(Restart());
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*small_, ns_, n).ok()) << n;
  ASSERT_EQ(Where(*small_, 1, 3), "rrr");  // small's RAM quota, full.
  absl::Status s = Put(*small_, two_mib, 9, 2 * kMiB);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("cannot be stored"), std::string::npos) << s;
  EXPECT_EQ(Where(*small_, 1, 3), "rrr");
}

// A chunk larger than the tenant's RAM quota but within its SSD quota can never be
// stored either (every put goes through RAM). It once had the SSD quota make room
// first, evicting the tenant's SSD chunks for a put then refused.
TEST_F(TenantQuotaTest, AChunkThatCanNeverFitTheRamQuotaEvictsNothingFromSsd) {
  Start("write-through",
        "tenant narrow ram_quota=1MiB ssd_quota=4MiB\n" + TokenLine("narrow", "token-narrow"));
  std::unique_ptr<KvTierClient> narrow = Connect("token-narrow");
  ASSERT_EQ(Register(*narrow, 1), ns_);
  const uint64_t two_mib = Register(*narrow, 2);
  for (uint64_t n = 1; n <= 4; ++n) ASSERT_TRUE(Put(*narrow, ns_, n).ok()) << n;
  ASSERT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="narrow",tier="ssd"})"), 4.0 * kMiB);
  absl::Status s = Put(*narrow, two_mib, 9, 2 * kMiB);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("ram_quota"), std::string::npos) << s;
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="narrow",tier="ssd"})"), 4.0 * kMiB);
  EXPECT_EQ(Where(*narrow, 1, 4), "sssr");
}

// A chunk larger than the whole pinned quota can never be pinned: INVALID_ARGUMENT
// naming the quota, not RESOURCE_EXHAUSTED, which would have the client retry forever.
TEST_F(TenantQuotaTest, AChunkLargerThanThePinnedQuotaIsInvalidArgument) {
  Start("ram-only");
  const uint64_t two_mib = Register(*small_, 2);  // The pinned quota is 1 MiB.
  ASSERT_TRUE(Put(*small_, two_mib, 1, 2 * kMiB).ok());
  auto pinned = small_->Pin(two_mib, {KeyOf(1)}, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(pinned.status())) << pinned.status();
  EXPECT_NE(pinned.status().message().find("pinned_quota"), std::string::npos)
      << pinned.status();
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_refusals_total{quota="pinned",tenant="small"})"), 1);
  // A chunk within the quota still pins.
  ASSERT_TRUE(Put(*small_, ns_, 1).ok());
  EXPECT_TRUE(small_->Pin(ns_, {KeyOf(1)}, 0).ok());
}

// Keys that could never be pinned together (2 MiB of 1 MiB chunks against a 1 MiB
// pinned quota) are refused as final before any is pinned: pinning part of them and
// then answering RESOURCE_EXHAUSTED had the client retry forever, holding the quota.
TEST_F(TenantQuotaTest, KeysThatCanNeverBePinnedTogetherAreRefusedAndNoneIsPinned) {
  Start("ram-only");
  ASSERT_TRUE(Put(*small_, ns_, 1).ok());
  ASSERT_TRUE(Put(*small_, ns_, 2).ok());
  auto pinned = small_->Pin(ns_, {KeyOf(1), KeyOf(2), KeyOf(1), KeyOf(77)}, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(pinned.status())) << pinned.status();
  EXPECT_NE(pinned.status().message().find("2 chunks together"), std::string::npos)
      << pinned.status();
  EXPECT_NE(pinned.status().message().find("pinned_quota"), std::string::npos)
      << pinned.status();
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="small",tier="pinned"})"), 0);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_refusals_total{quota="pinned",tenant="small"})"), 1);
  // A key twice and an absent key cost nothing: one chunk still pins.
  auto one = small_->Pin(ns_, {KeyOf(1), KeyOf(1), KeyOf(77)}, 0);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->pinned, 2u);
  EXPECT_EQ(one->not_found, 1u);
}

// Layouts are kept until the data directory is cleared, so a tenant may register its
// share and no more: past it FAILED_PRECONDITION (retrying cannot help), while one it
// registered already is still answered, and other tenants register theirs.
TEST_F(TenantQuotaTest, ATenantRegistersItsShareOfLayoutsAndNoMore) {
  Start("ram-only");  // small has registered one layout (ns_); its max_layouts is 3.
  // Layouts the daemon refuses (chunks larger than the 64 MiB pool) use up nothing.
  for (int i = 0; i < 3; ++i) {
    auto huge = small_->RegisterLayout(LayoutOfMiB(128));
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kFailedPrecondition) << huge.status();
  }
  ASSERT_NE(Register(*small_, 2), 0u);
  ASSERT_NE(Register(*small_, 3), 0u);
  auto fourth = small_->RegisterLayout(LayoutOfMiB(4));
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kFailedPrecondition) << fourth.status();
  EXPECT_NE(fourth.status().message().find("max_layouts"), std::string::npos) << fourth.status();
  auto again = small_->RegisterLayout(LayoutOfMiB(2));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_registered);
  EXPECT_EQ(Register(*big_, 4), LayoutOfMiB(4).NamespaceId()) << "big has a share of its own";
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_refusals_total{quota="layouts",tenant="small"})"), 1);
}

// Layouts outlive the daemon (the SSD tier keeps them), and so does a tenant's share of
// them: the count once started from zero at each start, so every restart let a tenant
// register max_layouts more, until max_layouts was full for everyone. Re-registering a
// layout it holds takes none of the share, whatever the run it was registered in.
TEST_F(TenantQuotaTest, ATenantsShareOfLayoutsCountsThoseOfEarlierRuns) {
  Start("write-through");  // small has registered one layout (ns_); its max_layouts is 3.
  ASSERT_NE(Register(*small_, 2), 0u);
  ASSERT_NE(Register(*small_, 3), 0u);
  ASSERT_NO_FATAL_FAILURE(Restart());
  auto fourth = small_->RegisterLayout(LayoutOfMiB(4));
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kFailedPrecondition) << fourth.status();
  for (uint32_t mib : {1, 2, 3}) {
    auto again = small_->RegisterLayout(LayoutOfMiB(mib));
    ASSERT_TRUE(again.ok()) << mib << ": " << again.status();
    EXPECT_TRUE(again->already_registered);
  }
  EXPECT_EQ(Register(*big_, 4), LayoutOfMiB(4).NamespaceId()) << "big has a share of its own";
}

// Without a pinned_quota of its own, a tenant's pins are bounded by its ram_quota: a pin
// brings a chunk from SSD into RAM without any put's eviction, and a pinned chunk stays.
TEST_F(TenantQuotaTest, WithoutAPinnedQuotaPinsStopAtTheRamQuota) {
  Start("write-through");
  auto mid = Connect("token-mid");
  ASSERT_EQ(Register(*mid, 1), ns_);
  for (uint64_t n = 1; n <= 4; ++n) ASSERT_TRUE(Put(*mid, ns_, n).ok()) << n;
  EXPECT_EQ(Where(*mid, 1, 4), "ssrr") << "two in RAM (the quota), all on SSD";
  auto two = mid->Pin(ns_, {KeyOf(3), KeyOf(4)}, 0);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->pinned, 2u);
  auto third = mid->Pin(ns_, {KeyOf(1)}, 0);  // On SSD only: a pin would promote it.
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_NE(third.status().message().find("ram_quota"), std::string::npos) << third.status();
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="mid",tier="pinned"})"), 2.0 * kMiB);
  ASSERT_TRUE(mid->Unpin(ns_, {KeyOf(4)}).ok());
  EXPECT_TRUE(mid->Pin(ns_, {KeyOf(1)}, 0).ok());
}

TEST_F(TenantQuotaTest, ReadsIntoRamStayWithinTheRamQuotaAndEvictOnlyTheTenantsOwn) {
  Start("write-through");
  auto mid = Connect("token-mid");
  ASSERT_EQ(Register(*mid, 1), ns_);
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok()) << n;
  for (uint64_t n = 1; n <= 4; ++n) ASSERT_TRUE(Put(*mid, ns_, n).ok()) << n;
  ASSERT_EQ(Where(*mid, 1, 4), "ssrr") << "two in RAM (the quota), all on SSD";
  auto get = [&](uint64_t n) {
    auto g = mid->Get(ns_, {KeyOf(n)});
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE((*g)[0].found) << n;
    EXPECT_EQ((*g)[0].data, PatternBytes(n, kMiB)) << n;
  };
  // With what mid holds in RAM pinned, a Get is served from SSD and promotes nothing.
  ASSERT_TRUE(mid->Pin(ns_, {KeyOf(3), KeyOf(4)}, 0).ok());
  get(1);
  EXPECT_EQ(Where(*mid, 1, 4), "ssrr");
  ASSERT_TRUE(mid->Unpin(ns_, {KeyOf(3), KeyOf(4)}).ok());
  // Unpinned, each Get brings its chunk into RAM in place of mid's least recently used.
  get(1);
  get(2);
  EXPECT_EQ(Where(*mid, 1, 4), "rrss");
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="mid",tier="ram"})"), 2.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_evicted_bytes_total{tenant="mid",tier="ram"})"),
            4.0 * kMiB);  // 1 and 2 at the puts, then 3 and 4.
  // A Hint's prefetch likewise: chunk 3 comes back in place of 1.
  auto hint = mid->Hint("mid-scheduler", std::vector<HintedRequest>{{ns_, {KeyOf(3)}}});
  ASSERT_TRUE(hint.ok()) << hint.status();
  ASSERT_EQ(hint->prefetching(), 1u);
  bool promoted = false;
  ASSERT_TRUE(mid->WatchEvents(ns_, 1, [&](const v1::EventBatch& batch) {
                   for (const v1::ChunkEvent& e : batch.events()) {
                     promoted |= e.kind() == v1::CHUNK_EVENT_PROMOTED &&
                                 e.key() == KeyOf(3).ToByteString();
                   }
                   return !promoted;
                 }).ok());
  EXPECT_EQ(Where(*mid, 1, 4), "srrs");
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="mid",tier="ram"})"), 2.0 * kMiB);
  // None of it came out of another tenant's share.
  EXPECT_EQ(Where(*big_, 1, 3), "rrr");
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="big",tier="ram"})"), 3.0 * kMiB);
  // After a restart (RAM empty, all on SSD) a tenant that only reads is held to its
  // quota too: its Gets name the namespace.
  Restart();
  mid = Connect("token-mid");
  for (uint64_t n = 1; n <= 4; ++n) get(n);
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="mid",tier="ram"})"), 2.0 * kMiB);
}

TEST_F(TenantQuotaTest, PinsStopAtThePinnedQuotaAndPinnedChunksAreNotEvicted) {
  Start("ram-only");
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*small_, ns_, n).ok());
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok());
  ASSERT_TRUE(small_->Pin(ns_, {KeyOf(1)}, 0).ok());
  auto second = small_->Pin(ns_, {KeyOf(2)}, 0);
  EXPECT_TRUE(absl::IsResourceExhausted(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("pinned_quota"), std::string::npos);
  auto again = small_->Pin(ns_, {KeyOf(1)}, 0);  // Already pinned: only extended.
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->pinned, 1u);
  // Another tenant's pins do not count against small's quota, nor small's against it.
  auto other = big_->Pin(ns_, {KeyOf(1), KeyOf(2)}, 0);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->pinned, 2u);
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="small",tier="pinned"})"), 1.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_refusals_total{quota="pinned",tenant="small"})"), 1);
  // The pinned chunk 1 is small's least recently used, but two more puts evict 2 and 3.
  ASSERT_TRUE(Put(*small_, ns_, 4).ok());
  ASSERT_TRUE(Put(*small_, ns_, 5).ok());
  EXPECT_EQ(Where(*small_, 1, 5), "r--rr");
  // After an unpin the next pin fits.
  ASSERT_TRUE(small_->Unpin(ns_, {KeyOf(1)}).ok());
  auto next = small_->Pin(ns_, {KeyOf(4)}, 0);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->pinned, 1u);
}

TEST_F(TenantQuotaTest, SsdQuotaEvictsTheTenantsOwnChunksFromSsdOnly) {
  Start("write-through");
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok());
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*small_, ns_, n).ok());
  // small's SSD quota (2 MiB) holds its two newest; the RAM quota (3 MiB) all three.
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="small",tier="ssd"})"), 2.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="small",tier="ram"})"), 3.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="big",tier="ssd"})"), 3.0 * kMiB);
  EXPECT_EQ(Metric(R"(kvtier_tenant_quota_evicted_bytes_total{tenant="small",tier="ssd"})"),
            1.0 * kMiB);
  // A fourth put evicts small's oldest left on SSD (chunk 2) and its oldest in RAM
  // (chunk 1, already off SSD): 1 is then nowhere, 2 in RAM only, 3 and 4 in both.
  ASSERT_TRUE(Put(*small_, ns_, 4).ok());
  EXPECT_EQ(Where(*small_, 1, 4), "-rrr");
  EXPECT_EQ(Where(*big_, 1, 3), "rrr");
  EXPECT_EQ(Metric(R"(kvtier_tenant_bytes{tenant="small",tier="ssd"})"), 2.0 * kMiB);
}

TEST_F(TenantQuotaTest, StreamsAndLeasesStopAtTheTenantsOwnBound) {
  Start("ram-only");
  ASSERT_TRUE(Put(*small_, ns_, 1).ok());
  ASSERT_TRUE(Put(*big_, ns_, 1).ok());
  {
    // A Put stream of small's, held open before its first frame.
    grpc::ClientContext held;
    held.AddMetadata("authorization", "Bearer token-small");
    v1::PutResponse resp;
    auto writer = small_->stub()->Put(&held, &resp);
    // Until the daemon has admitted it (counted as small's open stream).
    const std::string open = R"(kvtier_tenant_streams_open{tenant="small"})";
    for (int i = 0; i < 500 && Metric(open) < 1; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(Metric(open), 1);
    auto refused = small_->Get(ns_, {KeyOf(1)});
    EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
    EXPECT_NE(refused.status().message().find("tenant small has its max_streams (1)"),
              std::string::npos)
        << refused.status();
    EXPECT_EQ(Metric(R"(kvtier_tenant_streams_refused_total{tenant="small"})"), 1);
    // Another tenant is not held back by small's bound.
    auto other = big_->Get(ns_, {KeyOf(1)});
    EXPECT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(Metric(R"(kvtier_tenant_streams_refused_total{tenant="big"})"), -1);  // None.
    writer->WritesDone();
    EXPECT_TRUE(writer->Finish().ok());
  }
  // The place is small's again once its stream ended.
  auto again = small_->Get(ns_, {KeyOf(1)});
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Metric(R"(kvtier_tenant_streams_open{tenant="small"})"), 0);

  // One lease at a time for small: a second Lookup still answers, without a lease.
  auto first = small_->Lookup(ns_, {KeyOf(1)}, /*lease_seconds=*/60);
  auto second = small_->Lookup(ns_, {KeyOf(1)}, 60);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(first->lease_id, 0u);
  EXPECT_EQ(second->lease_id, 0u);
  EXPECT_EQ(second->prefix_hits, 1u);
  auto big_lease = big_->Lookup(ns_, {KeyOf(1)}, 60);
  ASSERT_TRUE(big_lease.ok());
  EXPECT_NE(big_lease->lease_id, 0u);
  ASSERT_TRUE(small_->ReleaseLease(ns_, first->lease_id).ok());
  auto third = small_->Lookup(ns_, {KeyOf(1)}, 60);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(third->lease_id, 0u);
}

// A subscription outlives its admission: once the tenants file no longer lists its
// token, its next batch ends it UNAUTHENTICATED instead of delivering the event.
TEST_F(TenantQuotaTest, AnEventsSubscriptionEndsWhenItsTokenIsRevoked) {
  Start("ram-only");
  auto mid = Connect("token-mid");
  ASSERT_EQ(Register(*mid, 1), ns_);
  // Two events before the subscription (sequences 1 and 2): it replays the second,
  // which shows it open, admitted under the first tenants file.
  ASSERT_TRUE(Put(*mid, ns_, 1).ok());
  ASSERT_TRUE(Put(*mid, ns_, 4).ok());
  absl::Status watched;
  std::atomic<int> batches{0};
  std::atomic<bool> revoked{false};  // Then a batch that still arrives ends the watch.
  std::thread watcher([&] {
    watched = mid->WatchEvents(ns_, 1, [&](const v1::EventBatch&) {
      ++batches;
      return !revoked.load();
    });
  });
  const absl::Time open_by = absl::Now() + absl::Seconds(30);
  while (batches.load() == 0 && absl::Now() < open_by) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(batches.load(), 1);
  // Revoke token-mid, give mid a new one.
  std::ofstream(dir_ + ".tenants", std::ios::trunc)
      << "tenant small\ntenant big\ntenant mid ram_quota=2MiB\n"
      << TokenLine("small", "token-small") << TokenLine("big", "token-big")
      << TokenLine("mid", "token-mid-2") << "# rotated\n";
  auto rotated = Connect("token-mid-2");
  // Refused until the daemon re-reads the file (checked once a second).
  absl::Status put;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (true) {
    put = Put(*rotated, ns_, 2);
    if (!absl::IsUnauthenticated(put) || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(put.ok()) << put;
  revoked = true;
  EXPECT_TRUE(Put(*rotated, ns_, 3).ok());  // Ends a watch that was not ended.
  watcher.join();  // The event of the put of 2 ended the old subscription.
  EXPECT_TRUE(absl::IsUnauthenticated(watched)) << watched;
  EXPECT_EQ(batches.load(), 1);
}

// A tenant removed from the tenants file leaves no pins behind: nothing can reach its
// namespaces any more, and pins without an expiry held their share of the pool (and of
// max_pinned_fraction, against every other tenant) until a restart.
TEST_F(TenantQuotaTest, ARemovedTenantsPinsGo) {
  Start("ram-only");
  auto mid = Connect("token-mid");
  ASSERT_EQ(Register(*mid, 1), ns_);
  ASSERT_TRUE(Put(*mid, ns_, 1).ok());
  const ChunkKey key = KeyOf(1);
  auto pinned = mid->Pin(ns_, {&key, 1}, /*ttl_seconds=*/0);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_EQ(Metric(R"(kvtier_tier_pinned_bytes{tier="ram"})"), 1.0 * kMiB);
  std::ofstream(dir_ + ".tenants", std::ios::trunc)
      << "tenant small\ntenant big\n"
      << TokenLine("small", "token-small") << TokenLine("big", "token-big") << "# no mid\n";
  // The daemon re-reads the file at a request once a second; the first unary call
  // after it unpins.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (Metric(R"(kvtier_tier_pinned_bytes{tier="ram"})") != 0 && absl::Now() < deadline) {
    auto looked = big_->Lookup(ns_, {&key, 1});
    ASSERT_TRUE(looked.ok()) << looked.status();
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(Metric(R"(kvtier_tier_pinned_bytes{tier="ram"})"), 0);
  EXPECT_TRUE(absl::IsUnauthenticated(Put(*mid, ns_, 2)));
}

// A tenant's leases hold at most its share of max_lease_bytes: past it a Lookup still
// answers, without a lease, and the other tenants' shares are untouched.
TEST_F(TenantQuotaTest, ATenantsLeasesHoldAtMostItsShareOfTheLeaseBytes) {
  Start("ram-only");
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok()) << n;
  auto all = big_->Lookup(ns_, {KeyOf(1), KeyOf(2), KeyOf(3)}, /*lease_seconds=*/60);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->prefix_hits, 3u);
  EXPECT_EQ(all->lease_id, 0u) << "3 MiB is past big's share (2 MiB of 6)";
  auto two = big_->Lookup(ns_, {KeyOf(1), KeyOf(2)}, 60);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_NE(two->lease_id, 0u);
  auto third = big_->Lookup(ns_, {KeyOf(3)}, 60);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->lease_id, 0u) << "big's share is held";
  ASSERT_TRUE(Put(*small_, ns_, 1).ok());
  auto small = small_->Lookup(ns_, {KeyOf(1)}, 60);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_NE(small->lease_id, 0u) << "small's share is its own";
  ASSERT_TRUE(big_->ReleaseLease(ns_, two->lease_id).ok());
  auto again = big_->Lookup(ns_, {KeyOf(3)}, 60);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->lease_id, 0u) << "a released lease gives the bytes back";
}

// Deleting or clearing leased chunks gives their bytes back to the tenant's share (and
// to the pool): a lease once held them on, counted by no quota, for its life.
TEST_F(TenantQuotaTest, DeletingLeasedChunksGivesTheirBytesBack) {
  Start("ram-only");
  for (uint64_t n = 1; n <= 3; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok()) << n;
  auto two = big_->Lookup(ns_, {KeyOf(1), KeyOf(2)}, /*lease_seconds=*/60);
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_NE(two->lease_id, 0u);
  auto refused = big_->Lookup(ns_, {KeyOf(3)}, 60);
  ASSERT_TRUE(refused.ok()) << refused.status();
  ASSERT_EQ(refused->lease_id, 0u) << "big's share is held";
  const ChunkKey leased[] = {KeyOf(1), KeyOf(2)};
  auto deleted = big_->Delete(ns_, leased);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 2u);
  auto third = big_->Lookup(ns_, {KeyOf(3)}, 60);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_NE(third->lease_id, 0u) << "the deleted chunks' bytes were still held";
  auto cleared = big_->Clear(ns_);
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  for (uint64_t n = 4; n <= 5; ++n) ASSERT_TRUE(Put(*big_, ns_, n).ok()) << n;
  auto again = big_->Lookup(ns_, {KeyOf(4), KeyOf(5)}, 60);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->lease_id, 0u) << "the cleared chunk's bytes were still held";
}

// An Events subscription of `token`'s tenant on a raw stub, admitted once its headers
// arrive (the daemon sends them when the subscription holds its places).
struct Subscription {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::EventBatch>> reader;
  Subscription(KvTierClient& c, const std::string& token, uint64_t ns) {
    ctx.AddMetadata("authorization", "Bearer " + token);
    v1::EventsRequest req;
    req.set_namespace_id(ns);
    reader = c.stub()->Events(&ctx, req);
  }
};

TEST_F(TenantQuotaTest, EventsSubscriptionsStopAtTheTenantsShare) {
  Start("ram-only");
  Subscription held(*small_, "token-small", ns_);
  held.reader->WaitForInitialMetadata();
  const std::string open = R"(kvtier_tenant_event_subscribers_open{tenant="small"})";
  ASSERT_EQ(Metric(open), 1);  // Counted before the daemon sent the headers.

  // small's second subscription is refused, naming its bound, with a retry hint.
  Subscription second(*small_, "token-small", ns_);
  v1::EventBatch batch;
  EXPECT_FALSE(second.reader->Read(&batch));
  const grpc::Status refused = second.reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("tenant small has its max_subscribers (1) Events"),
            std::string::npos)
      << refused.error_message();
  EXPECT_EQ(second.ctx.GetServerTrailingMetadata().count("kvtier-retry-after-ms"), 1u);
  EXPECT_EQ(Metric(R"(kvtier_tenant_event_subscribers_refused_total{tenant="small"})"), 1);

  // Another tenant subscribes within its own share.
  Subscription other(*big_, "token-big", ns_);
  other.reader->WaitForInitialMetadata();
  EXPECT_EQ(Metric(R"(kvtier_tenant_event_subscribers_open{tenant="big"})"), 1);
  EXPECT_EQ(Metric("kvtier_event_subscribers_open"), 2);

  // small's place comes back when its subscription ends.
  held.ctx.TryCancel();
  EXPECT_EQ(held.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 500 && Metric(open) > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(Metric(open), 0);
  Subscription again(*small_, "token-small", ns_);
  again.reader->WaitForInitialMetadata();
  EXPECT_EQ(Metric(open), 1);
  again.ctx.TryCancel();
  other.ctx.TryCancel();
  again.reader->Finish();
  other.reader->Finish();
}

}  // namespace
}  // namespace kvtier
