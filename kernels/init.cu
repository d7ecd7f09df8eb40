// Counter-based initialisation on CUDA, following the exact recipe in init.h so that the
// bits match the CPU: one Philox-4x32-10 block per group of four elements, 24 random bits per
// element, then range = high - low, t = range * u, out = low + t, each rounded once
// (__fsub_rn / __fmul_rn / __fadd_rn are never contracted into an FMA).
#include "kernels/cuda_util.cuh"
#include "kernels/init.h"
#include "kernels/philox.cuh"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kBlock = 256;

__device__ __forceinline__ float uniform_value(uint32_t word, float low, float range) {
  const float u = __fmul_rn(__uint2float_rn(word >> 8), 5.9604644775390625e-8f);  // 2^-24, exact
  return __fadd_rn(low, __fmul_rn(range, u));
}

// Thread g produces elements 4g .. 4g+3 from the Philox block with counter g.
__global__ void init_uniform_kernel(float* __restrict__ out, int64_t n, uint32_t seed_lo,
                                    uint32_t seed_hi, uint32_t key_lo, uint32_t key_hi, float low,
                                    float high, bool vec) {
  const float range = __fsub_rn(high, low);
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const uint64_t counter = static_cast<uint64_t>(g);
    const detail::PhiloxWords w =
        detail::philox4x32_10(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                              seed_lo, seed_hi, key_lo, key_hi);
    const int64_t i = 4 * g;
    if (vec && i + 3 < n) {
      reinterpret_cast<float4*>(out)[g] =
          make_float4(uniform_value(w.v[0], low, range), uniform_value(w.v[1], low, range),
                      uniform_value(w.v[2], low, range), uniform_value(w.v[3], low, range));
    } else {
      for (int j = 0; j < 4 && i + j < n; ++j) out[i + j] = uniform_value(w.v[j], low, range);
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
      out, n, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
      static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), low, high, vec);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda
