// Lines of a tenants file for tests (the format TenantTable parses).
#ifndef KVTIER_TESTS_SUPPORT_TENANTS_FILE_H_
#define KVTIER_TESTS_SUPPORT_TENANTS_FILE_H_

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"
#include "server/tenant_table.h"

namespace kvtier::testing {

// "token <tenant> sha256:<hex>\n": `token` admits its bearer as `tenant`.
inline std::string TokenLine(const std::string& tenant, const std::string& token) {
  const Sha256Digest d = Sha256(token);
  return "token " + tenant + " sha256:" +
         absl::BytesToHexString(
             absl::string_view(reinterpret_cast<const char*>(d.data()), d.size())) +
         "\n";
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_TENANTS_FILE_H_
