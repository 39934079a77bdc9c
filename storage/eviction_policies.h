// The eviction policies a tier can be built with, chosen by name (kvtierd's
// eviction_policy option), and the factory that builds one per tier.
//
//   lru          least recently used first.
//   prefix-lru   leaves of key chains first, then least recently used (PrefixCostPolicy
//                with cost_weight 0).
//   prefix-cost  leaves first, recency traded against recompute cost by position
//                (PrefixCostPolicy).
//
// Thread-safety: pure functions; the policies themselves are not thread-safe.
#ifndef KVTIER_STORAGE_EVICTION_POLICIES_H_
#define KVTIER_STORAGE_EVICTION_POLICIES_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/eviction_policy.h"
#include "storage/prefix_cost_policy.h"

namespace kvtier {

class HintWindow;

enum class EvictionPolicyKind { kLru, kPrefixLru, kPrefixCost };

// Returns: Ok, InvalidArgument (unknown name; the message lists the known ones).
absl::StatusOr<EvictionPolicyKind> ParseEvictionPolicy(absl::string_view name);
const char* EvictionPolicyName(EvictionPolicyKind kind);

struct EvictionPolicyOptions {
  EvictionPolicyKind kind = EvictionPolicyKind::kLru;
  PrefixCostOptions prefix_cost;  // prefix-cost only (prefix-lru uses weight 0).
  // When set, the policy is wrapped in a HintedPolicy: hinted chunks go last. Not owned;
  // must outlive the policies built.
  HintWindow* hints = nullptr;

  absl::Status Validate() const;
};

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(const EvictionPolicyOptions& options);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_EVICTION_POLICIES_H_
