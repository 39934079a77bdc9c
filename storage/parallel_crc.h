// ParallelCrc: the CRC32C of a chunk's pieces, split into parts that run at once on a
// few threads and the caller's, then combined (crc32c::Combine). A host-to-device
// delivery checks a chunk's CRC32C on the CPU while the DMA runs; one core checks
// 15-40 GB/s, short of a PCIe 5 link's ~55 GB/s for a chunk of tens of MiB, so the
// check, not the link, would bound the delivery.
//
// Thread-safety: thread-safe. `done` runs on whichever thread finishes the last part:
// the caller's or one of this object's. The destructor runs the parts already started
// and joins its threads; the pieces' memory must stay alive until `done` runs.
#ifndef KVTIER_STORAGE_PARALLEL_CRC_H_
#define KVTIER_STORAGE_PARALLEL_CRC_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "storage/io_pool.h"

namespace kvtier {

class ParallelCrc {
 public:
  // `threads` helpers beside the caller (0: every check on the caller's thread). A part
  // is at least `min_part_bytes`, so small chunks are checked in one piece, inline.
  ParallelCrc(int threads, uint64_t min_part_bytes = 4ull << 20);
  ~ParallelCrc();
  ParallelCrc(const ParallelCrc&) = delete;
  ParallelCrc& operator=(const ParallelCrc&) = delete;

  // The CRC32C of the concatenated `pieces`, passed to `done`.
  void Compute(std::vector<absl::string_view> pieces, std::function<void(uint32_t)> done);

  // How many parts a check of `bytes` is split into.
  int PartsFor(uint64_t bytes) const;

 private:
  const int threads_;
  const uint64_t min_part_bytes_;
  std::unique_ptr<IoPool> pool_;  // Null with no helper threads.
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PARALLEL_CRC_H_
