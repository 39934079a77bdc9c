// MakeGetPlan: what one Get may ask for. A layer-major Get plans one piece per key and
// layer up front, so the pieces are bounded: a layout of very many layers once made a
// Get of 4096 absent keys allocate tens of gigabytes on the handler thread.
#include "server/get_plan.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/support/test_data.h"

namespace kvtier {
namespace {

v1::GetRequest Request(uint32_t keys, v1::GetOrder order) {
  v1::GetRequest req;
  req.set_namespace_id(1);
  for (uint32_t i = 0; i < keys; ++i) req.add_keys(testing::KeyOf(i).ToByteString());
  req.set_order(order);
  return req;
}

TEST(GetPlanTest, ALayerMajorGetOfTooManyPiecesIsRefusedBeforeItIsPlanned) {
  LayoutSpec layout = testing::LayoutOfMiB(1);
  layout.num_layers = 1u << 20;  // 4 MiB chunks of tiny layers: a legal layout.
  layout.num_kv_heads = 1;
  layout.head_dim = 1;
  layout.tokens_per_chunk = 1;
  auto refused = MakeGetPlan(Request(4096, v1::GET_ORDER_LAYER_MAJOR), layout,
                             /*max_frame_bytes=*/4 << 20, /*max_keys=*/4096);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("layer-major"), std::string::npos)
      << refused.status();
  // Chunk-major, the same keys are one piece each.
  auto chunk_major = MakeGetPlan(Request(4096, v1::GET_ORDER_CHUNK_MAJOR), layout, 4 << 20, 4096);
  ASSERT_TRUE(chunk_major.ok()) << chunk_major.status();
  EXPECT_EQ(chunk_major->items.size(), 4096u);
  // At the bound exactly: planned.
  v1::GetRequest ranged = Request(4096, v1::GET_ORDER_LAYER_MAJOR);
  ranged.mutable_layer_range()->set_begin(0);
  ranged.mutable_layer_range()->set_end(GetPlan::kMaxItems / 4096);
  auto at_bound = MakeGetPlan(ranged, layout, 4 << 20, 4096);
  ASSERT_TRUE(at_bound.ok()) << at_bound.status();
  EXPECT_EQ(at_bound->items.size(), GetPlan::kMaxItems);
}

}  // namespace
}  // namespace kvtier
