#include "storage/parallel_crc.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "storage/crc32c.h"

namespace kvtier {

ParallelCrc::ParallelCrc(int threads, uint64_t min_part_bytes)
    : threads_(std::max(threads, 0)),
      min_part_bytes_(std::max<uint64_t>(min_part_bytes, 1)),
      pool_(threads_ > 0 ? std::make_unique<IoPool>(threads_) : nullptr) {}

ParallelCrc::~ParallelCrc() = default;

int ParallelCrc::PartsFor(uint64_t bytes) const {
  return static_cast<int>(std::clamp<uint64_t>(bytes / min_part_bytes_, 1, threads_ + 1));
}

void ParallelCrc::Compute(std::vector<absl::string_view> pieces,
                          std::function<void(uint32_t)> done) {
  uint64_t total = 0;
  for (absl::string_view p : pieces) total += p.size();
  const int parts = PartsFor(total);
  if (parts == 1) {
    uint32_t crc = 0;
    for (absl::string_view p : pieces) crc = crc32c::Extend(crc, p.data(), p.size());
    done(crc);
    return;
  }
  // Part i covers bytes [i * total / parts, (i + 1) * total / parts), slicing pieces
  // where a boundary falls inside one.
  struct State {
    std::vector<std::vector<absl::string_view>> parts;
    std::vector<uint32_t> crcs;
    std::vector<uint64_t> lengths;
    std::atomic<int> left;
    std::function<void(uint32_t)> done;
  };
  auto state = std::make_shared<State>();
  state->parts.resize(parts);
  state->crcs.assign(parts, 0);
  state->lengths.assign(parts, 0);
  state->left.store(parts, std::memory_order_relaxed);
  state->done = std::move(done);
  uint64_t at = 0;
  int part = 0;
  for (absl::string_view p : pieces) {
    while (!p.empty()) {
      const uint64_t end = (part + 1) * total / parts;
      const uint64_t n = std::min<uint64_t>(p.size(), end - at);
      state->parts[part].push_back(p.substr(0, n));
      state->lengths[part] += n;
      p.remove_prefix(n);
      at += n;
      if (at == end && part + 1 < parts) ++part;
    }
  }
  auto run = [](const std::shared_ptr<State>& s, int i) {
    uint32_t crc = 0;
    for (absl::string_view p : s->parts[i]) crc = crc32c::Extend(crc, p.data(), p.size());
    s->crcs[i] = crc;
    if (s->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    uint32_t all = s->crcs[0];
    for (size_t j = 1; j < s->crcs.size(); ++j) {
      all = crc32c::Combine(all, s->crcs[j], s->lengths[j]);
    }
    s->done(all);
  };
  for (int i = 1; i < parts; ++i) pool_->Submit([state, i, run] { run(state, i); });
  run(state, 0);
}

}  // namespace kvtier
