#include "server/mapped_region.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<std::shared_ptr<MappedRegion>> MappedRegion::Map(int fd, uint64_t expected_bytes,
                                                                uint64_t max_bytes) {
  struct statfs fs;
  if (fstatfs(fd, &fs) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("region: fstatfs: ", std::strerror(errno)));
  }
  if (fs.f_type == HUGETLBFS_MAGIC) {
    return absl::InvalidArgumentError(
        "region: a hugetlbfs memfd can fault when its huge-page pool runs dry; register "
        "a plain memfd (memfd_create without MFD_HUGETLB)");
  }
  if (fs.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(
        "region: the descriptor is not a memfd (only memfd_create memory can be registered)");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region: not a sealable memfd (F_GET_SEALS: ", std::strerror(errno),
        "); create it with MFD_ALLOW_SEALING"));
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "region: the memfd is not sealed against shrinking; add F_SEAL_SHRINK "
        "(fcntl F_ADD_SEALS) before registering it");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::InvalidArgumentError(
        "region: the memfd is sealed against writes; gets need to write into it");
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("region: the descriptor is not a regular memfd");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return absl::InvalidArgumentError("region: the memfd is empty");
  if (size != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region: add.bytes says ", expected_bytes, " but the memfd holds ", size, " bytes"));
  }
  if (size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region: ", size, " bytes, more than shm_max_region_bytes (", max_bytes,
        "); register smaller regions"));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {  // The sender's descriptor is read-only.
      return absl::InvalidArgumentError(absl::StrCat(
          "region: cannot map the memfd for reading and writing (", std::strerror(err),
          "); send a descriptor opened O_RDWR"));
    }
    if (err == ENOMEM) {  // The daemon's address space or map count.
      return absl::ResourceExhaustedError(
          absl::StrCat("region: mmap: ", std::strerror(err), "; retry after removing regions"));
    }
    return absl::InternalError(absl::StrCat("region: mmap: ", std::strerror(err)));
  }
  return std::shared_ptr<MappedRegion>(new MappedRegion(static_cast<char*>(base), size));
}

MappedRegion::~MappedRegion() { munmap(base_, size_); }

absl::StatusOr<char*> MappedRegion::Range(uint64_t offset, uint64_t length,
                                          absl::string_view what) const {
  if (length == 0 || offset > size_ || length > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": bytes [", offset, ", +", length, ") do not fit the ", size_,
        "-byte region"));
  }
  return base_ + offset;
}

absl::Status MappedRegion::Populate(const char* p, uint64_t n, Access access) const {
#if defined(MADV_POPULATE_READ) && defined(MADV_POPULATE_WRITE)
  const uintptr_t page = 4096;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n + page - 1) & ~(page - 1);
  const int advice = access == Access::kWrite ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
  if (madvise(reinterpret_cast<void*>(start), end - start, advice) == 0) return absl::OkStatus();
  const int err = errno;
  if (err == EINVAL || err == ENOSYS) return absl::OkStatus();  // Kernel without the advice.
  if (err == ENOMEM) {
    return absl::ResourceExhaustedError(
        "region: no memory to fault in the region's pages (holes punched in it need new "
        "pages); retry later");
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "region: its pages cannot be faulted in (", std::strerror(err),
      "); register it again from fresh memory"));
#else
  (void)p, (void)n, (void)access;
  return absl::OkStatus();
#endif
}

}  // namespace kvtier
