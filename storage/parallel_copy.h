// ParallelCopy: one large copy (a chunk between the pool and a client's registered
// memory) spread over several threads, with its CRC32C computed in the same pass.
//
// A same-host transfer is a copy, and one thread copying runs at about half of what the
// memory system gives two (profiled: a 128 MiB shared-memory get with one client spent
// its time in memmove and the checksum on one core while the other idled). The copy is
// cut into parts; the caller and the helper threads claim parts from a shared counter,
// each part is checksummed from zero, and the part CRCs are folded in order with
// crc32c::Combine. The caller always works too and waits only for parts a helper has
// claimed, so when every helper is busy with other transfers a copy runs on its own
// thread as it did before, never slower for want of a helper.
//
// Thread-safety: CopyAndExtend may be called from any number of threads at once.
#ifndef KVTIER_STORAGE_PARALLEL_COPY_H_
#define KVTIER_STORAGE_PARALLEL_COPY_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "storage/crc32c.h"

namespace kvtier {

struct ParallelCopyOptions {
  // Helper threads besides the caller; 0 copies on the caller's thread only.
  int helpers = 1;
  // Copies shorter than twice this run on the caller's thread alone; longer ones are cut
  // into parts of at least this many bytes (a part handed to a helper costs a wake-up).
  uint64_t min_part_bytes = 1 << 20;
  // Tests: the caller claims no part itself and waits for the helpers, so that they
  // provably run parts (needs helpers > 0).
  bool caller_works = true;

  absl::Status Validate() const;
};

class ParallelCopy {
 public:
  // One contiguous piece of a copy: `n` bytes from `src` to `dst`.
  struct Span {
    char* dst;
    const char* src;
    size_t n;
  };

  explicit ParallelCopy(ParallelCopyOptions options);
  ~ParallelCopy();  // Joins the helpers; no copy may be running.
  ParallelCopy(const ParallelCopy&) = delete;
  ParallelCopy& operator=(const ParallelCopy&) = delete;

  // Copies every span, in order as one byte stream, and returns `crc` extended over
  // them (the side `over` names, as crc32c::CopyAndExtend). Returns when every byte is
  // copied. The spans must not overlap one another.
  uint32_t CopyAndExtend(uint32_t crc, absl::Span<const Span> spans, crc32c::CrcOver over);

  // Parts run by helper threads so far (tests, benchmarks).
  uint64_t parts_helped() const {
    absl::MutexLock lock(&mu_);
    return parts_helped_;
  }

 private:
  struct Job;
  static void RunPart(Job& job, size_t part);
  void HelperLoop();

  const ParallelCopyOptions options_;
  mutable absl::Mutex mu_;
  // Jobs that may have parts left to claim, oldest first.
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t parts_helped_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> helpers_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PARALLEL_COPY_H_
