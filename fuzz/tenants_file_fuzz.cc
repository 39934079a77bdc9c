// The tenants file parser: any bytes either parse or are refused with InvalidArgument
// naming a line; what parses is self-consistent (every tenant found by name, every
// credential naming a declared tenant).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/tenant_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto table = kvtier::TenantTable::Parse(text);
  if (!table.ok()) {
    if (table.status().code() != absl::StatusCode::kInvalidArgument) abort();
    if (table.status().message().find("line ") == std::string::npos) abort();
    return 0;
  }
  const auto& tenants = table->tenants();
  for (size_t i = 0; i < tenants.size(); ++i) {
    if (table->FindTenant(tenants[i].name) != static_cast<int>(i)) abort();
    if (tenants[i].requests_per_second > 0 && tenants[i].burst < 1) abort();
  }
  // Any word of the input as a token, identity or uid maps to a real tenant or none.
  for (size_t start = 0; start < text.size(); start += 7) {
    const std::string word = text.substr(start, 16);
    for (int found : {table->FindToken(word), table->FindCertIdentity(word),
                      table->FindUid(static_cast<uint32_t>(std::hash<std::string>()(word)))}) {
      if (found < -1 || found >= static_cast<int>(tenants.size())) abort();
    }
  }
  return 0;
}
