#include "client/shared_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/call_cancellation.h"

namespace kvtier {

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::Create(
    std::shared_ptr<RegionChannel> channel, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shared buffer: 0 bytes");
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  // Mapped and populated at once: a buffer larger than this machine's memory can never
  // be had (and a size near 2^64 would wrap below when rounded up to a page).
  const uint64_t memory = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * page;
  if (bytes > memory) {
    return absl::InvalidArgumentError(absl::StrCat("shared buffer of ", bytes,
                                                   " bytes: more than this machine's ",
                                                   memory, " bytes of memory"));
  }
  const uint64_t size = (bytes + page - 1) / page * page;
  const int fd = memfd_create("kvtier-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  auto fail = [fd](absl::Status s) {
    close(fd);
    return s;
  };
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return fail(absl::ResourceExhaustedError(absl::StrCat("ftruncate: ", std::strerror(errno))));
  }
  // The daemon requires F_SEAL_SHRINK; F_SEAL_GROW and F_SEAL_SEAL make the size final.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail(absl::InternalError(absl::StrCat("F_ADD_SEALS: ", std::strerror(errno))));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    return fail(absl::ResourceExhaustedError(absl::StrCat("mmap: ", std::strerror(errno))));
  }
  auto reg = channel->Add(fd, size);
  if (!reg.ok()) {
    munmap(p, size);
    return fail(reg.status());
  }
  return std::shared_ptr<SharedBuffer>(
      new SharedBuffer(std::move(channel), fd, static_cast<char*>(p), size, *reg));
}

SharedBuffer::~SharedBuffer() {
  // Clean-up is not the cancelled call's to skip: whatever Scope the destroying thread
  // has open, the region is unregistered.
  CallCancellation::Scope not_cancellable(nullptr);
  channel_->Remove(reg_.region_id).IgnoreError();  // Gone with the connection anyway.
  munmap(data_, size_);
  close(fd_);
}

bool SharedBuffer::Contains(const void* p, uint64_t n) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const auto base = reinterpret_cast<uintptr_t>(data_);
  return a >= base && n <= size_ && a - base <= size_ - n;
}

}  // namespace kvtier
