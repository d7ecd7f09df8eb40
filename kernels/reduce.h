#pragma once
// Deterministic reductions: fixed blocking and a fixed combine order, no floating-point
// atomics, so the same input gives the same bits on every run.
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

// Σ x[i], accumulated in double.
double sum(const float* x, int64_t n);
// Σ x[i]², accumulated in double (gradient norms).
double sum_squares(const float* x, int64_t n);
// x[i] *= scale
void scale(float* x, float scale, int64_t n);

// The same sums in the form of the CUDA kernels below (result through `out`, here host
// memory), so that one dispatch writes its arguments once for both backends.
inline void sum(double* out, const float* x, int64_t n) { *out = sum(x, n); }
inline void sum_squares(double* out, const float* x, int64_t n) { *out = sum_squares(x, n); }

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

// Scratch of at least reduce_scratch_bytes(n) bytes of device memory is needed.
size_t reduce_scratch_bytes(int64_t n);
// *out (device memory, one double) = Σ x[i]
void sum(const CudaContext& ctx, double* out, const float* x, int64_t n, void* scratch);
// *out (device memory, one double) = Σ x[i]²
void sum_squares(const CudaContext& ctx, double* out, const float* x, int64_t n, void* scratch);
void scale(const CudaContext& ctx, float* x, float scale, int64_t n);  // in elementwise.cu

}  // namespace conveyor::kernels::cuda
#endif
