#include "storage/eviction_policies.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "storage/hinted_policy.h"
#include "storage/lru_policy.h"

namespace kvtier {

absl::StatusOr<EvictionPolicyKind> ParseEvictionPolicy(absl::string_view name) {
  for (EvictionPolicyKind k : {EvictionPolicyKind::kLru, EvictionPolicyKind::kPrefixLru,
                               EvictionPolicyKind::kPrefixCost}) {
    if (name == EvictionPolicyName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown eviction policy '", name, "' (known: lru, prefix-lru, prefix-cost)"));
}

const char* EvictionPolicyName(EvictionPolicyKind kind) {
  switch (kind) {
    case EvictionPolicyKind::kLru: return "lru";
    case EvictionPolicyKind::kPrefixLru: return "prefix-lru";
    case EvictionPolicyKind::kPrefixCost: return "prefix-cost";
  }
  return "unknown";
}

absl::Status EvictionPolicyOptions::Validate() const {
  const PrefixCostOptions& p = prefix_cost;
  if (!std::isfinite(p.cost_slope) || p.cost_slope < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("eviction_cost_slope must be a finite number >= 0, got ", p.cost_slope));
  }
  if (!std::isfinite(p.cost_weight) || p.cost_weight < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("eviction_cost_weight must be a finite number >= 0, got ", p.cost_weight));
  }
  return absl::OkStatus();
}

namespace {

std::unique_ptr<EvictionPolicy> MakeBase(const EvictionPolicyOptions& options) {
  switch (options.kind) {
    case EvictionPolicyKind::kPrefixLru: {
      PrefixCostOptions o = options.prefix_cost;
      o.cost_weight = 0;
      return std::make_unique<PrefixCostPolicy>(o);
    }
    case EvictionPolicyKind::kPrefixCost:
      return std::make_unique<PrefixCostPolicy>(options.prefix_cost);
    case EvictionPolicyKind::kLru:
      break;
  }
  return std::make_unique<LruPolicy>();
}

}  // namespace

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(const EvictionPolicyOptions& options) {
  std::unique_ptr<EvictionPolicy> base = MakeBase(options);
  if (options.hints == nullptr) return base;
  return std::make_unique<HintedPolicy>(std::move(base), options.hints);
}

}  // namespace kvtier
