// CPU deterministic reductions against long-double references; scale exactness.
#include "kernels/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

class ReduceTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ReduceTest, SumsMatchExtendedPrecisionReference) {
  const int64_t n = GetParam();
  const auto x = random_floats(n, 50 + n, -1.0f, 2.0f);
  long double s = 0.0L, ss = 0.0L, abs_sum = 0.0L;
  for (float v : x) {
    s += v;
    ss += static_cast<long double>(v) * v;
    abs_sum += std::abs(v);
  }
  // Double accumulation: the error is bounded by ~n ulp(double) of Σ|x|.
  const double bound = 1e-15 * static_cast<double>(n) * static_cast<double>(abs_sum) + 1e-300;
  EXPECT_NEAR(k::sum(x.data(), n), static_cast<double>(s), bound);
  EXPECT_NEAR(k::sum_squares(x.data(), n), static_cast<double>(ss),
              1e-15 * static_cast<double>(n) * static_cast<double>(ss) + 1e-300);
  // Same input, same bits.
  EXPECT_EQ(k::sum(x.data(), n), k::sum(x.data(), n));
  EXPECT_EQ(k::sum_squares(x.data(), n), k::sum_squares(x.data(), n));
}

TEST_P(ReduceTest, ScaleMultipliesEveryElement) {
  const int64_t n = GetParam();
  const auto x = random_floats(n, 60 + n);
  auto y = x;
  const float factor = 0.3f;
  k::scale(y.data(), factor, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], x[i] * factor) << "element " << i;
}

INSTANTIATE_TEST_SUITE_P(Sizes, ReduceTest, ::testing::Values(1, 3, 7, 8, 9, 17, 127, 1000003));

TEST(Reduce, EmptyInputSumsToZero) {
  EXPECT_EQ(k::sum(nullptr, 0), 0.0);
  EXPECT_EQ(k::sum_squares(nullptr, 0), 0.0);
}

TEST(Reduce, RejectsNegativeSize) {
  std::vector<float> buf(4, 1.0f);
  EXPECT_THROW(k::sum(buf.data(), -1), std::invalid_argument);
  EXPECT_THROW(k::sum_squares(buf.data(), -1), std::invalid_argument);
  EXPECT_THROW(k::scale(buf.data(), 2.0f, -1), std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::testing
