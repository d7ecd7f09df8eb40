// The tensor-level ops: every op runs the CPU kernel of its name with its arguments in order
// (bitwise what a direct call of that kernel gives); ops_checks_test.cpp checks their operands.
#include <gtest/gtest.h>

#include "tests/layers/ops_fixture.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;
using ops::ActivationKind;

// ------------------------------------------- each op runs its kernel, arguments in order
// Sizes differ in every dimension and accumulated outputs start from random values, so a
// wrong kernel, a swapped argument or `=` for `+=` changes the bits.

TEST_F(OpsTest, LinearRunsItsKernels) {
  const int64_t n = 6, in = 5, out = 3;
  const Tensor x = random({n, in}, 1), w = random({out, in}, 2), b = random({out}, 3);
  const Tensor dy = random({n, out}, 4);

  const Tensor y = ctx_.empty({n, out});
  std::vector<float> expected(n * out);
  ops::linear_forward(ctx_, y, x, w, b);
  k::linear_forward(expected.data(), ptr(x), ptr(w), ptr(b), n, in, out);
  EXPECT_TRUE(same_bits(values(y), expected));
  ops::linear_forward(ctx_, y, x, w, Tensor());
  k::linear_forward(expected.data(), ptr(x), ptr(w), nullptr, n, in, out);
  EXPECT_TRUE(same_bits(values(y), expected));

  const Tensor dx = ctx_.empty({n, in});
  std::vector<float> dx_expected(n * in);
  ops::linear_backward_input(ctx_, dx, dy, w);
  k::linear_backward_input(dx_expected.data(), ptr(dy), ptr(w), n, in, out);
  EXPECT_TRUE(same_bits(values(dx), dx_expected));

  const Tensor dw = random({out, in}, 5), db = random({out}, 6);
  std::vector<float> dw_expected = values(dw), db_expected = values(db);
  ops::linear_backward_weight(ctx_, dw, db, dy, x);
  k::linear_backward_weight(dw_expected.data(), db_expected.data(), ptr(dy), ptr(x), n, in, out);
  EXPECT_TRUE(same_bits(values(dw), dw_expected));
  EXPECT_TRUE(same_bits(values(db), db_expected));
  ops::linear_backward_weight(ctx_, dw, Tensor(), dy, x);
  k::linear_backward_weight(dw_expected.data(), nullptr, ptr(dy), ptr(x), n, in, out);
  EXPECT_TRUE(same_bits(values(dw), dw_expected));
}

TEST_F(OpsTest, ActivationRunsTheKernelOfItsKind) {
  const int64_t n = 4 * 6;
  const Tensor x = random({4, 6}, 1), dy = random({4, 6}, 2);
  const Tensor y = ctx_.empty({4, 6}), dx = ctx_.empty({4, 6});
  std::vector<float> expected(n);

  ops::activation_forward(ctx_, ActivationKind::kGelu, y, x);
  k::gelu_forward(expected.data(), ptr(x), n);
  EXPECT_TRUE(same_bits(values(y), expected));
  ops::activation_forward(ctx_, ActivationKind::kRelu, y, x);
  k::relu_forward(expected.data(), ptr(x), n);
  EXPECT_TRUE(same_bits(values(y), expected));

  ops::activation_backward(ctx_, ActivationKind::kGelu, dx, dy, x);
  k::gelu_backward(expected.data(), ptr(dy), ptr(x), n);
  EXPECT_TRUE(same_bits(values(dx), expected));
  ops::activation_backward(ctx_, ActivationKind::kRelu, dx, dy, x);
  k::relu_backward(expected.data(), ptr(dy), ptr(x), n);
  EXPECT_TRUE(same_bits(values(dx), expected));
}

TEST_F(OpsTest, LayerNormRunsItsKernels) {
  const int64_t n = 6, c = 7;
  const float eps = 1e-3f;
  const Tensor x = random({n, c}, 1), gamma = random({c}, 2), beta = random({c}, 3);
  const Tensor dy = random({n, c}, 4);

  const Tensor y = ctx_.empty({n, c}), mean = ctx_.empty({n}), rstd = ctx_.empty({n});
  std::vector<float> y_expected(n * c), mean_expected(n), rstd_expected(n);
  ops::layernorm_forward(ctx_, y, mean, rstd, x, gamma, beta, eps);
  k::layernorm_forward(y_expected.data(), mean_expected.data(), rstd_expected.data(), ptr(x),
                       ptr(gamma), ptr(beta), n, c, eps);
  EXPECT_TRUE(same_bits(values(y), y_expected));
  EXPECT_TRUE(same_bits(values(mean), mean_expected));
  EXPECT_TRUE(same_bits(values(rstd), rstd_expected));

  const Tensor dx = ctx_.empty({n, c});
  std::vector<float> dx_expected(n * c);
  ops::layernorm_backward_input(ctx_, dx, dy, x, mean, rstd, gamma);
  k::layernorm_backward_input(dx_expected.data(), ptr(dy), ptr(x), ptr(mean), ptr(rstd), ptr(gamma),
                              n, c);
  EXPECT_TRUE(same_bits(values(dx), dx_expected));

  const Tensor dgamma = random({c}, 5), dbeta = random({c}, 6);
  std::vector<float> dgamma_expected = values(dgamma), dbeta_expected = values(dbeta);
  ops::layernorm_backward_weight(ctx_, dgamma, dbeta, dy, x, mean, rstd);
  k::layernorm_backward_weight(dgamma_expected.data(), dbeta_expected.data(), ptr(dy), ptr(x),
                               ptr(mean), ptr(rstd), n, c);
  EXPECT_TRUE(same_bits(values(dgamma), dgamma_expected));
  EXPECT_TRUE(same_bits(values(dbeta), dbeta_expected));
}

TEST_F(OpsTest, EmbeddingRunsItsKernels) {
  const int64_t n = 9, c = 4, vocab = 11;
  // Nine tokens of eleven, drawn from six: repeats exercise the ordered accumulation.
  const Tensor tokens = random({n}, 1, DType::kI32, 5);
  const Tensor table = random({vocab, c}, 2), dy = random({n, c}, 3);
  const int32_t* ids = tokens.data<int32_t>();

  const Tensor y = ctx_.empty({n, c});
  std::vector<float> y_expected(n * c);
  ops::embedding_forward(ctx_, y, tokens, table);
  k::embedding_forward(y_expected.data(), ids, ptr(table), n, c, vocab);
  EXPECT_TRUE(same_bits(values(y), y_expected));

  const Tensor dtable = random({vocab, c}, 4);
  std::vector<float> dtable_expected = values(dtable);
  ops::embedding_backward(ctx_, dtable, dy, tokens);
  k::embedding_backward(dtable_expected.data(), ptr(dy), ids, n, c, vocab);
  EXPECT_TRUE(same_bits(values(dtable), dtable_expected));
}

TEST_F(OpsTest, CrossEntropyRunsItsKernel) {
  const int64_t n = 6, vocab = 11;
  const int32_t ignore = -100;
  const float scale = 0.375f;
  const Tensor logits = random({n, vocab}, 1);
  const Tensor targets = random({n}, 2, DType::kI32, 10);
  targets.data<int32_t>()[2] = ignore;
  const int32_t* ids = targets.data<int32_t>();

  const Tensor losses = ctx_.empty({n}), dlogits = ctx_.empty({n, vocab});
  std::vector<float> losses_expected(n), dlogits_expected(n * vocab);
  ops::softmax_cross_entropy(ctx_, losses, dlogits, logits, targets, ignore, scale);
  k::softmax_cross_entropy(losses_expected.data(), dlogits_expected.data(), ptr(logits), ids, n,
                           vocab, ignore, scale);
  EXPECT_TRUE(same_bits(values(losses), losses_expected));
  EXPECT_TRUE(same_bits(values(dlogits), dlogits_expected));

  // In place, as the loss head calls it: the gradient overwrites the logits.
  std::vector<float> in_place_expected = values(logits);
  ops::softmax_cross_entropy(ctx_, losses, logits, logits, targets, ignore, scale);
  k::softmax_cross_entropy(losses_expected.data(), in_place_expected.data(),
                           in_place_expected.data(), ids, n, vocab, ignore, scale);
  EXPECT_TRUE(same_bits(values(losses), losses_expected));
  EXPECT_TRUE(same_bits(values(logits), in_place_expected));
}

TEST_F(OpsTest, ReductionsRunTheirKernelsOnEachTensor) {
  const auto bits = [](double v) { return std::bit_cast<uint64_t>(v); };
  const std::vector<Tensor> xs = {random({1}, 1), random({37}, 2), random({25, 40}, 3)};
  const std::vector<double> sums = ops::sum_each(ctx_, xs);
  const std::vector<double> squares = ops::sum_squares_each(ctx_, xs);
  ASSERT_EQ(sums.size(), xs.size());
  ASSERT_EQ(squares.size(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    const double sum = k::sum(ptr(xs[i]), xs[i].numel());
    const double sum_squares = k::sum_squares(ptr(xs[i]), xs[i].numel());
    EXPECT_EQ(bits(sums[i]), bits(sum));
    EXPECT_EQ(bits(squares[i]), bits(sum_squares));
    EXPECT_EQ(bits(ops::sum(ctx_, xs[i])), bits(sum));
    EXPECT_EQ(bits(ops::sum_squares(ctx_, xs[i])), bits(sum_squares));
  }
  EXPECT_TRUE(ops::sum_each(ctx_, {}).empty());
  EXPECT_TRUE(ops::sum_squares_each(ctx_, {}).empty());
}

TEST_F(OpsTest, AddRunsItsKernel) {
  const Tensor y = random({4, 6}, 1), x = random({4, 6}, 2);
  std::vector<float> expected = values(y);
  ops::add_(ctx_, y, x);
  k::add_inplace(expected.data(), ptr(x), 4 * 6);
  EXPECT_TRUE(same_bits(values(y), expected));
}

// Two tensors of different sizes, one without weight decay; moments from earlier steps.
struct OptimizerState {
  std::vector<std::vector<float>> param, grad, state0, state1;

  explicit OptimizerState(uint64_t seed) {
    for (const size_t n : {size_t{13}, size_t{5}}) {
      param.push_back(random_floats(n, ++seed));
      grad.push_back(random_floats(n, ++seed));
      state0.push_back(random_floats(n, ++seed));
      state1.push_back(random_floats(n, ++seed, 0.0f, 0.1f));  // second moments are >= 0
    }
  }
  std::vector<kernels::OptimizerTensor> tensors() {
    std::vector<kernels::OptimizerTensor> out;
    for (size_t i = 0; i < param.size(); ++i)
      out.push_back({param[i].data(), grad[i].data(), state0[i].data(), state1[i].data(),
                     static_cast<int64_t>(param[i].size()), i == 0});
    return out;
  }
  bool same_bits_as(const OptimizerState& other) const {
    for (size_t i = 0; i < param.size(); ++i)
      if (!same_bits(param[i], other.param[i]) || !same_bits(state0[i], other.state0[i]) ||
          !same_bits(state1[i], other.state1[i]))
        return false;
    return true;
  }
};

TEST_F(OpsTest, OptimizerUpdatesRunTheirKernels) {
  kernels::AdamWParams adamw;
  adamw.lr = 3e-3f;
  adamw.weight_decay = 0.1f;
  adamw.step = 3;
  adamw.grad_scale = 0.75f;
  OptimizerState through_ops(1), direct(1);
  ops::adamw_update(ctx_, through_ops.tensors(), adamw);
  const auto adamw_tensors = direct.tensors();
  k::adamw_update(adamw_tensors.data(), static_cast<int64_t>(adamw_tensors.size()), adamw);
  EXPECT_TRUE(through_ops.same_bits_as(direct));
  EXPECT_FALSE(through_ops.same_bits_as(OptimizerState(1))) << "the update changed nothing";

  kernels::SgdParams sgd;
  sgd.lr = 0.05f;
  sgd.weight_decay = 0.01f;
  sgd.grad_scale = 0.5f;
  OptimizerState sgd_through_ops(20), sgd_direct(20);
  ops::sgd_update(ctx_, sgd_through_ops.tensors(), sgd);
  const auto sgd_tensors = sgd_direct.tensors();
  k::sgd_update(sgd_tensors.data(), static_cast<int64_t>(sgd_tensors.size()), sgd);
  EXPECT_TRUE(sgd_through_ops.same_bits_as(sgd_direct));
  EXPECT_FALSE(sgd_through_ops.same_bits_as(OptimizerState(20))) << "the update changed nothing";
}

TEST_F(OpsTest, InitialisationRunsItsKernels) {
  const int64_t n = 257;
  const Tensor out = random({n}, 1);
  std::vector<float> expected(n);
  ops::init_uniform(ctx_, out, 12345, 678, -0.5f, 0.25f);
  k::init_uniform(expected.data(), n, 12345, 678, -0.5f, 0.25f);
  EXPECT_TRUE(same_bits(values(out), expected));

  ops::fill(ctx_, out, 0.375f);
  k::fill(expected.data(), n, 0.375f);
  EXPECT_TRUE(same_bits(values(out), expected));
}

}  // namespace
}  // namespace conveyor::testing
