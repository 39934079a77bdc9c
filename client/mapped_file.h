// MappedFile: a whole file mapped read-only, so the CLI can hand multi-GiB chunks to
// KvTierClient::Put as string_views without reading them into memory first.
//
// Thread-safety: immutable after Open; data() may be read from any thread.
#ifndef KVTIER_CLIENT_MAPPED_FILE_H_
#define KVTIER_CLIENT_MAPPED_FILE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

class MappedFile {
 public:
  // Maps `path`. An empty file gives an empty data() (nothing is mapped).
  // Returns: Ok, NotFound, PermissionDenied, FailedPrecondition (not a regular file),
  // or the errno-derived code of open/fstat/mmap; the message names the path.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  absl::string_view data() const {
    return absl::string_view(static_cast<const char*>(addr_), size_);
  }

 private:
  MappedFile(void* addr, size_t size) : addr_(addr), size_(size) {}

  void* const addr_;  // nullptr when size_ == 0.
  const size_t size_;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_MAPPED_FILE_H_
