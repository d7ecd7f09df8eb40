#pragma once
// Element-wise activations over n floats: GELU (tanh approximation) and ReLU.
// Backward writes dx with `=` (activations are not accumulated) and may alias dy.
// CPU: activation_cpu.cpp; CUDA: elementwise.cu, with the other element-wise kernels.
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

class ThreadPool;

// `pool` (may be null: one thread) runs fixed blocks of elements.
void gelu_forward(float* y, const float* x, int64_t n, ThreadPool* pool = nullptr);
void gelu_backward(float* dx, const float* dy, const float* x, int64_t n,
                   ThreadPool* pool = nullptr);
void relu_forward(float* y, const float* x, int64_t n, ThreadPool* pool = nullptr);
void relu_backward(float* dx, const float* dy, const float* x, int64_t n,
                   ThreadPool* pool = nullptr);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void gelu_forward(const CudaContext& ctx, float* y, const float* x, int64_t n);
void gelu_backward(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n);
void relu_forward(const CudaContext& ctx, float* y, const float* x, int64_t n);
void relu_backward(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n);

}  // namespace conveyor::kernels::cuda
#endif
