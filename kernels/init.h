#pragma once
// Counter-based random initialisation (Philox-4x32-10). Element i of a tensor depends only
// on (seed, key, i), where key is a hash of the parameter's global name, so CPU and CUDA
// produce bit-identical weights, and any stage layout produces the same model.
// Only exactly-rounded float operations are used after the integer generator (no
// transcendental functions, no FMA contraction), which is what makes the bits match.
//
// The exact recipe, shared by both backends, for element i:
//   words = philox4x32_10(c0 = low32(i / 4), c1 = high32(i / 4),
//                         c2 = low32(seed),  c3 = high32(seed),
//                         k0 = low32(key),   k1 = high32(key))
//   w = words.v[i % 4];  u = float(w >> 8) * 2^-24          (exact, in [0, 1))
//   out[i] = low + (high - low) * u   rounded as: range = high - low (one rounding),
//            t = range * u (one rounding), out = low + t (one rounding); no FMA
//            (CUDA: __fsub_rn / __fmul_rn / __fadd_rn).
// Range: for [-a, a) and [0, a) the result is always < high (t < range, and -a + t is exact
// by Sterbenz when t >= a). For other bounds the last rounding can give exactly `high`, with
// probability about 2^-24 per element; callers that need a strict bound use such bounds.
// kernels/philox.h holds this recipe as inline __host__ __device__ code for both backends.
#include <cstdint>
#include <string_view>

#include "kernels/cuda_context.h"

namespace conveyor::kernels {

// 64-bit key of a parameter name (xxHash64 of the UTF-8 bytes).
uint64_t parameter_key(std::string_view name);

// The Philox-4x32-10 block for (counter, key): four 32-bit outputs.
struct Philox4 {
  uint32_t v[4];
};
Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1);

}  // namespace conveyor::kernels

namespace conveyor::kernels::cpu {

// out[i] = low + (high - low) * u_i, u_i uniform in [0, 1) with 24 random bits.
void init_uniform(float* out, int64_t n, uint64_t seed, uint64_t key, float low, float high);
void fill(float* out, int64_t n, float value);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void init_uniform(const CudaContext& ctx, float* out, int64_t n, uint64_t seed, uint64_t key,
                  float low, float high);
void fill(const CudaContext& ctx, float* out, int64_t n, float value);  // in elementwise.cu

}  // namespace conveyor::kernels::cuda
#endif
