#include "kernels/cuda_check.h"
#include "kernels/elementwise.h"

namespace conveyor::kernels::cuda {
namespace {

__global__ void add_inplace_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

}  // namespace

void add_inplace(const CudaContext& ctx, float* y, const float* x, int64_t n) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < 65535 * 8 ? blocks : 65535 * 8);
  add_inplace_kernel<<<grid, kThreads, 0, ctx.stream>>>(y, x, n);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda
