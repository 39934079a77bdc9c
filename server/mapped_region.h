// MappedRegion: a client's registered memory (a sealed memfd) mapped into the daemon.
//
// The daemon reads and writes client memory only through this class, and only after
// Map() checked that the mapping cannot fault under it: the file is shmem (a memfd on
// tmpfs, not hugetlbfs, whose pool can run dry and SIGBUS a write into a hole), it is
// sealed against shrinking (F_SEAL_SHRINK: a client's ftruncate fails instead of
// leaving the daemon's mapping past the end of the file), and it is writable (no
// F_SEAL_WRITE). Hole-punching is still possible; a read of a hole gives zeros and a
// write allocates a page, charged to the region, whose size is bounded by the daemon's
// limits. The owner unmapping its own view changes nothing here.
//
// Thread-safety: immutable after Map(); the mapping lives until the last shared_ptr
// (a transfer in flight holds one) is gone, however the region was unregistered.
#ifndef KVTIER_SERVER_MAPPED_REGION_H_
#define KVTIER_SERVER_MAPPED_REGION_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

class MappedRegion {
 public:
  // Checks and maps `fd` (not taken: the caller closes it). `expected_bytes` is the
  // size the client says it registered. Returns: Ok, InvalidArgument (not a memfd,
  // hugetlbfs, not sealed against shrinking, write-sealed, empty, size not as the
  // client said, larger than `max_bytes`), Internal (mmap failed).
  static absl::StatusOr<std::shared_ptr<MappedRegion>> Map(int fd, uint64_t expected_bytes,
                                                           uint64_t max_bytes);
  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  uint64_t size() const { return size_; }
  // The address of bytes [offset, offset + length). Returns InvalidArgument, naming
  // `what`, when the range is empty, overflows or runs past the region.
  absl::StatusOr<char*> Range(uint64_t offset, uint64_t length, absl::string_view what) const;

  // Maps the pages of [p, p + n) (from Range) into the daemon's page tables in one call
  // before a transfer touches them (MADV_POPULATE_READ/WRITE), instead of one fault per
  // 4 KiB page during the copy: under virtualisation a minor fault costs microseconds,
  // and a 32 MiB get into a fresh mapping took 8192 of them. Pages the client holds are
  // only mapped, not allocated; a hole a write would fill is allocated either way. On
  // kernels without the advice (before 5.14) this does nothing and the copy faults.
  // Returns: Ok, ResourceExhausted (no memory for a hole), FailedPrecondition (the
  // pages cannot be faulted in: the copy would have crashed the daemon).
  enum class Access { kRead, kWrite };
  absl::Status Populate(const char* p, uint64_t n, Access access) const;

 private:
  MappedRegion(char* base, uint64_t size) : base_(base), size_(size) {}
  char* const base_;
  const uint64_t size_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_MAPPED_REGION_H_
