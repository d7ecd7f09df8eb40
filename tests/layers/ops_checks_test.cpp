// The tensor-level ops' operand checks: every check refuses a bad operand with a message that
// names it, the expectation and the value seen.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tests/layers/ops_fixture.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;
using ops::ActivationKind;

// ------------------------------------------------------------------------ operand checks

TEST_F(OpsTest, LinearForwardChecksEveryOperand) {
  expect_operand_checks(
      {{"linear output", random({6, 3}, 1), {{{6, 4}, "expected shape [6, 3], got [6, 4]"}}},
       {"linear input",
        random({6, 5}, 2),
        {{{6, 5, 1}, "expected a 2-d tensor, got f32[6, 5, 1] on cpu"}}},
       {"linear weight",
        random({3, 5}, 3),
        {{{3, 6}, "expected shape [3, 5], got [3, 6]"},
         {{15}, "expected a 2-d tensor, got f32[15] on cpu"}}},
       {"linear bias", random({3}, 4), {{{4}, "expected shape [3], got [4]"}}, true}},
      [&](const std::vector<Tensor>& a) { ops::linear_forward(ctx_, a[0], a[1], a[2], a[3]); });
}

TEST_F(OpsTest, LinearBackwardInputChecksEveryOperand) {
  expect_operand_checks(
      {{"linear input gradient",
        random({6, 5}, 1),
        {{{6, 3}, "expected shape [6, 5], got [6, 3]"}}},
       {"linear output gradient",
        random({6, 3}, 2),
        {{{6, 5}, "expected shape [6, 3], got [6, 5]"},
         {{18}, "expected a 2-d tensor, got f32[18] on cpu"}}},
       {"linear weight", random({3, 5}, 3), {{{15}, "expected a 2-d tensor, got f32[15] on cpu"}}}},
      [&](const std::vector<Tensor>& a) { ops::linear_backward_input(ctx_, a[0], a[1], a[2]); });
}

TEST_F(OpsTest, LinearBackwardWeightChecksEveryOperand) {
  expect_operand_checks(
      {{"linear weight gradient",
        random({3, 5}, 1),
        {{{15}, "expected a 2-d tensor, got f32[15] on cpu"}}},
       {"linear bias gradient", random({3}, 2), {{{5}, "expected shape [3], got [5]"}}, true},
       {"linear output gradient",
        random({6, 3}, 3),
        {{{5, 3}, "expected shape [6, 3], got [5, 3]"}}},
       {"linear input",
        random({6, 5}, 4),
        {{{6, 4}, "expected shape [6, 5], got [6, 4]"},
         {{30}, "expected a 2-d tensor, got f32[30] on cpu"}}}},
      [&](const std::vector<Tensor>& a) {
        ops::linear_backward_weight(ctx_, a[0], a[1], a[2], a[3]);
      });
}

TEST_F(OpsTest, ActivationChecksEveryOperand) {
  for (const ActivationKind kind : {ActivationKind::kGelu, ActivationKind::kRelu}) {
    SCOPED_TRACE(ops::activation_name(kind));
    expect_operand_checks(
        {{"activation output", random({4, 6}, 1), {{{6, 4}, "expected shape [4, 6], got [6, 4]"}}},
         {"activation input", random({4, 6}, 2), {}}},
        [&](const std::vector<Tensor>& a) { ops::activation_forward(ctx_, kind, a[0], a[1]); });
    expect_operand_checks({{"activation input gradient",
                            random({4, 6}, 3),
                            {{{24}, "expected shape [4, 6], got [24]"}}},
                           {"activation output gradient",
                            random({4, 6}, 4),
                            {{{4, 5}, "expected shape [4, 6], got [4, 5]"}}},
                           {"activation input", random({4, 6}, 5), {}}},
                          [&](const std::vector<Tensor>& a) {
                            ops::activation_backward(ctx_, kind, a[0], a[1], a[2]);
                          });
  }
}

TEST_F(OpsTest, LayerNormForwardChecksEveryOperand) {
  expect_operand_checks(
      {{"layernorm output", random({6, 7}, 1), {{{6, 8}, "expected shape [6, 7], got [6, 8]"}}},
       {"layernorm mean", random({6}, 2), {{{7}, "expected shape [6], got [7]"}}},
       {"layernorm rstd", positive({6}, 3), {{{6, 1}, "expected shape [6], got [6, 1]"}}},
       {"layernorm input",
        random({6, 7}, 4),
        {{{6, 7, 1}, "expected a 2-d tensor, got f32[6, 7, 1] on cpu"}}},
       {"layernorm weight", random({7}, 5), {{{6}, "expected shape [7], got [6]"}}},
       {"layernorm bias", random({7}, 6), {{{8}, "expected shape [7], got [8]"}}}},
      [&](const std::vector<Tensor>& a) {
        ops::layernorm_forward(ctx_, a[0], a[1], a[2], a[3], a[4], a[5], 1e-5f);
      });
}

TEST_F(OpsTest, LayerNormBackwardInputChecksEveryOperand) {
  expect_operand_checks(
      {{"layernorm input gradient",
        random({6, 7}, 1),
        {{{7, 6}, "expected shape [6, 7], got [7, 6]"}}},
       {"layernorm output gradient",
        random({6, 7}, 2),
        {{{6, 6}, "expected shape [6, 7], got [6, 6]"}}},
       {"layernorm input",
        random({6, 7}, 3),
        {{{42}, "expected a 2-d tensor, got f32[42] on cpu"}}},
       {"layernorm mean", random({6}, 4), {{{5}, "expected shape [6], got [5]"}}},
       {"layernorm rstd", positive({6}, 5), {{{7}, "expected shape [6], got [7]"}}},
       {"layernorm weight", random({7}, 6), {{{1, 7}, "expected shape [7], got [1, 7]"}}}},
      [&](const std::vector<Tensor>& a) {
        ops::layernorm_backward_input(ctx_, a[0], a[1], a[2], a[3], a[4], a[5]);
      });
}

TEST_F(OpsTest, LayerNormBackwardWeightChecksEveryOperand) {
  expect_operand_checks(
      {{"layernorm weight gradient", random({7}, 1), {{{6}, "expected shape [7], got [6]"}}},
       {"layernorm bias gradient", random({7}, 2), {{{7, 1}, "expected shape [7], got [7, 1]"}}},
       {"layernorm output gradient",
        random({6, 7}, 3),
        {{{5, 7}, "expected shape [6, 7], got [5, 7]"}}},
       {"layernorm input",
        random({6, 7}, 4),
        {{{6, 7, 1}, "expected a 2-d tensor, got f32[6, 7, 1] on cpu"}}},
       {"layernorm mean", random({6}, 5), {{{1}, "expected shape [6], got [1]"}}},
       {"layernorm rstd", positive({6}, 6), {{{12}, "expected shape [6], got [12]"}}}},
      [&](const std::vector<Tensor>& a) {
        ops::layernorm_backward_weight(ctx_, a[0], a[1], a[2], a[3], a[4], a[5]);
      });
}

TEST_F(OpsTest, EmbeddingChecksEveryOperand) {
  const Tensor tokens = random({9}, 1, DType::kI32, 10);
  expect_operand_checks(
      {{"embedding output", random({9, 4}, 2), {{{9, 5}, "expected shape [9, 4], got [9, 5]"}}},
       {"embedding tokens", tokens, {}},
       {"embedding table",
        random({11, 4}, 3),
        {{{44}, "expected a 2-d tensor, got f32[44] on cpu"}}}},
      [&](const std::vector<Tensor>& a) { ops::embedding_forward(ctx_, a[0], a[1], a[2]); });
  expect_operand_checks(
      {{"embedding table gradient",
        random({11, 4}, 4),
        {{{44}, "expected a 2-d tensor, got f32[44] on cpu"}}},
       {"embedding output gradient",
        random({9, 4}, 5),
        {{{9, 5}, "expected shape [9, 4], got [9, 5]"}}},
       {"embedding tokens", tokens, {}}},
      [&](const std::vector<Tensor>& a) { ops::embedding_backward(ctx_, a[0], a[1], a[2]); });
}

TEST_F(OpsTest, CrossEntropyChecksEveryOperand) {
  expect_operand_checks(
      {{"cross-entropy losses", random({6}, 1), {{{6, 1}, "expected shape [6], got [6, 1]"}}},
       {"cross-entropy logit gradient",
        random({6, 11}, 2),
        {{{6, 10}, "expected shape [6, 11], got [6, 10]"}}},
       {"cross-entropy logits",
        random({6, 11}, 3),
        {{{66}, "expected a 2-d tensor, got f32[66] on cpu"}}},
       {"cross-entropy targets",
        random({6}, 4, DType::kI32, 10),
        {{{7}, "expected shape [6], got [7]"}}}},
      [&](const std::vector<Tensor>& a) {
        ops::softmax_cross_entropy(ctx_, a[0], a[1], a[2], a[3], -100, 0.5f);
      });
}

TEST_F(OpsTest, ReductionsCheckEveryInput) {
  expect_operand_checks({{"sum input", random({5, 3}, 1), {}}},
                        [&](const std::vector<Tensor>& a) { ops::sum(ctx_, a[0]); });
  expect_operand_checks({{"norm input", random({5, 3}, 2), {}}},
                        [&](const std::vector<Tensor>& a) { ops::sum_squares(ctx_, a[0]); });
  // A bad tensor anywhere in a batch is found, not only the first.
  expect_operand_checks({{"sum input", random({4}, 3), {}}, {"sum input", random({2, 3}, 4), {}}},
                        [&](const std::vector<Tensor>& a) {
                          ops::sum_each(ctx_, {a[0], a[1]});
                        });
  expect_operand_checks({{"norm input", random({4}, 5), {}}, {"norm input", random({2, 3}, 6), {}}},
                        [&](const std::vector<Tensor>& a) {
                          ops::sum_squares_each(ctx_, {a[0], a[1]});
                        });
}

TEST_F(OpsTest, AddChecksEveryOperand) {
  expect_operand_checks(
      {{"add destination", random({4, 6}, 1), {}},
       {"add source", random({4, 6}, 2), {{{6, 4}, "expected shape [4, 6], got [6, 4]"}}}},
      [&](const std::vector<Tensor>& a) { ops::add_(ctx_, a[0], a[1]); });
}

TEST_F(OpsTest, InitialisationChecksItsTensor) {
  expect_operand_checks(
      {{"initialised tensor", random({5, 2}, 1), {}}},
      [&](const std::vector<Tensor>& a) { ops::init_uniform(ctx_, a[0], 7, 11, -0.5f, 0.5f); });
  expect_operand_checks({{"filled tensor", random({5, 2}, 2), {}}},
                        [&](const std::vector<Tensor>& a) { ops::fill(ctx_, a[0], 0.25f); });
}

// A GEMM reads its inputs while it writes its output: an output over an input would give
// wrong values without a word, on either backend.
TEST_F(OpsTest, LinearOutputsMustNotShareMemoryWithTheirInputs) {
  const Tensor x = random({4, 4}, 1), w = random({4, 4}, 2), b = random({4}, 3);
  const std::vector<float> x_before = values(x), w_before = values(w);
  const Tensor separate = random({4, 4}, 4);
  EXPECT_TRUE(rejects([&] { ops::linear_forward(ctx_, x, x, w, b); }, "linear output",
                      {"shares memory with the linear input f32[4, 4] on cpu",
                       "give the output a tensor of its own"}));
  EXPECT_TRUE(rejects([&] { ops::linear_forward(ctx_, w, x, w, b); }, "linear output",
                      {"shares memory with the linear weight"}));
  EXPECT_TRUE(rejects([&] { ops::linear_backward_input(ctx_, x, x, w); }, "linear input gradient",
                      {"shares memory with the linear output gradient"}));
  EXPECT_TRUE(rejects([&] { ops::linear_backward_weight(ctx_, x, Tensor(), separate, x); },
                      "linear weight gradient", {"shares memory with the linear input"}));
  EXPECT_TRUE(rejects([&] { ops::linear_backward_weight(ctx_, separate, x.view(0, {4}), x, w); },
                      "linear bias gradient", {"shares memory with the linear output gradient"}));
  // Refused before anything was written.
  EXPECT_EQ(values(x), x_before);
  EXPECT_EQ(values(w), w_before);

  // Rows of one buffer: overlapping ones are refused, adjacent ones are two tensors.
  const Tensor rows = random({8, 4}, 5);
  EXPECT_TRUE(rejects(
      [&] { ops::linear_forward(ctx_, rows.slice_rows(0, 4), rows.slice_rows(3, 4), w, b); },
      "linear output", {"shares memory with the linear input"}));
  EXPECT_NO_THROW(ops::linear_forward(ctx_, rows.slice_rows(0, 4), rows.slice_rows(4, 4), w, b));
}

TEST_F(OpsTest, AnActivationKindOutsideTheEnumIsRefused) {
  const auto kind = static_cast<ActivationKind>(7);
  const Tensor x = random({4, 6}, 1), dy = random({4, 6}, 2), y = random({4, 6}, 3);
  const std::string says =
      "activation kind must be ops::ActivationKind::kGelu or kRelu, got the value 7";
  try {
    ops::activation_forward(ctx_, kind, y, x);
    ADD_FAILURE() << "activation kind 7 ran forward";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), says);
  }
  try {
    ops::activation_backward(ctx_, kind, y, dy, x);
    ADD_FAILURE() << "activation kind 7 ran backward";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), says);
  }
}

TEST_F(OpsTest, LayerNormEpsilonMustBeFiniteAndAboveZero) {
  const Tensor x = random({6, 7}, 1), gamma = random({7}, 2), beta = random({7}, 3);
  const Tensor y = random({6, 7}, 4), mean = random({6}, 5), rstd = random({6}, 6);
  for (const float eps : {0.0f, -1e-5f, std::numeric_limits<float>::infinity(), std::nanf("")})
    EXPECT_TRUE(rejects([&] { ops::layernorm_forward(ctx_, y, mean, rstd, x, gamma, beta, eps); },
                        "layernorm eps", {"expected a finite number above 0, got "}))
        << "eps " << eps;
  EXPECT_NO_THROW(ops::layernorm_forward(ctx_, y, mean, rstd, x, gamma, beta, 1e-6f));
}

TEST_F(OpsTest, CrossEntropyGradScaleMustBeFinite) {
  const Tensor losses = random({6}, 1), dlogits = random({6, 11}, 2), logits = random({6, 11}, 3);
  const Tensor targets = random({6}, 4, DType::kI32, 10);
  for (const float scale : {std::numeric_limits<float>::infinity(), std::nanf("")})
    EXPECT_TRUE(rejects(
        [&] { ops::softmax_cross_entropy(ctx_, losses, dlogits, logits, targets, -100, scale); },
        "cross-entropy grad_scale", {"expected a finite number, got "}))
        << "grad_scale " << scale;
  EXPECT_NO_THROW(ops::softmax_cross_entropy(ctx_, losses, dlogits, logits, targets, -100, 0.0f));
}

TEST_F(OpsTest, UnknownActivationNameIsAClearError) {
  EXPECT_EQ(ops::parse_activation("gelu"), ActivationKind::kGelu);
  EXPECT_EQ(ops::parse_activation("relu"), ActivationKind::kRelu);
  try {
    ops::parse_activation("swish");
    ADD_FAILURE() << "an unknown activation was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown activation 'swish', expected gelu or relu"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace conveyor::testing
