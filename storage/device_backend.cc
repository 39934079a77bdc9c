#include "storage/device_backend.h"

namespace kvtier {

std::vector<DeviceCopy> CoalesceCopies(std::vector<DeviceCopy> copies) {
  std::vector<DeviceCopy> out;
  out.reserve(copies.size());
  for (const DeviceCopy& c : copies) {
    if (c.kind == CopyKind::kRecordEvent) {
      out.push_back(c);
      continue;
    }
    if (c.bytes == 0) continue;
    if (!out.empty()) {
      DeviceCopy& last = out.back();
      if (last.kind == c.kind && last.dst + last.bytes == c.dst &&
          last.src + last.bytes == c.src) {
        last.bytes += c.bytes;
        continue;
      }
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace kvtier
