#include "server/get_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/region_target.h"

namespace kvtier {

uint64_t FrameBytesFor(uint32_t requested, uint64_t max_frame_bytes) {
  // At least kMinFrameBytes: a frame of a few bytes costs a message, a write and (from
  // SSD) a read job each, so a client asking for 1-byte frames made a chunk millions of
  // them, starving the read pool other calls share.
  const uint64_t wanted =
      requested > 0 ? std::max<uint64_t>(requested, kMinFrameBytes) : kStockFrameBytes;
  return std::min<uint64_t>(max_frame_bytes, wanted);
}

namespace {

// Whether `order` streams layer-major. Returns: InvalidArgument (not a GetOrder this
// daemon knows).
absl::StatusOr<bool> LayerMajor(int order) {
  switch (order) {
    case v1::GET_ORDER_UNSPECIFIED:
    case v1::GET_ORDER_CHUNK_MAJOR:
      return false;
    case v1::GET_ORDER_LAYER_MAJOR:
      return true;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "order: ", order, " is not a GetOrder this daemon knows (chunk-major 1, layer-major 2)"));
  }
}

}  // namespace

absl::Status CheckGetRequest(const v1::GetRequest& req, uint32_t max_keys) {
  if (req.keys_size() > static_cast<int>(max_keys)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: ", req.keys_size(), " keys in one request, more than max_keys_per_request (",
        max_keys, "); split the request"));
  }
  for (int i = 0; i < req.keys_size(); ++i) {
    if (auto key = ChunkKey::FromBytes(req.keys(i)); !key.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("keys[", i, "]: ", key.status().message()));
    }
  }
  return LayerMajor(req.order()).status();
}

absl::StatusOr<GetPlan> MakeGetPlan(const v1::GetRequest& req, const LayoutSpec& layout,
                                    uint64_t max_frame_bytes, uint32_t max_keys) {
  GetPlan plan;
  if (absl::Status s = CheckGetRequest(req, max_keys); !s.ok()) return s;
  plan.ids.reserve(req.keys_size());
  for (int i = 0; i < req.keys_size(); ++i) {
    plan.ids.push_back(ChunkId{req.namespace_id(), *ChunkKey::FromBytes(req.keys(i))});
  }
  plan.num_layers = layout.num_layers;
  plan.layer_bytes = layout.ChunkBytes() / layout.num_layers;
  plan.first_layer = 0;
  plan.end_layer = plan.num_layers;
  if (req.has_layer_range()) {
    plan.first_layer = req.layer_range().begin();
    plan.end_layer = req.layer_range().end();
    if (plan.first_layer >= plan.end_layer || plan.end_layer > plan.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer_range: [", plan.first_layer, ", ", plan.end_layer,
          ") is not a non-empty range within [0, ", plan.num_layers, ")"));
    }
  }
  plan.frame_bytes = FrameBytesFor(req.max_frame_bytes(), max_frame_bytes);
  plan.layer_major = *LayerMajor(req.order());  // Checked by CheckGetRequest.
  const uint32_t n = static_cast<uint32_t>(plan.ids.size());
  if (plan.layer_major) {
    const uint64_t items = uint64_t{n} * (plan.end_layer - plan.first_layer);
    if (items > GetPlan::kMaxItems) {
      // Each (key, layer) is a piece of the stream: a layout of 2^20 layers made 4096
      // keys 4e9 pieces, allocated before anything was read.
      return absl::InvalidArgumentError(absl::StrCat(
          "order: layer-major over ", n, " keys and ", plan.end_layer - plan.first_layer,
          " layers is ", items, " pieces, more than the ", GetPlan::kMaxItems,
          " one Get may stream; ask for fewer keys or a layer_range, or chunk-major"));
    }
    plan.items.reserve(items);
    for (uint32_t l = plan.first_layer; l < plan.end_layer; ++l) {
      for (uint32_t k = 0; k < n; ++k) plan.items.push_back(GetPlan::Item{k, l, l + 1});
    }
  } else {
    plan.items.reserve(n);
    for (uint32_t k = 0; k < n; ++k) {
      plan.items.push_back(GetPlan::Item{k, plan.first_layer, plan.end_layer});
    }
  }
  return plan;
}

absl::StatusOr<GetPlan> StartGet(TieredStore* store, const v1::GetRequest* req,
                                 uint64_t max_frame_bytes, uint32_t max_keys) {
  if (req == nullptr) return absl::InvalidArgumentError("request: not a GetRequest");
  // Before the store: a malformed request is InvalidArgument while starting up too.
  if (absl::Status s = CheckGetRequest(*req, max_keys); !s.ok()) return s;
  if (store == nullptr) {
    return absl::UnavailableError(
        "kvtierd is starting up (recovering the SSD tier's index); retry shortly");
  }
  auto layout = store->FindLayout(req->namespace_id());
  if (!layout.ok()) return layout.status();
  return MakeGetPlan(*req, *layout, max_frame_bytes, max_keys);
}

void TakeLease(LeaseTable* leases, const v1::GetRequest& req, std::vector<ChunkView>* hold) {
  if (req.lease_id() == 0 || leases == nullptr) return;
  auto held = leases->Take(req.namespace_id(), req.lease_id());
  if (held.ok()) *hold = *std::move(held);
}

absl::Status CheckGet(TieredStore* store, RegionTable* regions, const v1::GetRequest* req,
                      uint64_t max_frame_bytes, uint32_t max_keys) {
  if (req == nullptr) return absl::InvalidArgumentError("request: not a GetRequest");
  if (absl::Status s = CheckGetRequest(*req, max_keys); !s.ok()) return s;
  // A target in host memory: ResolveRegionTarget's checks, but for Populate. One in a
  // worker's GPU memory: DeviceGetReactor::Start's, but for taking the region's events.
  std::shared_ptr<const MappedRegion> region;
  std::shared_ptr<const DeviceRegion> device;
  if (req->has_target()) {
    if (regions != nullptr && regions->IsDevice(req->target().region_id())) {
      auto found = FindDeviceTargetRegion(regions, req->target());
      if (!found.ok()) return found.status();
      device = *std::move(found);
    } else {
      auto found = FindTargetRegion(regions, req->target());
      if (!found.ok()) return found.status();
      region = *std::move(found);
    }
  }
  if (store == nullptr) return absl::OkStatus();  // Its namespace and layout: not known yet.
  auto layout = store->FindLayout(req->namespace_id());
  if (!layout.ok()) return layout.status();
  auto plan = MakeGetPlan(*req, *layout, max_frame_bytes, max_keys);
  if (!plan.ok()) return plan.status();
  if (region != nullptr) {
    return TargetOffsets(req->target(), plan->ids.size(), plan->KeyBytes(), region->size())
        .status();
  }
  if (device != nullptr) {
    if (!store->has_gpu()) return absl::FailedPreconditionError("target: this daemon has no GPU");
    if (auto offsets =
            TargetOffsets(req->target(), plan->ids.size(), plan->KeyBytes(), device->size());
        !offsets.ok()) {
      return offsets.status();
    }
    if (req->target().record_events()) {
      return CheckEventCount(req->target(), plan->items.size(), *device);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier
