// CPU element-wise addition against the correctly rounded sum of each pair.
#include "kernels/elementwise.h"

#include <gtest/gtest.h>

#include <vector>

#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

class AddInplaceTest : public ::testing::TestWithParam<int64_t> {};

// Two floats of [-1, 3] add exactly in double, so the double sum rounded once to float is
// the one float an addition may give: every element is checked for equality.
TEST_P(AddInplaceTest, AddsEveryElementOnce) {
  const int64_t n = GetParam();
  const auto y0 = random_floats(n, 10 + n, -1.0f, 3.0f);
  const auto x = random_floats(n, 20 + n, -1.0f, 3.0f);
  auto y = y0;
  k::add_inplace(y.data(), x.data(), n);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(y[i], static_cast<float>(static_cast<double>(y0[i]) + x[i])) << "element " << i;
}

INSTANTIATE_TEST_SUITE_P(Sizes, AddInplaceTest, ::testing::Values(1, 3, 17, 33, 1001));

}  // namespace
}  // namespace conveyor::testing
