#pragma once
// Optimizer updates fused over many tensors in one launch.
// AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments:
//   g = grad * grad_scale
//   m = β1 m + (1-β1) g;  v = β2 v + (1-β2) g²
//   p -= lr * ( (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps) + weight_decay * p )
// (weight decay applies only to tensors with `decay` set).
// SGD with momentum: buf = μ buf + g;  p -= lr * (buf + weight_decay * p).
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels {

struct OptimizerTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* state0 = nullptr;  // AdamW: first moment m;  SGD: momentum buffer
  float* state1 = nullptr;  // AdamW: second moment v; SGD: unused (may be null)
  int64_t n = 0;
  bool decay = true;
};

struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;         // 1-based step count t, for bias correction
  float grad_scale = 1.0f;  // clipping factor applied to gradients
};

struct SgdParams {
  float lr = 1e-2f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  float grad_scale = 1.0f;
};

}  // namespace conveyor::kernels

namespace conveyor::kernels::cpu {

void adamw_update(const OptimizerTensor* tensors, int64_t count, const AdamWParams& params);
void sgd_update(const OptimizerTensor* tensors, int64_t count, const SgdParams& params);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

// `tensors` lives in host memory; the launcher packs the descriptors for the device.
void adamw_update(const CudaContext& ctx, const OptimizerTensor* tensors, int64_t count,
                  const AdamWParams& params);
void sgd_update(const CudaContext& ctx, const OptimizerTensor* tensors, int64_t count,
                const SgdParams& params);

}  // namespace conveyor::kernels::cuda
#endif
