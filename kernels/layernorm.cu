// LayerNorm on CUDA. y, dx, mean, rstd are written (`=`); dgamma and dbeta accumulate (`+=`).
//
// Forward and backward_input: one warp per row; the row is read once for the mean, once for
// the variance (two-pass, no cancellation) and once to write, the re-reads hit L1/L2. Their
// bits depend on the shapes alone: float4 loads where every row pointer is 16-byte aligned,
// scalar ones elsewhere, in the same order of additions.
// backward_weight: the deterministic two-stage column sums of column_sum.cuh (no atomics; the
// partition depends only on (n, c)), so results are bitwise reproducible.
#include "kernels/column_sum.cuh"
#include "kernels/cuda_util.cuh"
#include "kernels/layernorm.h"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kRowBlock = 256;  // 8 warps = 8 rows per block
constexpr int kWarpsPerBlock = kRowBlock / 32;

// A warp reads its row in groups of four elements (lane l takes groups l, l + 32, ...), then
// the row's c % 4 last elements one a lane, with vector loads (kVec) or scalar ones
// (detail::load4): the order of a row's sums depends on c alone, never on alignment.
__device__ __forceinline__ float normalized(float x, float m, float r, float g, float b) {
  return (x - m) * r * g + b;
}

template <bool kVec>
__global__ void layernorm_forward_kernel(float* __restrict__ y, float* __restrict__ mean,
                                         float* __restrict__ rstd, const float* __restrict__ x,
                                         const float* __restrict__ gamma,
                                         const float* __restrict__ beta, int64_t n, int c,
                                         float eps) {
  const int lane = threadIdx.x & 31;
  const int groups = c / 4;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       row < n; row += warps_total) {
    const float* xr = x + row * c;
    float* yr = y + row * c;
    float s = 0.0f;
    for (int j = lane; j < groups; j += 32) {
      const float4 v = detail::load4<kVec>(xr, j);
      s += (v.x + v.y) + (v.z + v.w);
    }
    for (int j = 4 * groups + lane; j < c; j += 32) s += xr[j];
    const float m = detail::warp_sum(s) / static_cast<float>(c);
    float ss = 0.0f;
    for (int j = lane; j < groups; j += 32) {
      const float4 v = detail::load4<kVec>(xr, j);
      const float a = v.x - m, b = v.y - m, d = v.z - m, e = v.w - m;
      ss += (a * a + b * b) + (d * d + e * e);
    }
    for (int j = 4 * groups + lane; j < c; j += 32) {
      const float a = xr[j] - m;
      ss += a * a;
    }
    const float var = detail::warp_sum(ss) / static_cast<float>(c);
    const float r = 1.0f / sqrtf(var + eps);
    for (int j = lane; j < groups; j += 32) {
      const float4 v = detail::load4<kVec>(xr, j);
      const float4 g = detail::load4<kVec>(gamma, j);
      const float4 b = detail::load4<kVec>(beta, j);
      detail::store4<kVec>(
          yr, j,
          make_float4(normalized(v.x, m, r, g.x, b.x), normalized(v.y, m, r, g.y, b.y),
                      normalized(v.z, m, r, g.z, b.z), normalized(v.w, m, r, g.w, b.w)));
    }
    for (int j = 4 * groups + lane; j < c; j += 32)
      yr[j] = normalized(xr[j], m, r, gamma[j], beta[j]);
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
  }
}

// dx = rstd * (dy·γ - mean(dy·γ) - x̂ · mean(dy·γ·x̂)) for one element.
__device__ __forceinline__ float input_grad(float x, float dy, float g, float m, float r,
                                            float mean1, float mean2) {
  return r * (dy * g - mean1 - (x - m) * r * mean2);
}

// Rows read as the forward reads them. No __restrict__ on dx/dy: they may alias (every
// element is read and written by the same lane, its group read whole before it is written).
template <bool kVec>
__global__ void layernorm_backward_input_kernel(float* dx, const float* dy,
                                                const float* __restrict__ x,
                                                const float* __restrict__ mean,
                                                const float* __restrict__ rstd,
                                                const float* __restrict__ gamma, int64_t n, int c) {
  const int lane = threadIdx.x & 31;
  const int groups = c / 4;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       row < n; row += warps_total) {
    const float* xr = x + row * c;
    const float* dyr = dy + row * c;
    float* dxr = dx + row * c;
    const float m = mean[row];
    const float r = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
    for (int j = lane; j < groups; j += 32) {
      const float4 v = detail::load4<kVec>(xr, j), d = detail::load4<kVec>(dyr, j),
                   g = detail::load4<kVec>(gamma, j);
      const float a = d.x * g.x, b = d.y * g.y, e = d.z * g.z, f = d.w * g.w;
      s1 += (a + b) + (e + f);
      s2 +=
          (a * ((v.x - m) * r) + b * ((v.y - m) * r)) + (e * ((v.z - m) * r) + f * ((v.w - m) * r));
    }
    for (int j = 4 * groups + lane; j < c; j += 32) {
      const float a = dyr[j] * gamma[j];
      s1 += a;
      s2 += a * ((xr[j] - m) * r);
    }
    const float mean1 = detail::warp_sum(s1) / static_cast<float>(c);
    const float mean2 = detail::warp_sum(s2) / static_cast<float>(c);
    for (int j = lane; j < groups; j += 32) {
      const float4 v = detail::load4<kVec>(xr, j), d = detail::load4<kVec>(dyr, j),
                   g = detail::load4<kVec>(gamma, j);
      detail::store4<kVec>(dxr, j,
                           make_float4(input_grad(v.x, d.x, g.x, m, r, mean1, mean2),
                                       input_grad(v.y, d.y, g.y, m, r, mean1, mean2),
                                       input_grad(v.z, d.z, g.z, m, r, mean1, mean2),
                                       input_grad(v.w, d.w, g.w, m, r, mean1, mean2)));
    }
    for (int j = 4 * groups + lane; j < c; j += 32)
      dxr[j] = input_grad(xr[j], dyr[j], gamma[j], m, r, mean1, mean2);
  }
}

// dgamma += Σ_rows dy · x̂ and dbeta += Σ_rows dy. Read-only loads, as __restrict__ would allow.
struct WeightGradTerms {
  const float* dy;
  const float* x;
  const float* mean;
  const float* rstd;
  int64_t c;
  __device__ void operator()(float (&acc)[2], int64_t row, int64_t col) const {
    const float d = __ldg(dy + row * c + col);
    const float xhat = (__ldg(x + row * c + col) - __ldg(mean + row)) * __ldg(rstd + row);
    acc[0] += d * xhat;
    acc[1] += d;
  }
};

void check_shape(const char* kernel, int64_t n, int64_t c) {
  detail::require_nonnegative(kernel, "n", n);
  detail::require_at_least(kernel, "c", c, 1);
  detail::require(c <= (int64_t{1} << 30),
                  std::string(kernel) + ": row width c must be <= 2^30, got " + std::to_string(c));
}

}  // namespace

void layernorm_forward(const CudaContext& ctx, float* y, float* mean, float* rstd, const float* x,
                       const float* gamma, const float* beta, int64_t n, int64_t c, float eps) {
  check_shape("layernorm_forward", n, c);
  if (n == 0) return;
  const unsigned grid = detail::grid_for(n, kWarpsPerBlock);
  const bool vec = c % 4 == 0 && detail::aligned16(y) && detail::aligned16(x) &&
                   detail::aligned16(gamma) && detail::aligned16(beta);
  if (vec)
    layernorm_forward_kernel<true><<<grid, kRowBlock, 0, ctx.stream>>>(
        y, mean, rstd, x, gamma, beta, n, static_cast<int>(c), eps);
  else
    layernorm_forward_kernel<false><<<grid, kRowBlock, 0, ctx.stream>>>(
        y, mean, rstd, x, gamma, beta, n, static_cast<int>(c), eps);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

void layernorm_backward_input(const CudaContext& ctx, float* dx, const float* dy, const float* x,
                              const float* mean, const float* rstd, const float* gamma, int64_t n,
                              int64_t c) {
  check_shape("layernorm_backward_input", n, c);
  if (n == 0) return;
  const unsigned grid = detail::grid_for(n, kWarpsPerBlock);
  const bool vec = c % 4 == 0 && detail::aligned16(dx) && detail::aligned16(dy) &&
                   detail::aligned16(x) && detail::aligned16(gamma);
  if (vec)
    layernorm_backward_input_kernel<true>
        <<<grid, kRowBlock, 0, ctx.stream>>>(dx, dy, x, mean, rstd, gamma, n, static_cast<int>(c));
  else
    layernorm_backward_input_kernel<false>
        <<<grid, kRowBlock, 0, ctx.stream>>>(dx, dy, x, mean, rstd, gamma, n, static_cast<int>(c));
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

void layernorm_backward_weight(const CudaContext& ctx, float* dgamma, float* dbeta, const float* dy,
                               const float* x, const float* mean, const float* rstd, int64_t n,
                               int64_t c) {
  check_shape("layernorm_backward_weight", n, c);
  if (n == 0) return;
  detail::accumulate_column_sums<2>(ctx, "layernorm_backward_weight", "c", {{dgamma, dbeta}}, n, c,
                                    WeightGradTerms{dy, x, mean, rstd, c});
}

}  // namespace conveyor::kernels::cuda
