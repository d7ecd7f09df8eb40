#pragma once
// LayerNorm over the last dimension: x [n, c] -> y [n, c], with per-row mean and rstd saved
// for backward. dx is written (`=`); dgamma and dbeta accumulate (`+=`). Reductions run in a
// fixed order (no floating-point atomics), so results are bitwise reproducible.
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

class ThreadPool;

// `pool` (may be null: one thread) runs blocks of rows (columns for the weight gradient);
// the bits do not depend on it.
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* gamma,
                       const float* beta, int64_t n, int64_t c, float eps,
                       ThreadPool* pool = nullptr);
void layernorm_backward_input(float* dx, const float* dy, const float* x, const float* mean,
                              const float* rstd, const float* gamma, int64_t n, int64_t c,
                              ThreadPool* pool = nullptr);
void layernorm_backward_weight(float* dgamma, float* dbeta, const float* dy, const float* x,
                               const float* mean, const float* rstd, int64_t n, int64_t c,
                               ThreadPool* pool = nullptr);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void layernorm_forward(const CudaContext& ctx, float* y, float* mean, float* rstd, const float* x,
                       const float* gamma, const float* beta, int64_t n, int64_t c, float eps);
void layernorm_backward_input(const CudaContext& ctx, float* dx, const float* dy, const float* x,
                              const float* mean, const float* rstd, const float* gamma, int64_t n,
                              int64_t c);
void layernorm_backward_weight(const CudaContext& ctx, float* dgamma, float* dbeta, const float* dy,
                               const float* x, const float* mean, const float* rstd, int64_t n,
                               int64_t c);

}  // namespace conveyor::kernels::cuda
#endif
