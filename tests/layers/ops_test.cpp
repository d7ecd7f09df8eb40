// The tensor-level ops: every operand check refuses a bad operand with a message that names
// it, the expectation and the value seen; and every op runs the CPU kernel of its name with
// its arguments in order (bitwise what a direct call of that kernel gives).
#include "layers/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/core/device_context.h"
#include "engine/core/tensor.h"
#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/init.h"
#include "kernels/layernorm.h"
#include "kernels/linear.h"
#include "kernels/optimizer.h"
#include "kernels/reduce.h"
#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;
using ops::ActivationKind;

// Host memory that says it is on CUDA device 0: operands on the wrong device, made without a
// GPU. The ops must refuse them before any kernel could touch the memory.
class HostMemoryLabelledCuda final : public AllocatorBackend {
 public:
  Device device() const override { return Device::cuda(0); }
  void* system_allocate(size_t bytes) override { return std::aligned_alloc(64, bytes); }
  void system_free(void* ptr) override { std::free(ptr); }
  void* record_event(void*) override { return nullptr; }
  bool event_done(void*) override { return true; }
  void destroy_event(void*) override {}
};

// `call` must throw std::invalid_argument whose message starts with "<what>: " and holds
// every one of `says`.
::testing::AssertionResult rejects(const std::function<void()>& call, const std::string& what,
                                   const std::vector<std::string>& says) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    if (message.rfind(what + ": ", 0) != 0)
      return ::testing::AssertionFailure()
             << "the message does not start with '" << what << ": ': " << message;
    for (const std::string& part : says)
      if (message.find(part) == std::string::npos)
        return ::testing::AssertionFailure() << "the message lacks '" << part << "': " << message;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure()
           << "threw another type than std::invalid_argument: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// A shape an op must refuse for one operand, and what its message says then.
struct WrongShape {
  Shape shape;
  std::string says;
};

// One tensor operand of an op: the name its messages use, a valid value, and its wrong shapes.
struct Operand {
  std::string what;
  Tensor valid;
  std::vector<WrongShape> wrong_shapes;
  bool optional = false;  // undefined means absent (a bias), which is valid
};

using OpCall = std::function<void(const std::vector<Tensor>&)>;

class OpsTest : public ::testing::Test {
 protected:
  // Seeded random values of `dtype`: floats in [-1, 1], or ints in [0, int_high].
  Tensor random(const Shape& shape, uint64_t seed, DType dtype = DType::kF32,
                int32_t int_high = 3) {
    Tensor t = ctx_.empty(shape, dtype);
    const auto n = static_cast<size_t>(t.numel());
    if (dtype == DType::kI32) {
      const auto v = random_ints(n, seed, 0, int_high);
      std::copy(v.begin(), v.end(), t.data<int32_t>());
    } else {
      const auto v = random_floats(n, seed);
      std::copy(v.begin(), v.end(), t.data<float>());
    }
    return t;
  }
  Tensor positive(const Shape& shape, uint64_t seed) {
    Tensor t = ctx_.empty(shape);
    const auto v = random_floats(static_cast<size_t>(t.numel()), seed, 0.5f, 2.0f);
    std::copy(v.begin(), v.end(), t.data<float>());
    return t;
  }
  Tensor on_other_device(const Shape& shape, DType dtype) {
    return Tensor::empty(shape, dtype, cuda_labelled_);
  }
  static const float* ptr(const Tensor& t) { return t.data<float>(); }
  static std::vector<float> values(const Tensor& t) { return to_vector_f32(t); }

  // Replaces each operand in turn by an undefined tensor, one of the other dtype, one on another
  // device and each of its wrong shapes: each time the op must refuse, naming that operand.
  void expect_operand_checks(const std::vector<Operand>& operands, const OpCall& call) {
    std::vector<Tensor> valid;
    for (const Operand& o : operands) valid.push_back(o.valid);
    ASSERT_NO_THROW(call(valid)) << "the valid operands must pass the checks";
    uint64_t seed = 900;
    for (size_t i = 0; i < operands.size(); ++i) {
      const Operand& o = operands[i];
      SCOPED_TRACE("operand '" + o.what + "'");
      const auto with = [&](const Tensor& t) -> std::function<void()> {
        std::vector<Tensor> args = valid;
        args[i] = t;
        return [call, args] { call(args); };
      };
      const DType dtype = o.valid.dtype();
      const DType other = dtype == DType::kF32 ? DType::kI32 : DType::kF32;
      if (!o.optional)
        EXPECT_TRUE(
            rejects(with(Tensor()), o.what, {"expected a defined tensor, got an undefined one"}));
      EXPECT_TRUE(rejects(
          with(random(o.valid.shape(), ++seed, other)), o.what,
          {std::string("expected dtype ") + dtype_name(dtype) + ", got " + dtype_name(other)}));
      EXPECT_TRUE(rejects(with(on_other_device(o.valid.shape(), dtype)), o.what,
                          {"expected a tensor on cpu, got one on cuda:0"}));
      for (const WrongShape& wrong : o.wrong_shapes)
        EXPECT_TRUE(rejects(with(random(wrong.shape, ++seed, dtype)), o.what, {wrong.says}))
            << "shape " << shape_to_string(wrong.shape);
    }
  }

  DeviceContext ctx_{Device::cpu()};
  std::shared_ptr<CachingAllocator> cuda_labelled_ =
      std::make_shared<CachingAllocator>(std::make_unique<HostMemoryLabelledCuda>());
};

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
