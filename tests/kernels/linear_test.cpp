// CPU linear kernels against a double reference and central finite differences.
#include "kernels/linear.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <tuple>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

struct Shape {
  int64_t n, in, out;
};

// y = x Wᵀ + b in double.
std::vector<double> ref_forward(const std::vector<double>& x, const std::vector<double>& w,
                                const std::vector<double>* b, const Shape& s) {
  std::vector<double> y(s.n * s.out);
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t o = 0; o < s.out; ++o) {
      double acc = b ? (*b)[o] : 0.0;
      for (int64_t j = 0; j < s.in; ++j) acc += x[i * s.in + j] * w[o * s.in + j];
      y[i * s.out + o] = acc;
    }
  return y;
}

// Float sums of length `in` of values in [-1, 1]: relative 1e-5 plus an absolute slack
// that grows with the reduction length.
double atol_for(int64_t len) { return 2e-7 * static_cast<double>(len); }

class LinearTest : public ::testing::TestWithParam<Shape> {};

TEST_P(LinearTest, ForwardAndBackwardMatchDoubleReference) {
  const Shape s = GetParam();
  const uint64_t seed = 1000 + s.n * 7 + s.in * 131 + s.out;
  const auto x = random_floats(s.n * s.in, seed);
  const auto w = random_floats(s.out * s.in, seed + 1);
  const auto b = random_floats(s.out, seed + 2);
  const auto dy = random_floats(s.n * s.out, seed + 3);
  const auto dw0 = random_floats(s.out * s.in, seed + 4);
  const auto db0 = random_floats(s.out, seed + 5);

  std::vector<float> y(s.n * s.out, 7.0f);
  k::linear_forward(y.data(), x.data(), w.data(), b.data(), s.n, s.in, s.out);
  const auto bd = to_double(b);
  EXPECT_TRUE(all_close(y, ref_forward(to_double(x), to_double(w), &bd, s), 1e-5, atol_for(s.in)));

  std::vector<float> dx(s.n * s.in, 7.0f);
  k::linear_backward_input(dx.data(), dy.data(), w.data(), s.n, s.in, s.out);
  std::vector<double> dx_ref(s.n * s.in, 0.0);
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t j = 0; j < s.in; ++j)
      for (int64_t o = 0; o < s.out; ++o)
        dx_ref[i * s.in + j] += double(dy[i * s.out + o]) * w[o * s.in + j];
  EXPECT_TRUE(all_close(dx, dx_ref, 1e-5, atol_for(s.out)));

  auto dw = dw0;
  auto db = db0;
  k::linear_backward_weight(dw.data(), db.data(), dy.data(), x.data(), s.n, s.in, s.out);
  std::vector<double> dw_ref = to_double(dw0), db_ref = to_double(db0);
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t o = 0; o < s.out; ++o) {
      db_ref[o] += dy[i * s.out + o];
      for (int64_t j = 0; j < s.in; ++j)
        dw_ref[o * s.in + j] += double(dy[i * s.out + o]) * x[i * s.in + j];
    }
  EXPECT_TRUE(all_close(dw, dw_ref, 1e-5, atol_for(s.n)));
  EXPECT_TRUE(all_close(db, db_ref, 1e-5, atol_for(s.n)));
}

TEST_P(LinearTest, NullBiasSkipsBiasAndItsGradient) {
  const Shape s = GetParam();
  const auto x = random_floats(s.n * s.in, 21);
  const auto w = random_floats(s.out * s.in, 22);
  const auto dy = random_floats(s.n * s.out, 23);
  std::vector<float> y(s.n * s.out);
  k::linear_forward(y.data(), x.data(), w.data(), nullptr, s.n, s.in, s.out);
  EXPECT_TRUE(
      all_close(y, ref_forward(to_double(x), to_double(w), nullptr, s), 1e-5, atol_for(s.in)));
  std::vector<float> dw(s.out * s.in, 0.5f), dw_with_bias(s.out * s.in, 0.5f), db(s.out, 0.0f);
  k::linear_backward_weight(dw.data(), nullptr, dy.data(), x.data(), s.n, s.in, s.out);
  k::linear_backward_weight(dw_with_bias.data(), db.data(), dy.data(), x.data(), s.n, s.in, s.out);
  EXPECT_TRUE(same_bits(dw, dw_with_bias));
}

TEST_P(LinearTest, DeterministicAcrossRuns) {
  const Shape s = GetParam();
  const auto x = random_floats(s.n * s.in, 31);
  const auto w = random_floats(s.out * s.in, 32);
  const auto b = random_floats(s.out, 33);
  const auto dy = random_floats(s.n * s.out, 34);
  auto run = [&] {
    std::vector<float> y(s.n * s.out), dx(s.n * s.in), dw(s.out * s.in, 0.25f), db(s.out, 0.25f);
    k::linear_forward(y.data(), x.data(), w.data(), b.data(), s.n, s.in, s.out);
    k::linear_backward_input(dx.data(), dy.data(), w.data(), s.n, s.in, s.out);
    k::linear_backward_weight(dw.data(), db.data(), dy.data(), x.data(), s.n, s.in, s.out);
    return std::make_tuple(y, dx, dw, db);
  };
  const auto [y1, dx1, dw1, db1] = run();
  const auto [y2, dx2, dw2, db2] = run();
  EXPECT_TRUE(same_bits(y1, y2));
  EXPECT_TRUE(same_bits(dx1, dx2));
  EXPECT_TRUE(same_bits(dw1, dw2));
  EXPECT_TRUE(same_bits(db1, db2));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Values(Shape{1, 1, 1}, Shape{3, 17, 5}, Shape{17, 33, 3},
                                           Shape{33, 127, 17}, Shape{127, 65, 31}, Shape{5, 1, 33},
                                           Shape{64, 96, 80},
                                           // Tiled: ragged row and column tiles.
                                           Shape{300, 129, 161}, Shape{257, 70, 1100},
                                           // Past 512 rows: two row tiles of y and dx.
                                           Shape{530, 24, 90},
                                           // dW in two row and two column tiles: the bias
                                           // gradient goes with the first column tile only.
                                           Shape{40, 600, 530},
                                           // One tile wider than 512 (too few multiply-adds
                                           // to split): the bias sums outgrow the stack array.
                                           Shape{2, 3, 1000}));

// dL/dx, dL/dW, dL/db of L = Σ dy ⊙ y against central differences of the double forward.
TEST(LinearGradient, MatchesFiniteDifferences) {
  for (const Shape s : {Shape{1, 3, 1}, Shape{3, 17, 5}, Shape{4, 9, 7}}) {
    SCOPED_TRACE(::testing::Message() << "n " << s.n << " in " << s.in << " out " << s.out);
    const auto x = random_floats(s.n * s.in, 41);
    const auto w = random_floats(s.out * s.in, 42);
    const auto b = random_floats(s.out, 43);
    const auto dy = random_floats(s.n * s.out, 44);
    auto xd = to_double(x), wd = to_double(w), bd = to_double(b);
    const auto dyd = to_double(dy);
    auto loss = [&] { return dot(dyd, ref_forward(xd, wd, &bd, s)); };
    const double h = 1e-3;  // L is linear in each argument: the difference is exact up to rounding

    std::vector<float> dx(s.n * s.in), dw(s.out * s.in, 0.0f), db(s.out, 0.0f);
    k::linear_backward_input(dx.data(), dy.data(), w.data(), s.n, s.in, s.out);
    k::linear_backward_weight(dw.data(), db.data(), dy.data(), x.data(), s.n, s.in, s.out);
    EXPECT_TRUE(all_close(dx, numeric_gradient(xd, loss, h), 1e-5, 1e-6));
    EXPECT_TRUE(all_close(dw, numeric_gradient(wd, loss, h), 1e-5, 1e-6));
    EXPECT_TRUE(all_close(db, numeric_gradient(bd, loss, h), 1e-5, 1e-6));
  }
}

// `+=` really accumulates: three micro-batches equal one call on their concatenation.
TEST(LinearGradient, MicroBatchesAccumulate) {
  const int64_t in = 19, out = 13;
  const int64_t rows[3] = {5, 1, 11};
  const int64_t n = rows[0] + rows[1] + rows[2];
  const auto x = random_floats(n * in, 51);
  const auto dy = random_floats(n * out, 52);
  const auto dw0 = random_floats(out * in, 53);
  const auto db0 = random_floats(out, 54);

  auto dw_parts = dw0, db_parts = db0;
  int64_t first = 0;
  for (int64_t r : rows) {
    k::linear_backward_weight(dw_parts.data(), db_parts.data(), dy.data() + first * out,
                              x.data() + first * in, r, in, out);
    first += r;
  }
  auto dw_whole = dw0, db_whole = db0;
  k::linear_backward_weight(dw_whole.data(), db_whole.data(), dy.data(), x.data(), n, in, out);
  EXPECT_TRUE(all_close(dw_parts, dw_whole, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(db_parts, db_whole, 1e-5, 1e-5));
  // And the accumulated gradient moved away from its start (the calls did add something).
  EXPECT_FALSE(all_close(dw_parts, dw0, 1e-3, 1e-3));
  EXPECT_FALSE(all_close(db_parts, db0, 1e-3, 1e-3));
}

TEST(Linear, RejectsNegativeSizes) {
  std::vector<float> buf(16, 1.0f);
  EXPECT_THROW(k::linear_forward(buf.data(), buf.data(), buf.data(), nullptr, -1, 2, 2),
               std::invalid_argument);
  EXPECT_THROW(k::linear_backward_input(buf.data(), buf.data(), buf.data(), 2, -2, 2),
               std::invalid_argument);
  EXPECT_THROW(k::linear_backward_weight(buf.data(), nullptr, buf.data(), buf.data(), 2, 2, -3),
               std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::testing
