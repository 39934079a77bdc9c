#include "server/authenticator.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/registry.h"
#include "storage/log.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    AuthenticatorOptions options, prometheus::Registry* registry) {
  std::unique_ptr<Authenticator> auth(new Authenticator(std::move(options), registry));
  if (auth->enabled()) {
    absl::MutexLock lock(&auth->mu_);
    absl::Status s = auth->Load(/*initial=*/true);
    // Being written as the daemon starts: try a few times, 100 ms apart, before giving
    // up.
    for (int tries = 1; absl::IsUnavailable(s) && tries < 5; ++tries) {
      absl::SleepFor(absl::Milliseconds(100));
      s = auth->Load(/*initial=*/true);
    }
    if (absl::IsUnavailable(s)) s = absl::InvalidArgumentError(s.message());
    if (!s.ok()) return s;
  }
  return auth;
}

Authenticator::Authenticator(AuthenticatorOptions options, prometheus::Registry* registry)
    : options_(std::move(options)) {
  if (registry == nullptr) return;
  requests_ = &prometheus::BuildCounter()
                   .Name("kvtier_tenant_requests_total")
                   .Help("Requests by tenant and authentication outcome: ok, unauthenticated, "
                         "rate_limited (RESOURCE_EXHAUSTED), forbidden (admin operation)")
                   .Register(*registry);
  reload_failures_metric_ = &prometheus::BuildCounter()
                                 .Name("kvtier_tenants_file_reload_failures_total")
                                 .Help("Tenants file reloads that failed to parse; the "
                                       "previous table stays in force")
                                 .Register(*registry)
                                 .Add({});
}

void Authenticator::Count(const std::string& tenant, const char* outcome) {
  if (requests_ == nullptr) return;
  // Labels come from the tenants file (or are empty), so the series are bounded.
  requests_->Add({{"tenant", tenant}, {"outcome", outcome}}).Increment();
}

uint64_t Authenticator::reload_failures() const {
  absl::MutexLock lock(&mu_);
  return reload_failures_;
}

namespace {

// What tells one version of the file from another: its inode, size, and change and
// modification times (nanoseconds). An edit in place changes the times, a rename the
// inode.
std::string FileSignature(const struct stat& st) {
  return absl::StrCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                      st.st_mtim.tv_nsec, ":", st.st_ctim.tv_sec, ".", st.st_ctim.tv_nsec);
}

}  // namespace

absl::Status Authenticator::Load(bool initial) {
  struct stat st {};
  const std::string& path = options_.tenants_file;
  if (stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("option tenants_file: cannot read ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    // A directory reads as empty: no tenant, and every request refused.
    return absl::InvalidArgumentError(
        absl::StrCat("option tenants_file: ", path, " is not a regular file"));
  }
  const std::string signature = FileSignature(st);
  if (!initial && signature == file_signature_) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) {
    return absl::InvalidArgumentError(absl::StrCat("option tenants_file: cannot read ", path));
  }
  // Written to while it was read (`cat new > tenants` truncates, then writes): what was
  // read may be any part of it. Read again later rather than load a prefix.
  if (struct stat after {}; stat(path.c_str(), &after) != 0 || FileSignature(after) != signature) {
    return absl::UnavailableError(
        absl::StrCat("tenants file ", path, " changed while it was read; reading it again"));
  }
  file_signature_ = signature;  // A bad version is reported once, not at every check.
  auto table = TenantTable::Parse(text.str());
  if (!table.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("option tenants_file: ", path, ": ", table.status().message()));
  }
  if (table->tenants().empty()) {
    // Empty, or caught between a truncate and the write that follows: every request
    // would be refused, and every open call ended.
    return absl::InvalidArgumentError(absl::StrCat(
        "option tenants_file: ", path,
        " lists no tenant (replace the file with a rename, not by truncating it)"));
  }
  table_ = std::make_shared<const TenantTable>(*std::move(table));
  ++generation_;
  // Buckets of tenants that are gone go too; kept tenants keep their state.
  const TenantTable& loaded = *table_;
  absl::erase_if(buckets_, [&loaded](const auto& entry) { return loaded.FindTenant(entry.first) < 0; });
  if (!initial) LogInfo("tenants file ", path, " reloaded: ", table_->tenants().size(), " tenants");
  return absl::OkStatus();
}

void Authenticator::MaybeReload(absl::Time now) {
  // Due, or the clock stepped back past the last check.
  if (now < next_check_ && next_check_ - now <= options_.reload_check) return;
  next_check_ = now + options_.reload_check;
  absl::Status s = Load(/*initial=*/false);
  if (absl::IsUnavailable(s)) {
    LogInfo(s.message());  // Not a failure: the next check reads it whole.
  } else if (!s.ok()) {
    ++reload_failures_;
    if (reload_failures_metric_ != nullptr) reload_failures_metric_->Increment();
    LogError(s.message(), " (keeping the previous tenants)");
  }
}

int Authenticator::FindLocked(const CallerCredentials& creds, absl::Status* why) const {
  int index = -1;
  if (creds.authorization.has_value()) {
    absl::string_view value = *creds.authorization;
    if (!absl::ConsumePrefix(&value, "Bearer ") && !absl::ConsumePrefix(&value, "bearer ")) {
      *why = absl::UnauthenticatedError("authorization: expected 'Bearer <token>'");
      return -1;
    }
    index = table_->FindToken(absl::StripAsciiWhitespace(value));
    if (index < 0) {
      *why = absl::UnauthenticatedError(
          "authorization: the bearer token is not one the tenants file lists");
      return -1;
    }
  }
  for (size_t i = 0; index < 0 && i < creds.cert_identities.size(); ++i) {
    index = table_->FindCertIdentity(creds.cert_identities[i]);
  }
  if (index < 0 && creds.unix_uid.has_value()) index = table_->FindUid(*creds.unix_uid);
  if (index < 0) {
    std::string presented = creds.cert_identities.empty()
                                ? std::string()
                                : absl::StrCat(" (certificate identity '", creds.cert_identities[0],
                                               "' is not listed)");
    if (creds.unix_uid.has_value()) {
      absl::StrAppend(&presented, " (uid ", *creds.unix_uid, " is not listed)");
    }
    *why = absl::UnauthenticatedError(absl::StrCat(
        "no credentials this daemon accepts: send a bearer token, a client certificate, "
        "or connect on the Unix socket as a listed user", presented));
  }
  return index;
}

Authenticator::Result Authenticator::Authenticate(const CallerCredentials& creds) {
  Result result;
  if (!enabled()) {
    result.scope = TenantScope::Implicit();
    return result;
  }
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  MaybeReload(now);
  const int index = FindLocked(creds, &result.denied.status);
  if (index < 0) {
    Count("", "unauthenticated");
    return result;
  }
  const TenantSpec& spec = table_->tenants()[index];
  if (spec.requests_per_second > 0) {
    Bucket& b = buckets_[spec.name];
    if (b.last == absl::InfinitePast()) {
      b.tokens = spec.burst;
    } else {
      const absl::Duration elapsed = std::max(absl::ZeroDuration(), now - b.last);
      b.tokens = std::min(spec.burst,
                          b.tokens + absl::ToDoubleSeconds(elapsed) * spec.requests_per_second);
    }
    b.last = now;
    if (b.tokens < 1) {
      Count(spec.name, "rate_limited");
      result.denied.retry_after = absl::Seconds((1 - b.tokens) / spec.requests_per_second);
      result.denied.status = absl::ResourceExhaustedError(absl::StrCat(
          "tenant ", spec.name, ": over its request rate (", spec.requests_per_second,
          "/s); retry in ", absl::FormatDuration(absl::Ceil(result.denied.retry_after,
                                                            absl::Milliseconds(1)))));
      return result;
    }
    b.tokens -= 1;
  }
  Count(spec.name, "ok");
  result.scope = TenantScope::Named(spec.name, spec.admin, spec.quota);
  return result;
}

absl::Status Authenticator::StillAdmits(const CallerCredentials& creds, const std::string& tenant,
                                        uint64_t* generation) {
  if (!enabled()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  MaybeReload(options_.clock());
  if (*generation == generation_) return absl::OkStatus();
  absl::Status why;
  const int index = FindLocked(creds, &why);
  if (index < 0) {
    return absl::UnauthenticatedError(
        absl::StrCat("the tenants file changed and no longer admits this call: ", why.message()));
  }
  if (table_->tenants()[index].name != tenant) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the tenants file changed: these credentials are no longer tenant ", tenant, "'s"));
  }
  *generation = generation_;
  return absl::OkStatus();
}

std::optional<TenantQuota> Authenticator::CurrentQuota(const std::string& tenant) {
  if (!enabled()) return std::nullopt;
  absl::MutexLock lock(&mu_);
  MaybeReload(options_.clock());
  const int index = table_->FindTenant(tenant);
  if (index < 0) return std::nullopt;
  return table_->tenants()[index].quota;
}

StillAdmitted Authenticator::Watch(CallerCredentials creds, std::string tenant,
                                   uint64_t generation) {
  return [this, creds = std::move(creds), tenant = std::move(tenant), generation]() mutable {
    return StillAdmits(creds, tenant, &generation);
  };
}

uint64_t Authenticator::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

void Authenticator::CountForbidden(const TenantScope& scope) { Count(scope.tenant(), "forbidden"); }

}  // namespace kvtier
