// TenantTable (the tenants file), TenantScope (namespace mapping) and Authenticator
// (credentials to tenants, request rates, reloads), with an injected clock.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "server/authenticator.h"
#include "server/tenant_scope.h"
#include "server/tenant_table.h"
#include "tests/support/fake_clock.h"
#include "tests/support/tenants_file.h"

namespace kvtier {
namespace {

using testing::TokenLine;

const std::string& Table() {
  static const std::string* text = new std::string(
      "# teams\n"
      "tenant team-a\n"
      "tenant team-b role=user requests_per_second=2 burst=3 ram_quota=4GiB ssd_quota=1TiB "
      "pinned_quota=1048576 max_streams=8 max_leases=32 max_subscribers=4 max_layouts=16\n"
      "tenant ops role=admin   # operators\n" +
      TokenLine("team-a", "secret-a") + TokenLine("ops", "secret-ops") +
      "cert team-a worker-a.example\n"
      "uid team-b 4242\n");
  return *text;
}

TEST(TenantTableTest, ParsesEveryDirective) {
  auto t = TenantTable::Parse(Table());
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->tenants().size(), 3u);
  EXPECT_EQ(t->tenants()[t->FindToken("secret-a")].name, "team-a");
  EXPECT_EQ(t->tenants()[t->FindToken("secret-ops")].name, "ops");
  EXPECT_TRUE(t->tenants()[t->FindToken("secret-ops")].admin);
  EXPECT_FALSE(t->tenants()[t->FindTenant("team-a")].admin);
  EXPECT_EQ(t->FindToken("secret-b"), -1);
  EXPECT_EQ(t->FindToken(""), -1);
  EXPECT_EQ(t->tenants()[t->FindCertIdentity("worker-a.example")].name, "team-a");
  EXPECT_EQ(t->FindCertIdentity("worker-b.example"), -1);
  EXPECT_EQ(t->tenants()[t->FindUid(4242)].name, "team-b");
  EXPECT_EQ(t->FindUid(4243), -1);
  const TenantSpec& b = t->tenants()[t->FindTenant("team-b")];
  EXPECT_EQ(b.requests_per_second, 2);
  EXPECT_EQ(b.burst, 3);
  EXPECT_EQ(b.quota.ram_bytes, 4ull << 30);
  EXPECT_EQ(b.quota.ssd_bytes, 1ull << 40);
  EXPECT_EQ(b.quota.pinned_bytes, 1ull << 20);
  EXPECT_EQ(b.quota.streams, 8u);
  EXPECT_EQ(b.quota.leases, 32u);
  EXPECT_EQ(b.quota.subscribers, 4u);
  EXPECT_EQ(b.quota.layouts, 16u);
  EXPECT_EQ(b.quota.tenants, 3u);
  EXPECT_EQ(t->tenants()[t->FindTenant("team-a")].quota.layouts, 0u);  // The daemon's share.
  // Unset: an equal share of the daemon's Events subscribers among the three tenants.
  EXPECT_EQ(t->tenants()[t->FindTenant("team-a")].quota.subscribers,
            TenantTable::kEventSubscribers / 3);
  EXPECT_EQ(t->tenants()[t->FindTenant("team-a")].quota.streams, 0u);  // No bound of its own.
  EXPECT_FALSE(t->tenants()[t->FindTenant("team-a")].quota.any());  // Unlimited.
}

TEST(TenantTableTest, RejectsBadLinesNamingThem) {
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {"tenant\n", "line 1: 'tenant' needs a tenant name"},
      {"tenant a/b\n", "line 1: tenant name 'a/b'"},
      {"tenant a\ntenant a\n", "line 2: tenant 'a' declared twice"},
      {"tenant a role=root\n", "line 1: role 'root'"},
      {"tenant a requests_per_second=-1\n", "line 1: requests_per_second='-1'"},
      {"tenant a requests_per_second=5 burst=0.5\n", "line 1: burst must be at least 1"},
      {"tenant a colour=blue\n", "line 1: unknown setting 'colour=blue'"},
      {"tenant a ram_quota=lots\n", "line 1: ram_quota='lots': expected a size"},
      {"tenant a pinned_quota=-1MiB\n", "line 1: pinned_quota='-1MiB'"},
      {"tenant a max_layouts=0\n", "line 1: max_layouts='0'"},
      {"tenant a max_layouts=many\n", "line 1: max_layouts='many'"},
      {"tenant a max_streams=-1\n", "line 1: max_streams='-1': expected a whole number"},
      {"tenant a max_leases=2000000\n", "line 1: max_leases='2000000'"},
      {"tenant a max_streams=1.5\n", "line 1: max_streams='1.5'"},
      {"tenant a max_subscribers=0\n", "line 1: max_subscribers='0': expected a whole number 1"},
      {"tenant a max_subscribers=1025\n", "line 1: max_subscribers='1025'"},
      {"\n\ntoken a sha256:00\n", "line 3: tenant 'a' is not declared"},
      {"tenant a\ntoken a plaintext-token\n", "line 2: token: expected sha256:"},
      {"tenant a\ntoken a sha256:" + std::string(63, '0') + "g\n", "line 2: token: expected"},
      {"tenant a\n" + TokenLine("a", "t") + TokenLine("a", "t"), "line 3: token: the same token"},
      {"tenant a\nuid a root\n", "line 2: uid: 'root' is not a user id"},
      {"tenant a\nuid a 1\nuid a 1\n", "line 3: uid: 1 is listed twice"},
      {"tenant a\ncert a x y\n", "line 2: 'cert' takes a tenant and one value"},
      {"group a\n", "line 1: unknown directive 'group'"},
  };
  for (const Case& c : cases) {
    auto t = TenantTable::Parse(c.text);
    ASSERT_FALSE(t.ok()) << c.text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.message), std::string::npos)
        << t.status().message() << " does not contain " << c.message;
  }
}

TEST(TenantScopeTest, ImplicitKeepsIdsNamedTenantsGetTheirOwn) {
  const uint64_t ns = 0x1234567890abcdefull;
  EXPECT_EQ(TenantScope::Implicit().Internal(ns), ns);
  const TenantScope a = TenantScope::Named("team-a", false);
  const TenantScope b = TenantScope::Named("team-b", false);
  EXPECT_NE(a.Internal(ns), ns);
  EXPECT_NE(a.Internal(ns), b.Internal(ns));
  EXPECT_NE(a.Internal(ns), a.Internal(ns + 1));
  EXPECT_EQ(a.Internal(ns), TenantScope::Named("team-a", true).Internal(ns));  // Role aside.
  EXPECT_EQ(a.Internal(0), 0u);
  // Pinned: a tenant's namespaces stay where they are across restarts and versions.
  EXPECT_EQ(TenantScope::Named("t", false).Internal(1), TenantScope::Named("t", false).Internal(1));
  EXPECT_EQ(a.ScopedName("router-1"), "team-a/router-1");
  EXPECT_EQ(TenantScope::Implicit().ScopedName("router-1"), "router-1");
}

class AuthenticatorTest : public ::testing::Test {
 protected:
  void Write(const std::string& text) {
    std::ofstream(path_, std::ios::trunc) << text;
  }
  std::unique_ptr<Authenticator> Make() {
    AuthenticatorOptions options;
    options.tenants_file = path_;
    options.clock = clock_.AsFunction();
    auto a = Authenticator::Create(std::move(options), nullptr);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? *std::move(a) : nullptr;
  }
  static CallerCredentials Token(const std::string& token) {
    CallerCredentials c;
    c.authorization = "Bearer " + token;
    return c;
  }

  testing::TempDir dir_;
  std::string path_ = dir_.path() + "/tenants";
  testing::FakeClock clock_;
};

TEST_F(AuthenticatorTest, WithoutAFileEveryoneIsTheImplicitAdmin) {
  auto a = Authenticator::Create({}, nullptr);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE((*a)->enabled());
  Authenticator::Result r = (*a)->Authenticate(CallerCredentials{});
  ASSERT_TRUE(r.scope.has_value());
  EXPECT_TRUE(r.scope->implicit());
  EXPECT_TRUE(r.scope->admin());
}

TEST_F(AuthenticatorTest, AMissingOrBadFileStopsStartUp) {
  AuthenticatorOptions options;
  options.tenants_file = path_;
  auto missing = Authenticator::Create(options, nullptr);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("option tenants_file"), std::string::npos);
  Write("tenant a\nbogus\n");
  auto bad = Authenticator::Create(options, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 2"), std::string::npos) << bad.status();
  // A directory reads as an empty table: every request would be refused, silently.
  options.tenants_file = ::testing::TempDir();
  auto dir = Authenticator::Create(options, nullptr);
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("is not a regular file"), std::string::npos)
      << dir.status();
}

TEST_F(AuthenticatorTest, MapsEachKindOfCredential) {
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  auto token = a->Authenticate(Token("secret-a"));
  ASSERT_TRUE(token.scope.has_value()) << token.denied.status;
  EXPECT_EQ(token.scope->tenant(), "team-a");
  EXPECT_FALSE(token.scope->admin());
  EXPECT_TRUE(a->Authenticate(Token("secret-ops")).scope->admin());

  CallerCredentials cert;
  cert.cert_identities = {"CN-we-do-not-know", "worker-a.example"};
  EXPECT_EQ(a->Authenticate(cert).scope->tenant(), "team-a");

  CallerCredentials uid;
  uid.unix_uid = 4242;
  EXPECT_EQ(a->Authenticate(uid).scope->tenant(), "team-b");
  // The scope carries the tenant's quotas to the handlers that enforce them.
  EXPECT_EQ(a->Authenticate(uid).scope->quota().ram_bytes, 4ull << 30);
}

TEST_F(AuthenticatorTest, RefusesMissingWrongAndMalformedCredentials) {
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  auto none = a->Authenticate(CallerCredentials{});
  EXPECT_FALSE(none.scope.has_value());
  EXPECT_EQ(none.denied.status.code(), absl::StatusCode::kUnauthenticated);

  auto wrong = a->Authenticate(Token("secret-x"));
  EXPECT_EQ(wrong.denied.status.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(wrong.denied.status.message().find("not one the tenants file lists"), std::string::npos);

  CallerCredentials basic;
  basic.authorization = "Basic dXNlcjpwYXNz";
  EXPECT_EQ(a->Authenticate(basic).denied.status.code(), absl::StatusCode::kUnauthenticated);

  // A wrong token is not rescued by a valid certificate or uid.
  CallerCredentials mixed = Token("secret-x");
  mixed.cert_identities = {"worker-a.example"};
  mixed.unix_uid = 4242;
  EXPECT_FALSE(a->Authenticate(mixed).scope.has_value());

  CallerCredentials unknown_uid;
  unknown_uid.unix_uid = 7;
  auto u = a->Authenticate(unknown_uid);
  EXPECT_EQ(u.denied.status.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(u.denied.status.message().find("uid 7"), std::string::npos);
}

TEST_F(AuthenticatorTest, RequestRateIsEnforcedPerTenantWithARetryHint) {
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  CallerCredentials b;
  b.unix_uid = 4242;  // team-b: 2/s, burst 3.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(a->Authenticate(b).scope.has_value()) << i;
  auto over = a->Authenticate(b);
  ASSERT_FALSE(over.scope.has_value());
  EXPECT_EQ(over.denied.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.denied.retry_after, absl::Milliseconds(500));
  // Another tenant is not slowed by team-b.
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(a->Authenticate(Token("secret-a")).scope.has_value());
  clock_.Advance(absl::Milliseconds(499));
  EXPECT_FALSE(a->Authenticate(b).scope.has_value());
  clock_.Advance(absl::Milliseconds(600));  // Refused requests cost nothing.
  EXPECT_TRUE(a->Authenticate(b).scope.has_value());
  EXPECT_TRUE(a->Authenticate(b).scope.has_value());
  EXPECT_FALSE(a->Authenticate(b).scope.has_value());
}

TEST_F(AuthenticatorTest, ReloadsAChangedFileAndKeepsTheLastGoodOne) {
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(a->Authenticate(Token("secret-a")).scope.has_value());
  // Token rotation: secret-a out, secret-a2 in (a different size, so the change is seen
  // even within the file system's timestamp granularity).
  Write("tenant team-a\n" + TokenLine("team-a", "secret-a2") + "# rotated\n");
  EXPECT_TRUE(a->Authenticate(Token("secret-a")).scope.has_value()) << "checked at most 1/s";
  clock_.Advance(absl::Seconds(1));
  EXPECT_FALSE(a->Authenticate(Token("secret-a")).scope.has_value());
  EXPECT_EQ(a->Authenticate(Token("secret-a2")).scope->tenant(), "team-a");
  // A broken edit leaves the last good table in force.
  Write("tenant team-a\ntoken team-a oops\n");
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(a->Authenticate(Token("secret-a2")).scope->tenant(), "team-a");
  EXPECT_EQ(a->reload_failures(), 1u);
}

// A file caught between a truncate and its write (`cat new > tenants`) reads as empty,
// which once loaded as a table with no tenant: every request refused and every open
// call ended until the next check. A table that lists no tenant is refused, at start-up
// too, and the last good one stays.
TEST_F(AuthenticatorTest, AnEmptyTenantsFileIsRefusedAndTheLastGoodOneKept) {
  Write("");
  AuthenticatorOptions options;
  options.tenants_file = path_;
  auto empty = Authenticator::Create(options, nullptr);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("lists no tenant"), std::string::npos)
      << empty.status();
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  Write("# being rewritten\n");
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(a->Authenticate(Token("secret-a")).scope->tenant(), "team-a");
  EXPECT_EQ(a->reload_failures(), 1u);
}

// The clock that times rates and reloads stepping back (a wall clock corrected by NTP;
// the default is monotonic) once took the step out of a tenant's rate bucket, refusing
// it for as long, and postponed reloads, revocations included, by as long.
TEST_F(AuthenticatorTest, AClockSteppingBackNeitherEmptiesBucketsNorPostponesReloads) {
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  CallerCredentials b;
  b.unix_uid = 4242;  // team-b: 2/s, burst 3.
  ASSERT_TRUE(a->Authenticate(b).scope.has_value());
  clock_.Advance(-absl::Hours(1));
  Authenticator::Result r = a->Authenticate(b);
  EXPECT_TRUE(r.scope.has_value()) << r.denied.status;
  Write("tenant team-a\n" + TokenLine("team-a", "secret-a2") + "# secret-a revoked\n");
  clock_.Advance(absl::Seconds(1));
  EXPECT_FALSE(a->Authenticate(Token("secret-a")).scope.has_value());
  EXPECT_EQ(a->Authenticate(Token("secret-a2")).scope->tenant(), "team-a");
}

// An Events subscription outlives its admission; the daemon asks StillAdmits before each
// batch. A subscription opened with a token that a new tenants file removed once kept
// delivering events.
TEST_F(AuthenticatorTest, StillAdmitsFollowsTheTenantsFileAndCostsNoRate) {
  Write(Table());
  auto a = Make();
  ASSERT_NE(a, nullptr);
  CallerCredentials b;
  b.unix_uid = 4242;  // team-b: 2/s, burst 3.
  uint64_t generation_b = a->generation();
  ASSERT_TRUE(a->Authenticate(b).scope.has_value());
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(a->StillAdmits(b, "team-b", &generation_b).ok());
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(a->Authenticate(b).scope.has_value()) << "rate unspent";
  uint64_t generation_a = a->generation();
  EXPECT_TRUE(a->StillAdmits(Token("secret-a"), "team-a", &generation_a).ok());
  // secret-a removed; uid 4242 now team-a's: neither call is its tenant's any more.
  Write("tenant team-a\ntenant team-b\n" + TokenLine("team-a", "secret-a2") +
        "uid team-a 4242\n");
  clock_.Advance(absl::Seconds(1));
  absl::Status revoked = a->StillAdmits(Token("secret-a"), "team-a", &generation_a);
  EXPECT_EQ(revoked.code(), absl::StatusCode::kUnauthenticated) << revoked;
  absl::Status moved = a->StillAdmits(b, "team-b", &generation_b);
  EXPECT_EQ(moved.code(), absl::StatusCode::kUnauthenticated) << moved;
  EXPECT_NE(moved.message().find("no longer tenant team-b's"), std::string::npos) << moved;
  uint64_t generation_a2 = 0;  // Older than any table: checked.
  EXPECT_TRUE(a->StillAdmits(Token("secret-a2"), "team-a", &generation_a2).ok());
  EXPECT_EQ(generation_a2, a->generation());
}

}  // namespace
}  // namespace kvtier
