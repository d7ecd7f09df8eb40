#pragma once
// Element-wise arithmetic the layers need around the kernels (residual connections).
// elementwise.cu also holds the CUDA side of the other element-wise kernels (activations,
// scale, fill), which are declared with their families.
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

// y[i] += x[i]
void add_inplace(float* y, const float* x, int64_t n);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void add_inplace(const CudaContext& ctx, float* y, const float* x, int64_t n);

}  // namespace conveyor::kernels::cuda
#endif
