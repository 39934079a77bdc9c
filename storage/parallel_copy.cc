#include "storage/parallel_copy.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status ParallelCopyOptions::Validate() const {
  if (helpers < 0 || helpers > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy helpers: ", helpers, " is not in [0, 64]"));
  }
  if (min_part_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy min_part_bytes: ", min_part_bytes, " is below 4096"));
  }
  if (!caller_works && helpers == 0) {
    return absl::InvalidArgumentError("copy: caller_works = false needs a helper");
  }
  return absl::OkStatus();
}

// One CopyAndExtend call, shared by the caller and the helpers that claim its parts.
struct ParallelCopy::Job {
  std::vector<Span> spans;
  std::vector<uint64_t> starts;  // Byte offset of each span in the stream.
  uint64_t total = 0;
  uint64_t part_bytes = 0;
  size_t parts = 0;
  crc32c::CrcOver over = crc32c::CrcOver::kSource;
  std::vector<uint32_t> crcs;  // Part i's CRC32C from zero, written by whoever ran it.
  std::atomic<size_t> next{0};  // The next part to claim.
  absl::Mutex mu;
  size_t done ABSL_GUARDED_BY(mu) = 0;

  void Finished() {
    absl::MutexLock lock(&mu);
    ++done;
  }
};

ParallelCopy::ParallelCopy(ParallelCopyOptions options) : options_(options) {
  helpers_.reserve(static_cast<size_t>(options_.helpers));
  for (int i = 0; i < options_.helpers; ++i) helpers_.emplace_back([this] { HelperLoop(); });
}

ParallelCopy::~ParallelCopy() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : helpers_) t.join();
}

void ParallelCopy::RunPart(Job& job, size_t part) {
  const uint64_t begin = part * job.part_bytes;
  const uint64_t end = std::min(job.total, begin + job.part_bytes);
  // The span holding `begin`: the last one starting at or before it.
  size_t i = static_cast<size_t>(
      std::upper_bound(job.starts.begin(), job.starts.end(), begin) - job.starts.begin() - 1);
  uint64_t at = begin;
  uint32_t crc = 0;
  while (at < end) {
    const Span& s = job.spans[i];
    const uint64_t in_span = at - job.starts[i];
    const uint64_t n = std::min<uint64_t>(s.n - in_span, end - at);
    crc = crc32c::CopyAndExtend(crc, s.dst + in_span, s.src + in_span, n, job.over);
    at += n;
    ++i;
  }
  job.crcs[part] = crc;
}

uint32_t ParallelCopy::CopyAndExtend(uint32_t crc, absl::Span<const Span> spans,
                                     crc32c::CrcOver over) {
  uint64_t total = 0;
  for (const Span& s : spans) total += s.n;
  if (helpers_.empty() || total < 2 * options_.min_part_bytes) {
    for (const Span& s : spans) crc = crc32c::CopyAndExtend(crc, s.dst, s.src, s.n, over);
    return crc;
  }
  auto job = std::make_shared<Job>();
  for (const Span& s : spans) {
    if (s.n == 0) continue;
    job->starts.push_back(job->total);
    job->spans.push_back(s);
    job->total += s.n;
  }
  // Two parts per thread: a helper that wakes late still finds work, and a thread that
  // is slower (sharing its core) holds the copy up by half a share at most. Parts are
  // whole pages where the size allows.
  const uint64_t threads = helpers_.size() + 1;
  const uint64_t parts =
      std::max<uint64_t>(2, std::min(2 * threads, total / options_.min_part_bytes));
  job->part_bytes = ((total + parts - 1) / parts + 4095) / 4096 * 4096;
  job->parts = static_cast<size_t>((total + job->part_bytes - 1) / job->part_bytes);
  job->over = over;
  job->crcs.assign(job->parts, 0);
  {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(job);
  }
  for (size_t p; options_.caller_works && (p = job->next.fetch_add(1)) < job->parts;) {
    RunPart(*job, p);
    job->Finished();
  }
  if (options_.caller_works) {
    // Every part is claimed: take the job out of the helpers' way if none has yet.
    absl::MutexLock lock(&mu_);
    auto it = std::find(jobs_.begin(), jobs_.end(), job);
    if (it != jobs_.end()) jobs_.erase(it);
  }
  {
    absl::MutexLock lock(&job->mu);
    job->mu.Await(absl::Condition(
        +[](Job* j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu) { return j->done == j->parts; },
        job.get()));
  }
  for (size_t p = 0; p < job->parts; ++p) {
    const uint64_t len = std::min(job->part_bytes, job->total - p * job->part_bytes);
    crc = crc32c::Combine(crc, job->crcs[p], len);
  }
  return crc;
}

void ParallelCopy::HelperLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    size_t part = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ParallelCopy* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
            return c->stopping_ || !c->jobs_.empty();
          },
          this));
      if (jobs_.empty()) return;  // Stopping, with nothing left to help with.
      job = jobs_.front();
      part = job->next.fetch_add(1);
      // Its last part is claimed: nobody needs to find this job again.
      if (part + 1 >= job->parts) jobs_.pop_front();
      if (part >= job->parts) continue;
      ++parts_helped_;
    }
    RunPart(*job, part);
    job->Finished();
  }
}

}  // namespace kvtier
