// The daemon's TOML configuration: any document is applied or refused with
// InvalidArgument naming a key, never a crash; an accepted one validates or is refused
// naming an option, and a valid one converts to store options.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/daemon_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvtier::DaemonConfig config;
  absl::Status applied = kvtier::ApplyToml(text, "fuzz.toml", config);
  if (!applied.ok()) {
    if (applied.code() != absl::StatusCode::kInvalidArgument) abort();
    return 0;
  }
  absl::Status valid = config.Validate();
  if (!valid.ok()) {
    if (valid.code() != absl::StatusCode::kInvalidArgument) abort();
    if (valid.message().find("option ") == std::string::npos) abort();
    return 0;
  }
  (void)config.Describe();
  (void)config.ToStoreOptions();
  return 0;
}
