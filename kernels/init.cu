// Counter-based initialisation on CUDA, following the exact recipe in init.h so that the
// bits match the CPU: the kernel runs the very functions of philox.h that the CPU runs (one
// Philox-4x32-10 block per group of four elements, then low + (high - low) * u rounded three
// times, never contracted into an FMA), so the two backends cannot drift apart.
#include "kernels/cuda_util.cuh"
#include "kernels/init.h"
#include "kernels/philox.h"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kBlock = 256;

// Thread g produces elements 4g .. 4g+3 from the Philox block with counter g.
__global__ void init_uniform_kernel(float* __restrict__ out, int64_t n, uint64_t seed, uint64_t key,
                                    float low, float high, bool vec) {
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const philox::Block w = philox::init_block(static_cast<uint64_t>(g), seed, key);
    const int64_t i = 4 * g;
    if (vec && i + 3 < n) {
      reinterpret_cast<float4*>(out)[g] = make_float4(philox::uniform_from_word(w.v[0], low, high),
                                                      philox::uniform_from_word(w.v[1], low, high),
                                                      philox::uniform_from_word(w.v[2], low, high),
                                                      philox::uniform_from_word(w.v[3], low, high));
    } else {
      for (int j = 0; j < 4 && i + j < n; ++j)
        out[i + j] = philox::uniform_from_word(w.v[j], low, high);
    }
  }
}

}  // namespace

void init_uniform(const CudaContext& ctx, float* out, int64_t n, uint64_t seed, uint64_t key,
                  float low, float high) {
  detail::require_nonnegative("init_uniform", "n", n);
  detail::require(low < high, "init_uniform: need low < high, got low " + std::to_string(low) +
                                  ", high " + std::to_string(high));
  if (n == 0) return;
  const bool vec = detail::aligned16(out);
  init_uniform_kernel<<<detail::grid_for((n + 3) / 4, kBlock), kBlock, 0, ctx.stream>>>(
      out, n, seed, key, low, high, vec);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda
