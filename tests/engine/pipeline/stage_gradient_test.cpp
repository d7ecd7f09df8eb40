// The composed model, run through stages: analytic gradients against finite differences of the
// loss, the split backward (input half then weight half) against the full one, gradient
// accumulation over micro-batches, and stage cuts that must not change a single bit.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/pipeline/stage.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "layers/model.h"
#include "layers/ops.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.preset = "test";
  c.d_model = 8;
  c.n_layers = 2;
  c.vocab = 11;
  c.hidden = 13;
  return c;
}

struct Batch {
  Tensor tokens;
  MicroBatchInputs in;
};

Batch make_batch(DeviceContext& ctx, const ModelConfig& c, int64_t n, uint64_t seed,
                 float loss_scale) {
  Batch b;
  auto tokens = testing::random_ints(n, seed, 0, static_cast<int32_t>(c.vocab - 1));
  auto targets = testing::random_ints(n, seed + 1, 0, static_cast<int32_t>(c.vocab - 1));
  b.tokens = ctx.empty({n}, DType::kI32);
  b.in.targets = ctx.empty({n}, DType::kI32);
  copy_from_host(b.tokens, tokens.data(), n * sizeof(int32_t));
  copy_from_host(b.in.targets, targets.data(), n * sizeof(int32_t));
  b.in.loss_scale = loss_scale;
  b.in.tokens = n;
  return b;
}

// Mean loss of the batch with the current weights (runs forward and discards the backward).
double mean_loss(Stage& stage, DeviceContext& ctx, const Batch& b, int64_t mb) {
  Tensor losses = stage.forward(mb, b.tokens, b.in);
  const double loss = ops::sum(ctx, losses) / static_cast<double>(b.tokens.numel());
  stage.backward(mb, Tensor());  // releases the activations; gradients are zeroed by callers
  return loss;
}

TEST(ModelGradient, MatchesFiniteDifferencesOfTheLoss) {
  const ModelConfig c = small_config();
  DeviceContext ctx(Device::cpu());
  Stage stage(reference_model(c), 0, c.num_units(), ctx, /*seed=*/7);
  const int64_t n = 9;
  const Batch b = make_batch(ctx, c, n, 42, 1.0f / n);
  stage.forward(0, b.tokens, b.in);
  stage.backward(0, Tensor());

  // Read every gradient first: the finite differences below run backward again.
  const std::vector<Parameter*> params = stage.parameters();
  std::vector<std::vector<float>> grads;
  for (Parameter* p : params) grads.push_back(to_vector_f32(p->grad));
  int checked = 0;
  for (size_t pi = 0; pi < params.size(); ++pi) {
    Parameter* p = params[pi];
    const std::vector<float>& grad = grads[pi];
    // A few entries of every parameter, spread over the tensor.
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t i = (k * 7919) % p->value.numel();
      float* w = p->value.data<float>() + i;
      const float saved = *w;
      const float h = 1e-2f;
      *w = saved + h;
      zero_grads(ctx, stage.parameters());
      const double up = mean_loss(stage, ctx, b, 1);
      *w = saved - h;
      const double down = mean_loss(stage, ctx, b, 1);
      *w = saved;
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(grad[i], numeric, 2e-3 + 3e-2 * std::abs(numeric)) << p->name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(ModelGradient, SplitBackwardEqualsFullBackwardBitwise) {
  const ModelConfig c = small_config();
  DeviceContext ctx(Device::cpu());
  Stage full(reference_model(c), 0, c.num_units(), ctx, 3),
      split(reference_model(c), 0, c.num_units(), ctx, 3);
  const Batch b = make_batch(ctx, c, 17, 5, 1.0f / 17);
  full.forward(0, b.tokens, b.in);
  full.backward(0, Tensor());
  split.forward(0, b.tokens, b.in);
  split.backward_input(0, Tensor());
  EXPECT_EQ(split.in_flight(), 1u);  // the weight half still holds activations
  split.backward_weight(0);
  EXPECT_EQ(split.in_flight(), 0u);
  auto pf = full.parameters(), ps = split.parameters();
  ASSERT_EQ(pf.size(), ps.size());
  for (size_t i = 0; i < pf.size(); ++i)
    EXPECT_EQ(to_vector_f32(pf[i]->grad), to_vector_f32(ps[i]->grad)) << pf[i]->name;
}

TEST(ModelGradient, MicroBatchesAccumulateIntoTheStepGradient) {
  const ModelConfig c = small_config();
  DeviceContext ctx(Device::cpu());
  Stage whole(reference_model(c), 0, c.num_units(), ctx, 11),
      parts(reference_model(c), 0, c.num_units(), ctx, 11);
  const int64_t n = 12;
  // The whole batch at once, loss scale 1/n ...
  const Batch all = make_batch(ctx, c, n, 99, 1.0f / n);
  whole.forward(0, all.tokens, all.in);
  whole.backward(0, Tensor());
  // ... equals three micro-batches of 4 rows with the same step-level loss scale.
  for (int64_t mb = 0; mb < 3; ++mb) {
    Batch part;
    part.tokens = all.tokens.slice_rows(4 * mb, 4);
    part.in = all.in;
    part.in.targets = all.in.targets.slice_rows(4 * mb, 4);
    part.in.tokens = 4;
    parts.forward(mb, part.tokens, part.in);
    parts.backward(mb, Tensor());
  }
  auto pw = whole.parameters(), pp = parts.parameters();
  for (size_t i = 0; i < pw.size(); ++i)
    EXPECT_TRUE(
        testing::all_close(to_vector_f32(pp[i]->grad), to_vector_f32(pw[i]->grad), 1e-4, 1e-6))
        << pw[i]->name;
}

TEST(ModelGradient, CuttingTheModelIntoStagesChangesNoBit) {
  const ModelConfig c = small_config();  // 4 units: embed, 2 blocks, head
  DeviceContext ctx(Device::cpu());
  Stage one(reference_model(c), 0, 4, ctx, 21);
  Stage first(reference_model(c), 0, 2, ctx, 21), second(reference_model(c), 2, 4, ctx, 21);
  const Batch b = make_batch(ctx, c, 10, 8, 0.1f);

  const auto loss_one = to_vector_f32(one.forward(0, b.tokens, b.in));
  one.backward(0, Tensor());

  Tensor act = first.forward(0, b.tokens, b.in);
  const auto loss_two = to_vector_f32(second.forward(0, act, b.in));
  Tensor grad = second.backward(0, Tensor());
  EXPECT_FALSE(first.backward(0, grad).defined());  // the embedding has no input gradient

  EXPECT_EQ(loss_one, loss_two);
  std::vector<Parameter*> cut = first.parameters();
  for (Parameter* p : second.parameters()) cut.push_back(p);
  auto whole = one.parameters();
  ASSERT_EQ(whole.size(), cut.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_EQ(whole[i]->name, cut[i]->name);
    EXPECT_EQ(to_vector_f32(whole[i]->value), to_vector_f32(cut[i]->value)) << whole[i]->name;
    EXPECT_EQ(to_vector_f32(whole[i]->grad), to_vector_f32(cut[i]->grad)) << whole[i]->name;
  }
}

TEST(ModelGradient, ParametersHaveGlobalNames) {
  ModelConfig c = small_config();
  c.n_layers = 4;
  DeviceContext ctx(Device::cpu());
  Stage middle(reference_model(c), 3, 5, ctx, 1);  // blocks.2, blocks.3
  std::vector<std::string> names;
  for (Parameter* p : middle.parameters()) names.push_back(p->name);
  EXPECT_EQ(names.front(), "blocks.2.ln.weight");
  EXPECT_EQ(names.back(), "blocks.3.fc2.bias");
  EXPECT_EQ(count_parameters(c), [&] {
    Stage all(reference_model(c), 0, c.num_units(), ctx, 1);
    int64_t total = 0;
    for (Parameter* p : all.parameters()) total += p->value.numel();
    return total;
  }());
}

TEST(ModelGradient, ForwardOnlyGivesTheForwardLossesAndKeepsNothing) {
  const ModelConfig c = small_config();
  DeviceContext ctx(Device::cpu());
  Stage first(reference_model(c), 0, 2, ctx, 4), second(reference_model(c), 2, 4, ctx, 4);
  const Batch b = make_batch(ctx, c, 11, 31, 1.0f / 11);
  const auto eval = to_vector_f32(second.forward_only(first.forward_only(b.tokens, b.in), b.in));
  EXPECT_EQ(first.in_flight(), 0u);
  EXPECT_EQ(second.in_flight(), 0u);
  std::vector<Parameter*> params = first.parameters();
  for (Parameter* p : second.parameters()) params.push_back(p);
  for (Parameter* p : params)
    EXPECT_EQ(to_vector_f32(p->grad), std::vector<float>(p->grad.numel(), 0.0f)) << p->name;
  const auto trained = to_vector_f32(second.forward(0, first.forward(0, b.tokens, b.in), b.in));
  EXPECT_EQ(eval, trained);
  // A forward-only pass between a forward and its backward leaves that micro-batch alone.
  second.forward_only(first.forward_only(b.tokens, b.in), b.in);
  EXPECT_EQ(second.in_flight(), 1u);
  EXPECT_NO_THROW(first.backward(0, second.backward(0, Tensor())));
}

TEST(ModelGradient, BackwardBeforeForwardIsAnError) {
  const ModelConfig c = small_config();
  DeviceContext ctx(Device::cpu());
  Stage stage(reference_model(c), 0, c.num_units(), ctx, 1);
  EXPECT_THROW(stage.backward(3, Tensor()), std::logic_error);
  EXPECT_THROW(Stage(reference_model(c), 2, 2, ctx, 1), std::invalid_argument);
}

// Passes its input and gradient through; its weight gradient assigns a fresh tensor of
// `rows` elements to its parameter's gradient (of 3) instead of adding into it.
class ReplacesItsGradient : public Layer {
 public:
  explicit ReplacesItsGradient(int64_t rows) : rows_(rows) {}
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {&weight_}; }
  Tensor forward(DeviceContext&, const Tensor& x, const MicroBatchInputs&, SavedTensors&) override {
    return x;
  }
  Tensor backward_input(DeviceContext&, const Tensor& dy, SavedTensors&) override { return dy; }
  void backward_weight(DeviceContext& ctx, SavedTensors&) override {
    weight_.grad = ctx.zeros({rows_});
  }

 private:
  std::string name_ = "swap";
  int64_t rows_;
  Parameter weight_{"swap.weight", {3}, InitSpec::constant(1.0f), false};
};

TEST(ModelGradient, AUnitThatReplacesAGradientInsteadOfAddingIsNamed) {
  // A smaller tensor would have the optimizer read past it; one of the same size would drop
  // the micro-batches accumulated before.
  for (int64_t rows : {2, 3}) {
    ModelDescription model;
    model.name = "replaces a gradient";
    model.num_units = 3;
    model.vocab = 5;
    model.activation = activation_rows(4);
    model.make_unit = [rows](int64_t index) -> std::unique_ptr<Layer> {
      if (index == 0) return std::make_unique<Embedding>("embed", 5, 4);
      if (index == 1) return std::make_unique<ReplacesItsGradient>(rows);
      return std::make_unique<LossHead>("head", 4, 5);
    };
    DeviceContext ctx(Device::cpu());
    Stage stage(model, 0, 3, ctx, 1);
    MicroBatchInputs in;
    const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 0};
    Tensor tokens = ctx.empty({6}, DType::kI32);
    in.targets = ctx.empty({6}, DType::kI32);
    copy_from_host(tokens, ids.data(), ids.size() * sizeof(int32_t));
    copy_from_host(in.targets, ids.data(), ids.size() * sizeof(int32_t));
    in.loss_scale = 1.0f / 6;
    in.tokens = 6;
    stage.forward(0, tokens, in);
    try {
      stage.backward(0, Tensor());
      ADD_FAILURE() << "a replaced gradient of " << rows << " elements went unnoticed";
    } catch (const std::logic_error& e) {
      EXPECT_EQ(std::string(e.what()),
                "unit 1 ('swap') replaced the gradient of 'swap.weight'; accumulate into "
                "Parameter::grad (+=)");
    }
  }
}

}  // namespace
}  // namespace conveyor
