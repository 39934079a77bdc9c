// EnqueueGate orders "queued" before "landed" whichever the device reports first, and
// CoalesceCopies keeps every event record where it was in a copy list.
#include "storage/enqueue_gate.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "storage/device_backend.h"

namespace kvtier {
namespace {

TEST(EnqueueGateTest, ADoneThatCameFirstWaitsForEnqueued) {
  EnqueueGate gate;
  std::vector<std::string> order;
  gate.AfterEnqueued([&] { order.push_back("done"); });  // The copy completed first.
  EXPECT_TRUE(order.empty());
  gate.Enqueued([&] { order.push_back("enqueued"); });
  EXPECT_EQ(order, (std::vector<std::string>{"enqueued", "done"}));
}

TEST(EnqueueGateTest, ADoneAfterEnqueuedRunsAtOnce) {
  EnqueueGate gate;
  std::vector<std::string> order;
  gate.Enqueued([&] { order.push_back("enqueued"); });
  gate.AfterEnqueued([&] { order.push_back("done"); });
  EXPECT_EQ(order, (std::vector<std::string>{"enqueued", "done"}));
  EnqueueGate no_callback;  // Nobody asked to hear of the queueing: done still runs.
  no_callback.AfterEnqueued([&] { order.push_back("done 2"); });
  no_callback.Enqueued(nullptr);
  EXPECT_EQ(order.back(), "done 2");
}

TEST(CoalesceCopiesTest, EventRecordsStayInPlaceAndSplitMerges) {
  char host[64];
  const DevicePtr dev = 0x10000;
  std::vector<DeviceCopy> copies = {
      DeviceCopy::HostToDevice(dev, host, 16),
      DeviceCopy::HostToDevice(dev + 16, host + 16, 16),  // Continues the first: merged.
      DeviceCopy::RecordEvent(7),
      DeviceCopy::HostToDevice(dev + 32, host + 32, 16),  // Continues, but after a record.
      DeviceCopy::HostToDevice(dev + 48, host + 48, 0),   // Empty: dropped.
      DeviceCopy::RecordEvent(8),
      DeviceCopy::RecordEvent(8),
  };
  const std::vector<DeviceCopy> out = CoalesceCopies(copies);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(out[0].bytes, 32u);
  EXPECT_EQ(out[1].kind, CopyKind::kRecordEvent);
  EXPECT_EQ(out[1].dst, 7u);
  EXPECT_EQ(out[2].bytes, 16u);
  EXPECT_EQ(out[2].dst, dev + 32);
  EXPECT_EQ(out[3].kind, CopyKind::kRecordEvent);
  EXPECT_EQ(out[4].kind, CopyKind::kRecordEvent);
}

}  // namespace
}  // namespace kvtier
