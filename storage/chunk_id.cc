#include "storage/chunk_id.h"

#include "absl/strings/str_format.h"

namespace kvtier {

std::string ChunkId::DebugString() const {
  return absl::StrFormat("%016x/%s", ns, key.ToHex());
}

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kGpu: return "gpu";
    case Tier::kRam: return "ram";
    case Tier::kSsd: return "ssd";
    case Tier::kRemote: return "remote";
    case Tier::kNone: break;
  }
  return "none";
}

}  // namespace kvtier
