// CPU LayerNorm against a double reference and central finite differences.
#include "kernels/layernorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

constexpr float kEps = 1e-5f;

struct Shape {
  int64_t n, c;
};

std::vector<double> ref_forward(const std::vector<double>& x, const std::vector<double>& gamma,
                                const std::vector<double>& beta, const Shape& s,
                                std::vector<double>* mean = nullptr,
                                std::vector<double>* rstd = nullptr) {
  std::vector<double> y(s.n * s.c);
  if (mean) mean->resize(s.n);
  if (rstd) rstd->resize(s.n);
  for (int64_t i = 0; i < s.n; ++i) {
    double mu = 0.0, var = 0.0;
    for (int64_t j = 0; j < s.c; ++j) mu += x[i * s.c + j];
    mu /= s.c;
    for (int64_t j = 0; j < s.c; ++j) var += (x[i * s.c + j] - mu) * (x[i * s.c + j] - mu);
    var /= s.c;
    const double r = 1.0 / std::sqrt(var + kEps);
    for (int64_t j = 0; j < s.c; ++j)
      y[i * s.c + j] = (x[i * s.c + j] - mu) * r * gamma[j] + beta[j];
    if (mean) (*mean)[i] = mu;
    if (rstd) (*rstd)[i] = r;
  }
  return y;
}

struct Inputs {
  std::vector<float> x, gamma, beta, dy;
};

Inputs make_inputs(const Shape& s, uint64_t seed) {
  // An offset row mean exercises the mean subtraction.
  return {random_floats(s.n * s.c, seed, -1.0f, 3.0f), random_floats(s.c, seed + 1, 0.5f, 1.5f),
          random_floats(s.c, seed + 2), random_floats(s.n * s.c, seed + 3)};
}

class LayerNormTest : public ::testing::TestWithParam<Shape> {};

TEST_P(LayerNormTest, ForwardMatchesDoubleReference) {
  const Shape s = GetParam();
  const Inputs in = make_inputs(s, 10 * s.n + s.c);
  std::vector<float> y(s.n * s.c), mean(s.n), rstd(s.n);
  k::layernorm_forward(y.data(), mean.data(), rstd.data(), in.x.data(), in.gamma.data(),
                       in.beta.data(), s.n, s.c, kEps);
  std::vector<double> mean_ref, rstd_ref;
  const auto y_ref = ref_forward(to_double(in.x), to_double(in.gamma), to_double(in.beta), s,
                                 &mean_ref, &rstd_ref);
  EXPECT_TRUE(all_close(y, y_ref, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(mean, mean_ref, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(rstd, rstd_ref, 1e-6, 0.0));
}

TEST_P(LayerNormTest, BackwardMatchesFiniteDifferences) {
  const Shape s = GetParam();
  const Inputs in = make_inputs(s, 20 * s.n + s.c);
  std::vector<float> y(s.n * s.c), mean(s.n), rstd(s.n);
  k::layernorm_forward(y.data(), mean.data(), rstd.data(), in.x.data(), in.gamma.data(),
                       in.beta.data(), s.n, s.c, kEps);
  std::vector<float> dx(s.n * s.c);
  k::layernorm_backward_input(dx.data(), in.dy.data(), in.x.data(), mean.data(), rstd.data(),
                              in.gamma.data(), s.n, s.c);
  const auto dgamma0 = random_floats(s.c, 99);
  const auto dbeta0 = random_floats(s.c, 98);
  auto dgamma = dgamma0, dbeta = dbeta0;
  k::layernorm_backward_weight(dgamma.data(), dbeta.data(), in.dy.data(), in.x.data(), mean.data(),
                               rstd.data(), s.n, s.c);

  auto xd = to_double(in.x), gd = to_double(in.gamma), bd = to_double(in.beta);
  const auto dyd = to_double(in.dy);
  auto loss = [&] { return dot(dyd, ref_forward(xd, gd, bd, s)); };
  const double h = 1e-4;  // truncation error ~h² |f'''|, well below the float tolerances
  EXPECT_TRUE(all_close(dx, numeric_gradient(xd, loss, h), 1e-4, 1e-5));
  auto dgamma_ref = numeric_gradient(gd, loss, h);
  auto dbeta_ref = numeric_gradient(bd, loss, h);
  for (int64_t j = 0; j < s.c; ++j) {
    dgamma_ref[j] += dgamma0[j];
    dbeta_ref[j] += dbeta0[j];
  }
  EXPECT_TRUE(all_close(dgamma, dgamma_ref, 1e-4, 1e-5));
  EXPECT_TRUE(all_close(dbeta, dbeta_ref, 1e-4, 1e-5));
}

TEST_P(LayerNormTest, Deterministic) {
  const Shape s = GetParam();
  const Inputs in = make_inputs(s, 30 * s.n + s.c);
  auto run = [&] {
    std::vector<float> y(s.n * s.c), mean(s.n), rstd(s.n), dx(s.n * s.c), dg(s.c, 0.5f),
        db(s.c, 0.5f);
    k::layernorm_forward(y.data(), mean.data(), rstd.data(), in.x.data(), in.gamma.data(),
                         in.beta.data(), s.n, s.c, kEps);
    k::layernorm_backward_input(dx.data(), in.dy.data(), in.x.data(), mean.data(), rstd.data(),
                                in.gamma.data(), s.n, s.c);
    k::layernorm_backward_weight(dg.data(), db.data(), in.dy.data(), in.x.data(), mean.data(),
                                 rstd.data(), s.n, s.c);
    std::vector<float> all = y;
    for (const auto* v : {&mean, &rstd, &dx, &dg, &db}) all.insert(all.end(), v->begin(), v->end());
    return all;
  };
  EXPECT_TRUE(same_bits(run(), run()));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest,
                         ::testing::Values(Shape{1, 3}, Shape{3, 17}, Shape{17, 33}, Shape{5, 127},
                                           Shape{2, 1}, Shape{131, 203}));

// `+=` accumulates: dgamma/dbeta over three micro-batches equal one call on all rows.
TEST(LayerNormGradient, MicroBatchesAccumulate) {
  const Shape s{23, 37};
  const Inputs in = make_inputs(s, 77);
  std::vector<float> y(s.n * s.c), mean(s.n), rstd(s.n);
  k::layernorm_forward(y.data(), mean.data(), rstd.data(), in.x.data(), in.gamma.data(),
                       in.beta.data(), s.n, s.c, kEps);
  const auto dg0 = random_floats(s.c, 78);
  const auto db0 = random_floats(s.c, 79);
  auto dg_parts = dg0, db_parts = db0;
  int64_t first = 0;
  for (int64_t rows : {7, 1, 15}) {
    k::layernorm_backward_weight(dg_parts.data(), db_parts.data(), in.dy.data() + first * s.c,
                                 in.x.data() + first * s.c, mean.data() + first,
                                 rstd.data() + first, rows, s.c);
    first += rows;
  }
  ASSERT_EQ(first, s.n);
  auto dg_whole = dg0, db_whole = db0;
  k::layernorm_backward_weight(dg_whole.data(), db_whole.data(), in.dy.data(), in.x.data(),
                               mean.data(), rstd.data(), s.n, s.c);
  EXPECT_TRUE(all_close(dg_parts, dg_whole, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(db_parts, db_whole, 1e-5, 1e-6));
  EXPECT_FALSE(all_close(dg_parts, dg0, 1e-3, 1e-3));
}

TEST(LayerNorm, RejectsEmptyRowsAndNegativeSizes) {
  std::vector<float> buf(16, 1.0f);
  EXPECT_THROW(k::layernorm_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                    buf.data(), 2, 0, kEps),
               std::invalid_argument);
  EXPECT_THROW(k::layernorm_backward_input(buf.data(), buf.data(), buf.data(), buf.data(),
                                           buf.data(), buf.data(), -1, 4),
               std::invalid_argument);
  EXPECT_THROW(k::layernorm_backward_weight(buf.data(), buf.data(), buf.data(), buf.data(),
                                            buf.data(), buf.data(), 2, -4),
               std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::testing
