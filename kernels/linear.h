#pragma once
// Linear layer: y = x·Wᵀ + b, with x [n, in], W [out, in] (row-major), b [out], y [n, out].
// Gradient convention: activations (y, dx) are written with `=`, parameter gradients
// (dW, db) accumulate with `+=` so several micro-batches sum into one gradient.
// The input gradient and the weight gradient are separate calls so that a schedule can
// run them at different times (zero-bubble I/W split).
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

class ThreadPool;

// `pool` (may be null: one thread) runs the output tiles; the bits do not depend on it.

// y = x·Wᵀ + b; `bias` may be null.
void linear_forward(float* y, const float* x, const float* weight, const float* bias, int64_t n,
                    int64_t in, int64_t out, ThreadPool* pool = nullptr);
// dx = dy·W
void linear_backward_input(float* dx, const float* dy, const float* weight, int64_t n, int64_t in,
                           int64_t out, ThreadPool* pool = nullptr);
// dW += dyᵀ·x, db += Σ_rows dy; `dbias` may be null.
void linear_backward_weight(float* dweight, float* dbias, const float* dy, const float* x,
                            int64_t n, int64_t in, int64_t out, ThreadPool* pool = nullptr);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void linear_forward(const CudaContext& ctx, float* y, const float* x, const float* weight,
                    const float* bias, int64_t n, int64_t in, int64_t out);
void linear_backward_input(const CudaContext& ctx, float* dx, const float* dy, const float* weight,
                           int64_t n, int64_t in, int64_t out);
void linear_backward_weight(const CudaContext& ctx, float* dweight, float* dbias, const float* dy,
                            const float* x, int64_t n, int64_t in, int64_t out);

}  // namespace conveyor::kernels::cuda
#endif
