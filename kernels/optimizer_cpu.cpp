// CPU optimizer updates, element by element in float with per-step scalars (bias
// corrections) computed once in double. Weight decay applies only where `decay` is set.
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/optimizer.h"

namespace conveyor::kernels::cpu {
namespace {

void check_tensor(const char* who, const OptimizerTensor& t, int64_t index, bool needs_state0,
                  bool needs_state1) {
  const std::string where = std::string(who) + ": tensor " + std::to_string(index);
  if (t.n < 0) throw std::invalid_argument(where + " has n = " + std::to_string(t.n) + " < 0");
  if (t.n == 0) return;
  if (t.param == nullptr || t.grad == nullptr)
    throw std::invalid_argument(where + " has a null param or grad pointer");
  if (needs_state0 && t.state0 == nullptr)
    throw std::invalid_argument(where + " has a null state0 (AdamW m / SGD momentum buffer)");
  if (needs_state1 && t.state1 == nullptr)
    throw std::invalid_argument(where + " has a null state1 (AdamW second moment v)");
}

}  // namespace

void adamw_update(const OptimizerTensor* tensors, int64_t count, const AdamWParams& params) {
  if (params.step < 1)
    throw std::invalid_argument("adamw_update: step is 1-based, got " +
                                std::to_string(params.step));
  for (int64_t k = 0; k < count; ++k) check_tensor("adamw_update", tensors[k], k, true, true);

  const float b1 = params.beta1;
  const float b2 = params.beta2;
  const float one_minus_b1 = 1.0f - b1;
  const float one_minus_b2 = 1.0f - b2;
  const double t = static_cast<double>(params.step);
  const float bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const float bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
  const float lr = params.lr;
  const float eps = params.eps;
  const float gs = params.grad_scale;

  for (int64_t k = 0; k < count; ++k) {
    const OptimizerTensor& ts = tensors[k];
    const float wd = ts.decay ? params.weight_decay : 0.0f;
    for (int64_t i = 0; i < ts.n; ++i) {
      const float g = ts.grad[i] * gs;
      const float m = b1 * ts.state0[i] + one_minus_b1 * g;
      const float v = b2 * ts.state1[i] + one_minus_b2 * (g * g);
      ts.state0[i] = m;
      ts.state1[i] = v;
      const float m_hat = m / bias1;
      const float v_hat = v / bias2;
      const float p = ts.param[i];
      ts.param[i] = p - lr * (m_hat / (std::sqrt(v_hat) + eps) + wd * p);
    }
  }
}

void sgd_update(const OptimizerTensor* tensors, int64_t count, const SgdParams& params) {
  // With zero momentum the buffer equals the gradient, so it may be absent.
  const bool needs_buffer = params.momentum != 0.0f;
  for (int64_t k = 0; k < count; ++k)
    check_tensor("sgd_update", tensors[k], k, needs_buffer, false);

  const float mu = params.momentum;
  const float lr = params.lr;
  const float gs = params.grad_scale;
  for (int64_t k = 0; k < count; ++k) {
    const OptimizerTensor& ts = tensors[k];
    const float wd = ts.decay ? params.weight_decay : 0.0f;
    for (int64_t i = 0; i < ts.n; ++i) {
      const float g = ts.grad[i] * gs;
      float buf = g;
      if (ts.state0 != nullptr) {
        buf = mu * ts.state0[i] + g;
        ts.state0[i] = buf;
      }
      const float p = ts.param[i];
      ts.param[i] = p - lr * (buf + wd * p);
    }
  }
}

}  // namespace conveyor::kernels::cpu
