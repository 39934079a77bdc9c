#include "server/tenant_scope.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/tenant_table.h"

namespace kvtier {

uint64_t TenantScope::Internal(uint64_t public_ns) const {
  if (implicit_ || public_ns == 0) return public_ns;
  // Length-prefixed, so that no (tenant, id) pair encodes like another.
  std::string encoding = "kvtier-tenant-namespace-v1";
  const uint32_t len = static_cast<uint32_t>(tenant_.size());
  char le[8];
  for (int i = 0; i < 4; ++i) le[i] = static_cast<char>(len >> (8 * i));
  encoding.append(le, 4);
  encoding += tenant_;
  for (int i = 0; i < 8; ++i) le[i] = static_cast<char>(public_ns >> (8 * i));
  encoding.append(le, 8);
  const Sha256Digest d = Sha256(encoding);
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id |= static_cast<uint64_t>(d[i]) << (8 * i);
  return id == 0 ? 1 : id;  // 0 means "no namespace" on the wire.
}

std::string TenantScope::ScopedName(const std::string& name) const {
  if (implicit_) return name;
  // '/' cannot occur in a tenant name, so "a/b/c" is tenant "a"'s "b/c", never "a/b"'s.
  return absl::StrCat(tenant_, "/", name);
}

}  // namespace kvtier
