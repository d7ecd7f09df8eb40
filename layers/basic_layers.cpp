#include "layers/basic_layers.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/core/enum_value.h"
#include "engine/core/number_text.h"

namespace conveyor {
namespace {

Parameter make_parameter(const std::string& name, Shape shape, InitSpec init, bool decay) {
  Parameter p;
  p.name = name;
  p.shape = std::move(shape);
  p.init = init;
  p.weight_decay = decay;
  return p;
}

// A layer's size, refused below 1 as the layer is made: an empty or negative shape would
// fail later, in a kernel or an allocation, without naming the layer.
void check_size(const std::string& layer, const char* size, int64_t value) {
  if (value < 1)
    throw std::invalid_argument(layer + ": " + size + " must be at least 1, got " +
                                std::to_string(value));
}

// Slots in SavedTensors.
enum Slot : size_t { kInput = 0, kOutputGrad = 1, kMean = 2, kRstd = 3 };

}  // namespace

Linear::Linear(std::string name, int64_t in, int64_t out, bool bias)
    : name_(std::move(name)), in_(in), out_(out), has_bias_(bias) {
  check_size("Linear '" + name_ + "'", "in (its input width)", in);
  check_size("Linear '" + name_ + "'", "out (its output width)", out);
  const float bound = 1.0f / std::sqrt(static_cast<float>(in));
  weight_ = make_parameter(name_ + ".weight", {out, in}, InitSpec::uniform(bound), true);
  if (has_bias_) bias_ = make_parameter(name_ + ".bias", {out}, InitSpec::uniform(bound), false);
}

std::vector<Parameter*> Linear::parameters() {
  if (has_bias_) return {&weight_, &bias_};
  return {&weight_};
}

Tensor Linear::forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs&,
                       SavedTensors& saved) {
  Tensor y = ctx.empty({x.dim(0), out_});
  ops::linear_forward(ctx, y, x, weight_.value, has_bias_ ? bias_.value : Tensor());
  saved[kInput] = x;
  return y;
}

Tensor Linear::backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) {
  Tensor dx = ctx.empty({dy.dim(0), in_});
  ops::linear_backward_input(ctx, dx, dy, weight_.value);
  saved[kOutputGrad] = dy;
  return dx;
}

void Linear::backward_weight(DeviceContext& ctx, SavedTensors& saved) {
  ops::linear_backward_weight(ctx, weight_.grad, has_bias_ ? bias_.grad : Tensor(),
                              saved[kOutputGrad], saved[kInput]);
  saved.clear();
}

std::optional<ActivationMemory> Linear::activation_memory(const Shape& input) const {
  const int64_t n = input.front();
  const double x = allocated_bytes({n, in_}), y = allocated_bytes({n, out_});
  ActivationMemory m;
  m.saved = x;           // the input, for the weight gradient
  m.weight_pending = y;  // the output gradient, likewise
  m.workspace = y + x;   // forward: the output; input gradient: dy and dx
  return m;
}

Activation::Activation(std::string name, ops::ActivationKind kind)
    : name_(std::move(name)), kind_(kind) {
  // Refused when the model is built, not at its first forward; the name says which layer.
  check_enum_value(kind, {ops::ActivationKind::kGelu, ops::ActivationKind::kRelu},
                   "Activation '" + name_ + "': kind", "ops::ActivationKind::kGelu or kRelu");
}

Tensor Activation::forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs&,
                           SavedTensors& saved) {
  Tensor y = ctx.empty(x.shape());
  ops::activation_forward(ctx, kind_, y, x);
  saved[kInput] = x;
  return y;
}

Tensor Activation::backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) {
  Tensor dx = ctx.empty(dy.shape());
  ops::activation_backward(ctx, kind_, dx, dy, saved[kInput]);
  saved.clear();  // nothing left for the weight half
  return dx;
}

std::optional<ActivationMemory> Activation::activation_memory(const Shape& input) const {
  const double x = allocated_bytes(input);
  ActivationMemory m;
  m.saved = x;  // the input; released by the input gradient, nothing kept for the weight half
  m.workspace = 2 * x;  // forward: the output; input gradient: dy and dx, before the input goes
  return m;
}

LayerNorm::LayerNorm(std::string name, int64_t width, float eps)
    : name_(std::move(name)), width_(width), eps_(eps) {
  check_size("LayerNorm '" + name_ + "'", "width", width);
  // A negative or NaN epsilon gives NaN rows; an infinite one rows of 0 that learn nothing.
  if (!(eps > 0.0f) || !std::isfinite(eps))
    throw std::invalid_argument("LayerNorm '" + name_ +
                                "': eps must be a finite number above 0, got " + number_text(eps));
  gamma_ = make_parameter(name_ + ".weight", {width}, InitSpec::constant(1.0f), false);
  beta_ = make_parameter(name_ + ".bias", {width}, InitSpec::constant(0.0f), false);
}

Tensor LayerNorm::forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs&,
                          SavedTensors& saved) {
  const int64_t n = x.dim(0);
  Tensor y = ctx.empty({n, width_});
  Tensor mean = ctx.empty({n});
  Tensor rstd = ctx.empty({n});
  ops::layernorm_forward(ctx, y, mean, rstd, x, gamma_.value, beta_.value, eps_);
  saved[kInput] = x;
  saved[kMean] = mean;
  saved[kRstd] = rstd;
  return y;
}

Tensor LayerNorm::backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) {
  Tensor dx = ctx.empty(dy.shape());
  ops::layernorm_backward_input(ctx, dx, dy, saved[kInput], saved[kMean], saved[kRstd],
                                gamma_.value);
  saved[kOutputGrad] = dy;
  return dx;
}

void LayerNorm::backward_weight(DeviceContext& ctx, SavedTensors& saved) {
  ops::layernorm_backward_weight(ctx, gamma_.grad, beta_.grad, saved[kOutputGrad], saved[kInput],
                                 saved[kMean], saved[kRstd]);
  saved.clear();
}

std::optional<ActivationMemory> LayerNorm::activation_memory(const Shape& input) const {
  const int64_t n = input.front();
  const double x = allocated_bytes({n, width_}), row_stat = allocated_bytes({n});
  ActivationMemory m;
  m.saved = x + 2 * row_stat;  // the input, mean and rstd
  m.weight_pending = x;        // the output gradient
  m.workspace = 2 * x;         // forward: the output; input gradient: dy and dx
  return m;
}

Embedding::Embedding(std::string name, int64_t vocab, int64_t width)
    : name_(std::move(name)), vocab_(vocab), width_(width) {
  check_size("Embedding '" + name_ + "'", "vocab", vocab);
  check_size("Embedding '" + name_ + "'", "width", width);
  // U(-a, a) has standard deviation a/√3: a = 0.02·√3 gives std 0.02.
  table_ = make_parameter(name_ + ".weight", {vocab, width},
                          InitSpec::uniform(0.02f * std::sqrt(3.0f)), true);
}

Tensor Embedding::forward(DeviceContext& ctx, const Tensor& tokens, const MicroBatchInputs&,
                          SavedTensors& saved) {
  Tensor y = ctx.empty({tokens.numel(), width_});
  ops::embedding_forward(ctx, y, tokens, table_.value);
  saved[kInput] = tokens;
  return y;
}

Tensor Embedding::backward_input(DeviceContext&, const Tensor& dy, SavedTensors& saved) {
  saved[kOutputGrad] = dy;
  return Tensor();
}

void Embedding::backward_weight(DeviceContext& ctx, SavedTensors& saved) {
  ops::embedding_backward(ctx, table_.grad, saved[kOutputGrad], saved[kInput]);
  saved.clear();
}

std::optional<ActivationMemory> Embedding::activation_memory(const Shape& input) const {
  const double y = allocated_bytes({input.front(), width_});
  ActivationMemory m;
  m.weight_pending = y;  // the output gradient, for the table's gradient
  m.workspace = y;       // forward: the output; input gradient: dy
  return m;
}

}  // namespace conveyor
