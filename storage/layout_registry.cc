#include "storage/layout_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "storage/log.h"

namespace kvtier {

absl::Status LayoutRegistry::Load() {
  if (ssd_ == nullptr) return absl::OkStatus();
  auto rows = ssd_->LoadLayouts();
  if (!rows.ok()) return rows.status();
  absl::MutexLock lock(&mu_);
  for (auto& [ns, encoding] : *rows) {
    auto layout = LayoutSpec::FromCanonicalEncoding(encoding);
    // A tenant's namespace is registered under an id derived from its layout's (not
    // equal to it); only an unreadable encoding or id 0 is skipped.
    if (!layout.ok() || ns == 0) {
      LogWarning("tiered store: skipping an unreadable stored layout for namespace ",
                 absl::StrFormat("%016x", ns));
      continue;
    }
    if (layout->ChunkBytes() > max_chunk_bytes_) {
      LogWarning("tiered store: namespace ", absl::StrFormat("%016x", ns), "'s chunk is ",
                 layout->ChunkBytes(), " bytes, more than this daemon now accepts (",
                 max_chunk_bytes_, "); its puts are refused");
    }
    layouts_[ns] = *std::move(layout);
  }
  LogInfo("tiered store: ", layouts_.size(), " layouts recovered");
  return absl::OkStatus();
}

absl::Status LayoutRegistry::CheckPuttable(const LayoutSpec& layout) const {
  if (layout.ChunkBytes() <= max_chunk_bytes_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this namespace's chunk is ", layout.ChunkBytes(), " bytes, more than this daemon now "
      "accepts (", max_chunk_bytes_, " = the least of max_chunk_size, ram_capacity and "
      "ssd_capacity; the layout was registered with larger ones): its chunks cannot be "
      "stored"));
}

absl::StatusOr<LayoutRegistry::Registered> LayoutRegistry::Register(const LayoutSpec& layout,
                                                                    uint64_t ns) {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  const uint64_t bytes = layout.ChunkBytes();
  if (bytes > max_chunk_bytes_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout's chunk is ", bytes, " bytes, more than this daemon accepts (",
        max_chunk_bytes_, " = the least of max_chunk_size, ram_capacity and ssd_capacity); use "
        "fewer tokens_per_chunk"));
  }
  Registered out{ns != 0 ? ns : layout.NamespaceId(), bytes, false};
  {
    absl::MutexLock lock(&mu_);
    if (layouts_.contains(out.namespace_id)) {
      out.already_registered = true;
      return out;
    }
    if (max_layouts_ != 0 && layouts_.size() + registering_ >= max_layouts_) {
      // Layouts are never unregistered: waiting does not help, the operator must.
      return absl::FailedPreconditionError(absl::StrCat(
          "layout: ", layouts_.size(), " layouts are registered, all that max_layouts (",
          max_layouts_, ") allows; raise max_layouts, or clear the data directory"));
    }
    ++registering_;
  }
  absl::Status saved = absl::OkStatus();
  if (ssd_ != nullptr) saved = ssd_->SaveLayout(out.namespace_id, layout.CanonicalEncoding());
  absl::MutexLock lock(&mu_);
  --registering_;
  if (!saved.ok()) return saved;
  out.already_registered = !layouts_.try_emplace(out.namespace_id, layout).second;
  return out;
}

absl::StatusOr<LayoutSpec> LayoutRegistry::Find(uint64_t ns) const {
  absl::MutexLock lock(&mu_);
  auto it = layouts_.find(ns);
  if (it == layouts_.end()) {
    // Not the id itself: a named tenant's is its own hash of the one it sent.
    return absl::NotFoundError(
        "the request's namespace_id is not registered (by this tenant); call RegisterLayout "
        "first");
  }
  return it->second;
}

size_t LayoutRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return layouts_.size();
}

std::vector<std::pair<uint64_t, LayoutSpec>> LayoutRegistry::All() const {
  absl::MutexLock lock(&mu_);
  return {layouts_.begin(), layouts_.end()};
}

}  // namespace kvtier
