#include "server/tenant_table.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/daemon_config.h"

namespace kvtier {
namespace {

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool ParseDigest(absl::string_view text, Sha256Digest& out) {
  if (!absl::ConsumePrefix(&text, "sha256:") || text.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    const int hi = HexDigit(text[2 * i]);
    const int lo = HexDigit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return true;
}

}  // namespace

Sha256Digest Sha256(absl::string_view data) {
  Sha256Digest d;
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), d.data());
  return d;
}

size_t TenantTable::DigestHash::operator()(const Sha256Digest& d) const {
  size_t h;
  std::memcpy(&h, d.data(), sizeof(h));  // Already uniformly distributed.
  return h;
}

absl::StatusOr<TenantTable> TenantTable::Parse(absl::string_view text) {
  TenantTable table;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    auto bad = [line_no](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("tenants file line ", line_no, ": ", what));
    };
    const absl::string_view directive = words[0];
    if (words.size() < 2) return bad(absl::StrCat("'", directive, "' needs a tenant name"));
    const absl::string_view name = words[1];
    if (directive == "tenant") {
      if (!ValidName(name)) {
        return bad(absl::StrCat("tenant name '", name, "' must be 1 to 64 of [A-Za-z0-9._-]"));
      }
      if (table.by_name_.contains(name)) return bad(absl::StrCat("tenant '", name, "' declared twice"));
      TenantSpec spec;
      spec.name = std::string(name);
      bool burst_set = false;
      for (size_t i = 2; i < words.size(); ++i) {
        std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(words[i], '=');
        if (kv.first == "role") {
          if (kv.second == "admin") {
            spec.admin = true;
          } else if (kv.second != "user") {
            return bad(absl::StrCat("role '", kv.second, "': expected user or admin"));
          }
        } else if (kv.first == "requests_per_second" || kv.first == "burst") {
          double v;
          if (!absl::SimpleAtod(kv.second, &v) || !(v >= 0) || v > 1e9) {
            return bad(absl::StrCat(kv.first, "='", kv.second, "': expected a number 0 to 1e9"));
          }
          if (kv.first == "burst") {
            spec.burst = v;
            burst_set = true;
          } else {
            spec.requests_per_second = v;
          }
        } else if (kv.first == "ram_quota" || kv.first == "ssd_quota" ||
                   kv.first == "pinned_quota") {
          auto bytes = ParseByteSize(kv.second);
          if (!bytes.ok()) {
            return bad(absl::StrCat(kv.first, "='", kv.second, "': ", bytes.status().message()));
          }
          (kv.first == "ram_quota"   ? spec.quota.ram_bytes
           : kv.first == "ssd_quota" ? spec.quota.ssd_bytes
                                     : spec.quota.pinned_bytes) = *bytes;
        } else if (kv.first == "max_streams" || kv.first == "max_leases") {
          uint32_t n;
          if (!absl::SimpleAtoi(kv.second, &n) || n > 1000000) {
            return bad(absl::StrCat(kv.first, "='", kv.second,
                                    "': expected a whole number 0 to 1000000"));
          }
          (kv.first == "max_streams" ? spec.quota.streams : spec.quota.leases) = n;
        } else if (kv.first == "max_layouts") {
          uint32_t n;
          if (!absl::SimpleAtoi(kv.second, &n) || n < 1 || n > 1000000) {
            return bad(absl::StrCat("max_layouts='", kv.second,
                                    "': expected a whole number 1 to 1000000"));
          }
          spec.quota.layouts = n;
        } else if (kv.first == "max_subscribers") {
          uint32_t n;
          if (!absl::SimpleAtoi(kv.second, &n) || n < 1 || n > kEventSubscribers) {
            return bad(absl::StrCat("max_subscribers='", kv.second, "': expected a whole number 1 to ",
                                    kEventSubscribers));
          }
          spec.quota.subscribers = n;
        } else {
          return bad(absl::StrCat("unknown setting '", words[i],
                                  "' (role=, requests_per_second=, burst=, ram_quota=, "
                                  "ssd_quota=, pinned_quota=, max_streams=, max_leases=, "
                                  "max_subscribers=, max_layouts=)"));
        }
      }
      if (!burst_set) spec.burst = spec.requests_per_second;
      if (spec.requests_per_second > 0 && spec.burst < 1) {
        return bad("burst must be at least 1 when requests_per_second is set");
      }
      table.by_name_[spec.name] = static_cast<int>(table.tenants_.size());
      table.tenants_.push_back(std::move(spec));
      continue;
    }
    auto tenant = table.by_name_.find(name);
    if (directive != "token" && directive != "cert" && directive != "uid") {
      return bad(absl::StrCat("unknown directive '", directive, "' (tenant, token, cert, uid)"));
    }
    if (tenant == table.by_name_.end()) {
      return bad(absl::StrCat("tenant '", name, "' is not declared above this line"));
    }
    if (words.size() != 3) return bad(absl::StrCat("'", directive, "' takes a tenant and one value"));
    const absl::string_view value = words[2];
    if (directive == "token") {
      Sha256Digest digest;
      if (!ParseDigest(value, digest)) {
        return bad("token: expected sha256: and 64 hex digits (the token's SHA-256, not the token)");
      }
      if (!table.by_token_.emplace(digest, tenant->second).second) {
        return bad("token: the same token is listed twice");
      }
    } else if (directive == "cert") {
      if (value.size() > 256) return bad("cert: identity longer than 256 bytes");
      if (!table.by_cert_.emplace(std::string(value), tenant->second).second) {
        return bad(absl::StrCat("cert: identity '", value, "' is listed twice"));
      }
    } else {
      uint32_t uid;
      if (!absl::SimpleAtoi(value, &uid)) return bad(absl::StrCat("uid: '", value, "' is not a user id"));
      if (!table.by_uid_.emplace(uid, tenant->second).second) {
        return bad(absl::StrCat("uid: ", uid, " is listed twice"));
      }
    }
  }
  // Tenants with no max_subscribers of their own share the daemon's equally, so that no
  // one tenant's subscribers can shut out another's.
  for (TenantSpec& spec : table.tenants_) {
    spec.quota.tenants = static_cast<uint32_t>(table.tenants_.size());
    if (spec.quota.subscribers == 0) {
      spec.quota.subscribers = std::max<uint32_t>(
          1, kEventSubscribers / static_cast<uint32_t>(table.tenants_.size()));
    }
  }
  return table;
}

int TenantTable::FindToken(absl::string_view token) const {
  auto it = by_token_.find(Sha256(token));
  return it == by_token_.end() ? -1 : it->second;
}

int TenantTable::FindCertIdentity(absl::string_view identity) const {
  auto it = by_cert_.find(identity);
  return it == by_cert_.end() ? -1 : it->second;
}

int TenantTable::FindUid(uint32_t uid) const {
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? -1 : it->second;
}

int TenantTable::FindTenant(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

}  // namespace kvtier
