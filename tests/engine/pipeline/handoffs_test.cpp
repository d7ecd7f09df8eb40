// The tensors a rank hands between its actions, kept only for the stages it holds: a rank of
// a deep pipeline holds two of its many stages, and its slots must not grow with the others.
#include "engine/pipeline/handoffs.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "engine/core/device_context.h"

namespace conveyor {
namespace {

TEST(Handoffs, KeepsTheHeldStagesApartAndRefusesTheOthers) {
  DeviceContext ctx(Device::cpu());
  // Stages 3 and 700 of 1024, as a rank of an interleaved pipeline holds them.
  Handoffs handoffs({3, 700}, 1024, 1024);
  const Tensor a = ctx.empty({5}), b = ctx.empty({7});
  handoffs.put(Handoffs::kOutAct, 3, 1023, a);
  handoffs.put(Handoffs::kOutAct, 700, 1023, b);
  EXPECT_TRUE(handoffs.has(Handoffs::kOutAct, 3, 1023));
  EXPECT_FALSE(handoffs.has(Handoffs::kInAct, 3, 1023));
  EXPECT_FALSE(handoffs.has(Handoffs::kOutAct, 700, 0));
  EXPECT_EQ(handoffs.bytes(),
            CachingAllocator::round_size(a.nbytes()) + CachingAllocator::round_size(b.nbytes()));
  // Each stage's tensor comes back from its own slot.
  EXPECT_EQ(
      handoffs.take(Handoffs::kOutAct, 700, 1023, schedule::forward(701, 1023)).tensor.numel(), 7);
  EXPECT_EQ(handoffs.take(Handoffs::kOutAct, 3, 1023, schedule::forward(4, 1023)).tensor.numel(),
            5);
  EXPECT_EQ(handoffs.bytes(), 0u);
  // A stage the rank does not hold has no slot: a logic error, not another stage's slot.
  EXPECT_THROW(handoffs.put(Handoffs::kInAct, 4, 0, a), std::logic_error);
  EXPECT_THROW((void)handoffs.has(Handoffs::kInAct, 1024, 0), std::logic_error);
  EXPECT_THROW(Handoffs({1024}, 1024, 1), std::logic_error);
}

}  // namespace
}  // namespace conveyor
