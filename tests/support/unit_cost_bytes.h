#pragma once
// Comparison of two units' byte counts (parameters, state, activations, workspace, ...), for
// tests that check a count is the same however it was obtained: described or measured, timed
// alone or in a group, with or without neighbours.
#include <gtest/gtest.h>

#include "engine/pipeline/planner.h"

namespace conveyor::testing {

// Every byte count of `got` equals `want`'s; the times are not compared.
inline void expect_same_bytes(const UnitCost& got, const UnitCost& want) {
  EXPECT_EQ(got.parameter_bytes, want.parameter_bytes);
  EXPECT_EQ(got.state_bytes, want.state_bytes);
  EXPECT_EQ(got.optimizer_bytes, want.optimizer_bytes);
  EXPECT_EQ(got.activation_bytes, want.activation_bytes);
  EXPECT_EQ(got.input_bytes, want.input_bytes);
  EXPECT_EQ(got.workspace_bytes, want.workspace_bytes);
  EXPECT_EQ(got.weight_pending_bytes, want.weight_pending_bytes);
  EXPECT_EQ(got.parameter_elements, want.parameter_elements);
}

}  // namespace conveyor::testing
