// CPU GELU (tanh approximation) and ReLU against double references and finite differences.
#include "kernels/activation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

double gelu_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}

double gelu_grad_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  const double t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

class ActivationTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ActivationTest, GeluMatchesReferenceAndFiniteDifferences) {
  const int64_t n = GetParam();
  const auto x = random_floats(n, 100 + n, -5.0f, 5.0f);
  const auto dy = random_floats(n, 200 + n);
  std::vector<float> y(n), dx(n);
  k::gelu_forward(y.data(), x.data(), n);
  k::gelu_backward(dx.data(), dy.data(), x.data(), n);

  std::vector<double> y_ref(n), dx_ref(n), dx_fd(n);
  const double h = 1e-5;
  for (int64_t i = 0; i < n; ++i) {
    y_ref[i] = gelu_ref(x[i]);
    dx_ref[i] = dy[i] * gelu_grad_ref(x[i]);
    dx_fd[i] = dy[i] * (gelu_ref(x[i] + h) - gelu_ref(x[i] - h)) / (2.0 * h);
  }
  // Float tanh and the cubic cost a few ulps; gelu and its slope pass near zero, hence atol.
  EXPECT_TRUE(all_close(y, y_ref, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(dx, dx_ref, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(dx, dx_fd, 1e-5, 1e-6));
}

TEST_P(ActivationTest, ReluMatchesReferenceAndFiniteDifferences) {
  const int64_t n = GetParam();
  const auto x = random_floats(n, 300 + n, -2.0f, 2.0f);
  const auto dy = random_floats(n, 400 + n);
  std::vector<float> y(n), dx(n);
  k::relu_forward(y.data(), x.data(), n);
  k::relu_backward(dx.data(), dy.data(), x.data(), n);
  const double h = 1e-4;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(y[i], x[i] > 0.0f ? x[i] : 0.0f) << "element " << i;
    if (std::abs(x[i]) < 2.0 * h) continue;  // the kink: no derivative to compare
    const double xi = x[i];
    const double fd = dy[i] * (std::max(xi + h, 0.0) - std::max(xi - h, 0.0)) / (2.0 * h);
    EXPECT_NEAR(dx[i], fd, 1e-6 + 1e-6 * std::abs(fd)) << "element " << i;
  }
}

TEST_P(ActivationTest, BackwardInPlaceOverDyMatchesOutOfPlace) {
  const int64_t n = GetParam();
  const auto x = random_floats(n, 500 + n, -3.0f, 3.0f);
  const auto dy = random_floats(n, 600 + n);
  for (auto backward : {&k::gelu_backward, &k::relu_backward}) {
    std::vector<float> out(n);
    backward(out.data(), dy.data(), x.data(), n, nullptr);
    auto inplace = dy;
    backward(inplace.data(), inplace.data(), x.data(), n, nullptr);
    EXPECT_TRUE(same_bits(out, inplace));
  }
}

TEST_P(ActivationTest, Deterministic) {
  const int64_t n = GetParam();
  const auto x = random_floats(n, 700 + n, -3.0f, 3.0f);
  const auto dy = random_floats(n, 800 + n);
  std::vector<float> y1(n), y2(n), d1(n), d2(n);
  k::gelu_forward(y1.data(), x.data(), n);
  k::gelu_forward(y2.data(), x.data(), n);
  k::gelu_backward(d1.data(), dy.data(), x.data(), n);
  k::gelu_backward(d2.data(), dy.data(), x.data(), n);
  EXPECT_TRUE(same_bits(y1, y2));
  EXPECT_TRUE(same_bits(d1, d2));
}

// Packets of eight with a padded tail: an element's output is the same whether it sits in
// a full group, in the tail or at an unaligned address.
TEST(Gelu, OutputDependsOnTheInputAlone) {
  const int64_t n = 45;
  const auto x = random_floats(n, 990, -4.0f, 4.0f);
  const auto dy = random_floats(n, 991);
  std::vector<float> y(n), dx(n);
  k::gelu_forward(y.data(), x.data(), n);
  k::gelu_backward(dx.data(), dy.data(), x.data(), n);
  for (int64_t shift : {1, 3, 7, 8, 13}) {
    const int64_t m = n - shift;
    std::vector<float> ys(m), dxs(m);
    k::gelu_forward(ys.data(), x.data() + shift, m);
    k::gelu_backward(dxs.data(), dy.data() + shift, x.data() + shift, m);
    EXPECT_TRUE(same_bits(ys, std::vector<float>(y.begin() + shift, y.end()))) << shift;
    EXPECT_TRUE(same_bits(dxs, std::vector<float>(dx.begin() + shift, dx.end()))) << shift;
  }
}

// Far tails: finite, and close to the reference (x for large x, 0 for very negative x).
TEST(Gelu, FiniteAndAccurateInTheTails) {
  const std::vector<float> x = {-1e4f, -300.0f, -50.0f, -12.0f, -7.5f, 7.5f, 12.0f, 300.0f, 1e4f};
  const int64_t n = static_cast<int64_t>(x.size());
  const auto dy = random_floats(n, 900);
  std::vector<float> y(n), dx(n);
  k::gelu_forward(y.data(), x.data(), n);
  k::gelu_backward(dx.data(), dy.data(), x.data(), n);
  std::vector<double> y_ref(n), dx_ref(n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(y[i]) && std::isfinite(dx[i])) << "x " << x[i];
    y_ref[i] = gelu_ref(x[i]);
    dx_ref[i] = dy[i] * gelu_grad_ref(x[i]);
  }
  EXPECT_TRUE(all_close(y, y_ref, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(dx, dx_ref, 1e-6, 1e-7));
}

// 32771: two blocks of 16384 elements (the pool's tasks) and a ragged third of 3.
INSTANTIATE_TEST_SUITE_P(Sizes, ActivationTest, ::testing::Values(1, 3, 17, 33, 127, 1001, 32771));

TEST(Activation, RejectsNegativeSize) {
  std::vector<float> buf(4, 1.0f);
  EXPECT_THROW(k::gelu_forward(buf.data(), buf.data(), -1), std::invalid_argument);
  EXPECT_THROW(k::relu_backward(buf.data(), buf.data(), buf.data(), -4), std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::testing
