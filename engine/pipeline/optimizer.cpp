#include "engine/pipeline/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "engine/core/number_text.h"
#include "engine/schedule/input_file.h"
#include "layers/ops.h"

namespace conveyor {

namespace {

// The kernels read the settings as floats: a double that the conversion turns into 0, 1 or
// infinity passes a check on the double and then divides by zero or trains nothing.
bool float_is_finite(double v) { return std::isfinite(static_cast<float>(v)); }

}  // namespace

void OptimizerConfig::validate(std::string_view prefix) const {
  const std::string name(prefix);
  auto fail = [&](const std::string& field, double got, const std::string& expected) {
    throw std::invalid_argument(name + field + " must be " + expected + ", got " +
                                number_text(got));
  };
  if (kind != "adamw" && kind != "sgd")
    throw std::invalid_argument(name + "kind must be adamw or sgd, got '" +
                                escaped_for_message(kind) + "'");
  if (!(lr > 0.0) || !float_is_finite(lr) || !(static_cast<float>(lr) > 0.0f))
    fail("lr", lr, "a number above 0 that a float holds (from about 1e-45 to 3.4e+38)");
  if (!(min_lr >= 0.0) || min_lr > lr)
    fail("min_lr", min_lr, "in [0, lr] (lr " + number_text(lr) + ")");
  if (warmup_steps < 0)
    throw std::invalid_argument(name + "warmup_steps must be at least 0, got " +
                                std::to_string(warmup_steps));
  // A beta that a float rounds to 1 makes AdamW's bias correction 1 - beta^t zero: 0/0.
  for (const auto& [field, beta] : {std::pair{"beta1", beta1}, std::pair{"beta2", beta2}})
    if (!(beta >= 0.0) || !(static_cast<float>(beta) < 1.0f))
      fail(field, beta, "in [0, 1) as a float (at most 0.99999994)");
  // An eps that a float rounds to 0 divides a weight whose gradient is 0 by 0; an infinite
  // one makes every update 0.
  if (!(eps > 0.0) || !float_is_finite(eps) || !(static_cast<float>(eps) > 0.0f))
    fail("eps", eps, "a number above 0 that a float holds (from about 1e-45 to 3.4e+38)");
  if (!(momentum >= 0.0) || !(static_cast<float>(momentum) < 1.0f))
    fail("momentum", momentum, "in [0, 1) as a float (at most 0.99999994)");
  if (!(weight_decay >= 0.0) || !float_is_finite(weight_decay))
    fail("weight_decay", weight_decay, "a finite number of at least 0");
  // A negative norm would silently mean "off"; only 0 says that.
  if (!(clip_norm >= 0.0) || !std::isfinite(clip_norm))
    fail("clip_norm", clip_norm, "a finite number of at least 0 (0 disables clipping)");
  // Both optimizers decay as p -= lr * weight_decay * p: from a product of 1 on, a step zeroes
  // every decayed weight or flips its sign, which trains nothing.
  if (lr * weight_decay >= 1.0) {
    std::ostringstream why;
    why << "lr x weight decay is " << lr * weight_decay << " (" << name << "lr " << lr << ", "
        << name << "weight_decay " << weight_decay
        << "): each step multiplies every decayed weight by 1 - lr x weight decay, which zeroes "
           "or flips the weights from a product of 1 on; the product must be below 1";
    throw std::invalid_argument(why.str());
  }
}

double learning_rate(const OptimizerConfig& c, int64_t step, int64_t total_steps) {
  if (step < 0 || total_steps < 0)
    throw std::invalid_argument(
        "learning_rate: the step and the total steps must be at least 0, "
        "got step " +
        std::to_string(step) + " of " + std::to_string(total_steps));
  if (c.warmup_steps > 0 && step <= c.warmup_steps)
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - c.warmup_steps);
  const double progress =
      std::clamp(static_cast<double>(step - c.warmup_steps) / decay_steps, 0.0, 1.0);
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

ParameterShard replica_piece(int64_t numel, int replica, int replicas) {
  const int64_t begin = numel * replica / replicas, end = numel * (replica + 1) / replicas;
  return {begin, end - begin};
}

float clip_scale(const OptimizerConfig& c, double norm) {
  if (c.clip_norm == 0.0 || !(norm > c.clip_norm)) return 1.0f;
  return static_cast<float>(c.clip_norm / norm);
}

Optimizer::Optimizer(DeviceContext& ctx, std::vector<Parameter*> params, OptimizerConfig config,
                     std::vector<ParameterShard> shards)
    : ctx_(ctx),
      params_(std::move(params)),
      config_(std::move(config)),
      shards_(std::move(shards)) {
  config_.validate();
  if (!shards_.empty() && shards_.size() != params_.size())
    throw std::invalid_argument("optimizer: " + std::to_string(shards_.size()) + " shards for " +
                                std::to_string(params_.size()) + " parameters; give one each");
  for (size_t i = 0; i < shards_.size(); ++i)
    if (shards_[i].offset < 0 || shards_[i].count < 0 ||
        shards_[i].offset + shards_[i].count > params_[i]->value.numel())
      throw std::invalid_argument("optimizer: the shard [" + std::to_string(shards_[i].offset) +
                                  ", +" + std::to_string(shards_[i].count) + ") lies outside " +
                                  params_[i]->name + " of " +
                                  std::to_string(params_[i]->value.numel()) + " elements");
  const int per_param = config_.kind == "adamw" ? 2 : 1;
  for (size_t i = 0; i < params_.size(); ++i)
    for (int k = 0; k < per_param; ++k)
      state_.push_back(shards_.empty() ? ctx_.zeros(params_[i]->shape)
                                       : ctx_.zeros({shards_[i].count}));
}

void Optimizer::step(int64_t step, double lr, float grad_scale) {
  std::vector<kernels::OptimizerTensor> tensors;
  const bool adamw = config_.kind == "adamw";
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* p = params_[i];
    const int64_t offset = shards_.empty() ? 0 : shards_[i].offset;
    const int64_t n = shards_.empty() ? p->value.numel() : shards_[i].count;
    if (n == 0) continue;  // all of it is another replica's
    kernels::OptimizerTensor t;
    t.param = p->value.data<float>() + offset;
    t.grad = p->grad.data<float>() + offset;
    t.state0 = state_[adamw ? 2 * i : i].data<float>();
    t.state1 = adamw ? state_[2 * i + 1].data<float>() : nullptr;
    t.n = n;
    t.decay = p->weight_decay;
    tensors.push_back(t);
  }
  if (adamw) {
    kernels::AdamWParams h;
    h.lr = static_cast<float>(lr);
    h.beta1 = static_cast<float>(config_.beta1);
    h.beta2 = static_cast<float>(config_.beta2);
    h.eps = static_cast<float>(config_.eps);
    h.weight_decay = static_cast<float>(config_.weight_decay);
    h.step = step;
    h.grad_scale = grad_scale;
    ops::adamw_update(ctx_, tensors, h);
  } else {
    kernels::SgdParams h;
    h.lr = static_cast<float>(lr);
    h.momentum = static_cast<float>(config_.momentum);
    h.weight_decay = static_cast<float>(config_.weight_decay);
    h.grad_scale = grad_scale;
    ops::sgd_update(ctx_, tensors, h);
  }
  steps_taken_ = step;
}

}  // namespace conveyor
