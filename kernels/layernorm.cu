// LayerNorm on CUDA. y, dx, mean, rstd are written (`=`); dgamma and dbeta accumulate (`+=`).
//
// Forward and backward_input: one warp per row; the row is read once for the mean, once for
// the variance (two-pass, no cancellation) and once to write, the re-reads hit L1/L2.
// backward_weight: a two-stage column reduction with no atomics. Stage 1 gives each block a
// 32-column tile of a fixed chunk of rows and writes one partial per (chunk, column); stage 2
// sums the partials of each column in chunk order and adds them to dgamma/dbeta. The chunking
// depends only on (n, c), so results are bitwise reproducible.
#include "kernels/cuda_util.cuh"
#include "kernels/layernorm.h"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kRowBlock = 256;  // 8 warps = 8 rows per block
constexpr int kWarpsPerBlock = kRowBlock / 32;

template <bool kVec>
__global__ void layernorm_forward_kernel(float* __restrict__ y, float* __restrict__ mean,
                                         float* __restrict__ rstd, const float* __restrict__ x,
                                         const float* __restrict__ gamma,
                                         const float* __restrict__ beta, int64_t n, int c,
                                         float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       row < n; row += warps_total) {
    const float* xr = x + row * c;
    float* yr = y + row * c;
    float s = 0.0f;
    if constexpr (kVec) {
      const float4* x4 = reinterpret_cast<const float4*>(xr);
      for (int j = lane; j < c / 4; j += 32) {
        const float4 v = x4[j];
        s += (v.x + v.y) + (v.z + v.w);
      }
    } else {
      for (int j = lane; j < c; j += 32) s += xr[j];
    }
    const float m = detail::warp_sum(s) / static_cast<float>(c);
    float ss = 0.0f;
    if constexpr (kVec) {
      const float4* x4 = reinterpret_cast<const float4*>(xr);
      for (int j = lane; j < c / 4; j += 32) {
        const float4 v = x4[j];
        const float a = v.x - m, b = v.y - m, d = v.z - m, e = v.w - m;
        ss += (a * a + b * b) + (d * d + e * e);
      }
    } else {
      for (int j = lane; j < c; j += 32) {
        const float a = xr[j] - m;
        ss += a * a;
      }
    }
    const float var = detail::warp_sum(ss) / static_cast<float>(c);
    const float r = 1.0f / sqrtf(var + eps);
    if constexpr (kVec) {
      const float4* x4 = reinterpret_cast<const float4*>(xr);
      const float4* g4 = reinterpret_cast<const float4*>(gamma);
      const float4* b4 = reinterpret_cast<const float4*>(beta);
      float4* y4 = reinterpret_cast<float4*>(yr);
      for (int j = lane; j < c / 4; j += 32) {
        const float4 v = x4[j];
        const float4 g = g4[j];
        const float4 b = b4[j];
        y4[j] = make_float4((v.x - m) * r * g.x + b.x, (v.y - m) * r * g.y + b.y,
                            (v.z - m) * r * g.z + b.z, (v.w - m) * r * g.w + b.w);
      }
    } else {
      for (int j = lane; j < c; j += 32) yr[j] = (xr[j] - m) * r * gamma[j] + beta[j];
    }
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
  }
}

// dx = rstd * (dy·γ - mean(dy·γ) - x̂ · mean(dy·γ·x̂)). No __restrict__ on dx/dy: they may
// alias (every element is read and written by the same lane).
template <bool kVec>
__global__ void layernorm_backward_input_kernel(float* dx, const float* dy,
                                                const float* __restrict__ x,
                                                const float* __restrict__ mean,
                                                const float* __restrict__ rstd,
                                                const float* __restrict__ gamma, int64_t n, int c) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       row < n; row += warps_total) {
    const float* xr = x + row * c;
    const float* dyr = dy + row * c;
    float* dxr = dx + row * c;
    const float m = mean[row];
    const float r = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
    if constexpr (kVec) {
      const float4* x4 = reinterpret_cast<const float4*>(xr);
      const float4* d4 = reinterpret_cast<const float4*>(dyr);
      const float4* g4 = reinterpret_cast<const float4*>(gamma);
      for (int j = lane; j < c / 4; j += 32) {
        const float4 v = x4[j], d = d4[j], g = g4[j];
        const float a = d.x * g.x, b = d.y * g.y, e = d.z * g.z, f = d.w * g.w;
        s1 += (a + b) + (e + f);
        s2 += (a * ((v.x - m) * r) + b * ((v.y - m) * r)) +
              (e * ((v.z - m) * r) + f * ((v.w - m) * r));
      }
    } else {
      for (int j = lane; j < c; j += 32) {
        const float a = dyr[j] * gamma[j];
        s1 += a;
        s2 += a * ((xr[j] - m) * r);
      }
    }
    const float mean1 = detail::warp_sum(s1) / static_cast<float>(c);
    const float mean2 = detail::warp_sum(s2) / static_cast<float>(c);
    if constexpr (kVec) {
      const float4* x4 = reinterpret_cast<const float4*>(xr);
      const float4* d4 = reinterpret_cast<const float4*>(dyr);
      const float4* g4 = reinterpret_cast<const float4*>(gamma);
      float4* o4 = reinterpret_cast<float4*>(dxr);
      for (int j = lane; j < c / 4; j += 32) {
        const float4 v = x4[j], d = d4[j], g = g4[j];
        o4[j] = make_float4(r * (d.x * g.x - mean1 - (v.x - m) * r * mean2),
                            r * (d.y * g.y - mean1 - (v.y - m) * r * mean2),
                            r * (d.z * g.z - mean1 - (v.z - m) * r * mean2),
                            r * (d.w * g.w - mean1 - (v.w - m) * r * mean2));
      }
    } else {
      for (int j = lane; j < c; j += 32) {
        const float xhat = (xr[j] - m) * r;
        dxr[j] = r * (dyr[j] * gamma[j] - mean1 - xhat * mean2);
      }
    }
  }
}

constexpr int kTileCols = 32;
constexpr int kTileRows = 8;

// Stage 1: block (32, 8) covers columns [32·bx, 32·bx + 32) of row chunk `by`.
__global__ void layernorm_weight_partials_kernel(
    float* __restrict__ partial_g, float* __restrict__ partial_b, const float* __restrict__ dy,
    const float* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ rstd,
    int64_t n, int c, int64_t rows_per_chunk) {
  __shared__ float sg[kTileRows][kTileCols + 1];
  __shared__ float sb[kTileRows][kTileCols + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * kTileCols + tx;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(n, r0 + rows_per_chunk);
  float g = 0.0f, b = 0.0f;
  if (col < c) {
    for (int64_t row = r0 + ty; row < r1; row += kTileRows) {
      const float d = dy[row * c + col];
      const float xhat = (x[row * c + col] - mean[row]) * rstd[row];
      g += d * xhat;
      b += d;
    }
  }
  sg[ty][tx] = g;
  sb[ty][tx] = b;
  __syncthreads();
  if (col < c && ty < 2) {
    float acc = 0.0f;
    if (ty == 0) {
      for (int k = 0; k < kTileRows; ++k) acc += sg[k][tx];
      partial_g[static_cast<int64_t>(blockIdx.y) * c + col] = acc;
    } else {
      for (int k = 0; k < kTileRows; ++k) acc += sb[k][tx];
      partial_b[static_cast<int64_t>(blockIdx.y) * c + col] = acc;
    }
  }
}

// Stage 2: one thread per column sums the chunk partials in chunk order.
__global__ void layernorm_weight_final_kernel(float* __restrict__ dgamma, float* __restrict__ dbeta,
                                              const float* __restrict__ partial_g,
                                              const float* __restrict__ partial_b, int c,
                                              int chunks) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= c) return;
  float g = 0.0f, b = 0.0f;
  for (int k = 0; k < chunks; ++k) {
    g += partial_g[static_cast<int64_t>(k) * c + col];
    b += partial_b[static_cast<int64_t>(k) * c + col];
  }
  dgamma[col] += g;
  dbeta[col] += b;
}

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
  // Chunks fill about four waves of an H200; a chunk keeps at least 8 rows per thread row.
  const int64_t col_tiles = (c + kTileCols - 1) / kTileCols;
  int64_t chunks = (4 * detail::kFixedSmCount + col_tiles - 1) / col_tiles;
  chunks = std::min<int64_t>(chunks, (n + 8 * kTileRows - 1) / (8 * kTileRows));
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per_chunk = (n + chunks - 1) / chunks;
  chunks = (n + rows_per_chunk - 1) / rows_per_chunk;  // no empty trailing chunk
  detail::require(col_tiles <= 0x7fffffff, "layernorm_backward_weight: c too large");
  detail::StreamScratch scratch(ctx, static_cast<size_t>(2 * chunks * c) * sizeof(float));
  float* partial_g = scratch.as<float>();
  float* partial_b = partial_g + chunks * c;
  const dim3 grid1(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks));
  layernorm_weight_partials_kernel<<<grid1, dim3(kTileCols, kTileRows), 0, ctx.stream>>>(
      partial_g, partial_b, dy, x, mean, rstd, n, static_cast<int>(c), rows_per_chunk);
  CONVEYOR_CUDA_CHECK_LAUNCH();
  const unsigned grid2 = static_cast<unsigned>((c + 255) / 256);
  layernorm_weight_final_kernel<<<grid2, 256, 0, ctx.stream>>>(
      dgamma, dbeta, partial_g, partial_b, static_cast<int>(c), static_cast<int>(chunks));
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda
