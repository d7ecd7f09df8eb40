// A stage checks what crosses each unit boundary against the model's description: a unit of
// a user's model that returns another shape or dtype than the description says is named
// where it does so, rather than failing in a kernel of the next unit or on another rank.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/core/device_context.h"
#include "engine/pipeline/stage.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "layers/model.h"

namespace conveyor {
namespace {

constexpr int64_t kWidth = 4, kVocab = 5, kTokens = 6;

// Passes its input through, or returns a fresh tensor of `forward_spec`; its input gradient is
// dy, or a fresh tensor of `gradient_spec`. Parameters: none.
class Misshapen : public Layer {
 public:
  using Spec = std::function<ActivationSpec(const Tensor&)>;
  Misshapen(Spec forward_spec, Spec gradient_spec)
      : forward_spec_(std::move(forward_spec)), gradient_spec_(std::move(gradient_spec)) {}
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {}; }
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs&,
                 SavedTensors&) override {
    if (!forward_spec_) return x;
    const ActivationSpec spec = forward_spec_(x);
    return ctx.empty(spec.shape, spec.dtype);
  }
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors&) override {
    if (!gradient_spec_) return dy;
    const ActivationSpec spec = gradient_spec_(dy);
    return ctx.empty(spec.shape, spec.dtype);
  }
  void backward_weight(DeviceContext&, SavedTensors&) override {}

 private:
  std::string name_ = "misshapen";
  Spec forward_spec_, gradient_spec_;
};

// embed -> unit 1 -> unit 2, rows of kWidth between units; `unit` makes units 1 and 2 when
// given for that index, else unit 1 passes through and unit 2 is the loss head.
ModelDescription model_with(std::function<std::unique_ptr<Layer>(int64_t)> unit) {
  ModelDescription model;
  model.name = "misshapen";
  model.num_units = 3;
  model.vocab = kVocab;
  model.activation = activation_rows(kWidth);
  model.make_unit = [unit](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 0) return std::make_unique<Embedding>("embed", kVocab, kWidth);
    if (unit)
      if (std::unique_ptr<Layer> layer = unit(index)) return layer;
    if (index == 1) return std::make_unique<Misshapen>(nullptr, nullptr);
    return std::make_unique<LossHead>("head", kWidth, kVocab);
  };
  return model;
}

// Unit `index` is a Misshapen of the two specs.
ModelDescription misshapen_at(int64_t index, Misshapen::Spec forward_spec,
                              Misshapen::Spec gradient_spec = nullptr) {
  return model_with([=](int64_t i) -> std::unique_ptr<Layer> {
    if (i != index) return nullptr;
    return std::make_unique<Misshapen>(forward_spec, gradient_spec);
  });
}

ActivationSpec rows_of(int64_t width, DType dtype = DType::kF32) {
  return {{kTokens, width}, dtype};
}

struct Inputs {
  Tensor tokens;
  MicroBatchInputs in;
};

Inputs inputs_on(DeviceContext& ctx) {
  Inputs b;
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 0};
  b.tokens = ctx.empty({kTokens}, DType::kI32);
  b.in.targets = ctx.empty({kTokens}, DType::kI32);
  copy_from_host(b.tokens, ids.data(), ids.size() * sizeof(int32_t));
  copy_from_host(b.in.targets, ids.data(), ids.size() * sizeof(int32_t));
  b.in.loss_scale = 1.0f / kTokens;
  b.in.tokens = kTokens;
  return b;
}

// The message of the std::invalid_argument `run` throws, or "" when it does not.
std::string error_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(StageBoundaries, AWellShapedModelPasses) {
  DeviceContext ctx(Device::cpu());
  Stage stage(model_with(nullptr), 0, 3, ctx, 1);
  const Inputs b = inputs_on(ctx);
  EXPECT_EQ(stage.forward(0, b.tokens, b.in).shape(), (Shape{kTokens}));
  EXPECT_FALSE(stage.backward(0, Tensor()).defined());
  EXPECT_EQ(stage.forward_only(b.tokens, b.in).shape(), (Shape{kTokens}));
}

TEST(StageBoundaries, AUnitReturningAnotherShapeIsNamed) {
  DeviceContext ctx(Device::cpu());
  const Inputs b = inputs_on(ctx);
  Stage wide(misshapen_at(1, [](const Tensor&) { return rows_of(3); }), 0, 3, ctx, 1);
  const std::string expected =
      "model 'misshapen': the output of unit 1 is f32 [6, 3] for a micro-batch of 6 tokens; "
      "expected f32 [6, 4] (the activation entering unit 2)";
  EXPECT_EQ(error_of([&] { wide.forward(0, b.tokens, b.in); }), expected);
  EXPECT_EQ(wide.in_flight(), 0u);  // the failed forward holds nothing for a backward
  EXPECT_EQ(error_of([&] { wide.forward_only(b.tokens, b.in); }), expected);
  // Another dtype of the right shape is no better.
  Stage ints(misshapen_at(1, [](const Tensor&) { return rows_of(4, DType::kI32); }), 0, 3, ctx, 1);
  EXPECT_NE(error_of([&] { ints.forward(0, b.tokens, b.in); }).find("is i32 [6, 4]"),
            std::string::npos);
}

TEST(StageBoundaries, TheLastUnitMustReturnOneLossPerToken) {
  DeviceContext ctx(Device::cpu());
  const Inputs b = inputs_on(ctx);
  Stage stage(misshapen_at(2, [](const Tensor&) { return rows_of(1); }), 0, 3, ctx, 1);
  EXPECT_EQ(error_of([&] { stage.forward(0, b.tokens, b.in); }),
            "model 'misshapen': the output of unit 2 is f32 [6, 1] for a micro-batch of 6 "
            "tokens; expected f32 [6] (the per-token losses of the last unit)");
}

TEST(StageBoundaries, TheStageInputAndTheTokenCountAreChecked) {
  DeviceContext ctx(Device::cpu());
  Inputs b = inputs_on(ctx);
  Stage later(model_with(nullptr), 1, 3, ctx, 1);
  const Tensor too_wide = ctx.empty({kTokens, kWidth + 1});
  EXPECT_NE(error_of([&] {
              later.forward(0, too_wide, b.in);
            }).find("the input of unit 1 is f32 [6, 5] for a micro-batch of 6 tokens"),
            std::string::npos);
  Stage first(model_with(nullptr), 0, 3, ctx, 1);
  EXPECT_NE(error_of([&] {
              first.forward(0, ctx.empty({kTokens}), b.in);
            }).find("is f32 [6] for a micro-batch of 6 tokens; expected i32 [6] (token ids)"),
            std::string::npos);
  b.in.tokens = 0;
  EXPECT_NE(error_of([&] { first.forward(0, b.tokens, b.in); }).find("MicroBatchInputs::tokens"),
            std::string::npos);
  EXPECT_EQ(first.in_flight(), 0u);  // nothing is held for a refused forward
}

TEST(StageBoundaries, GradientsAreCheckedInTheBackward) {
  DeviceContext ctx(Device::cpu());
  const Inputs b = inputs_on(ctx);
  // Unit 1's input gradient is too narrow for the embedding below it.
  Stage stage(misshapen_at(1, nullptr, [](const Tensor&) { return rows_of(2); }), 0, 3, ctx, 1);
  stage.forward(0, b.tokens, b.in);
  EXPECT_EQ(error_of([&] { stage.backward(0, Tensor()); }),
            "model 'misshapen': the input gradient of unit 1 is f32 [6, 2] for a micro-batch of "
            "6 tokens; expected f32 [6, 4] (the activation entering unit 1)");
  // A gradient handed to a stage that is not the last is checked before any unit runs.
  Stage front(model_with(nullptr), 0, 2, ctx, 1);
  front.forward(0, b.tokens, b.in);
  EXPECT_NE(error_of([&] {
              front.backward(0, ctx.empty({kTokens, 3}));
            }).find("the output gradient given to unit 1 is f32 [6, 3]"),
            std::string::npos);
}

}  // namespace
}  // namespace conveyor
