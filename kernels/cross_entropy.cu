// Fused softmax + cross-entropy on CUDA: one block per row.
// Pass 1 keeps an online (max, sum of exp) per thread and combines them in a fixed order
// (warp butterflies, then warp 0), so the row statistics are reproducible. Pass 2 writes
// dlogits = (softmax - onehot) * grad_scale; it may overwrite the logits in place, which is
// safe because the target logit is read before the barrier that precedes pass 2 and every
// other element is read and written by the same thread. Probabilities are never stored.
// A target outside [0, vocab) that is not ignore_index gives a NaN loss (the CPU throws).
#include <cmath>

#include "kernels/cross_entropy.h"
#include "kernels/cuda_util.cuh"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kBlock = 512;

struct MaxSum {
  float m;
  float s;
};

// Sum of exp(x - m) over two partial states; an empty state has m = -inf, s = 0. A state
// that saw only NaNs (and -infs) has m = -inf and s = NaN: its sum is scaled, not skipped, so
// that the NaN reaches the row's sum as it does on the CPU (NaN x expf(-inf) is NaN).
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};  // 0, or NaN
  const float sa = a.s == 0.0f ? 0.0f : a.s * expf(a.m - m);
  const float sb = b.s == 0.0f ? 0.0f : b.s * expf(b.m - m);
  return {m, sa + sb};
}

__device__ __forceinline__ void accumulate(MaxSum& st, float x) {
  if (x > st.m) {
    st.s = st.s * expf(st.m - x) + 1.0f;  // expf(-inf) = 0 for the first element
    st.m = x;
  } else if (x != -INFINITY) {
    st.s += expf(x - st.m);  // NaN logits propagate
  }
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum st) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, st.m, offset),
                 __shfl_xor_sync(0xffffffffu, st.s, offset)};
    st = combine(st, other);
  }
  return st;
}

// (softmax - onehot) * grad_scale for one logit.
__device__ __forceinline__ float logit_grad(float x, int64_t j, int32_t target, float row_max,
                                            float inv_sum, float grad_scale) {
  return (expf(x - row_max) * inv_sum - (j == target ? 1.0f : 0.0f)) * grad_scale;
}

// A thread reads the row in groups of four logits (thread t takes groups t, t + blockDim.x,
// ...), then the vocab % 4 last ones one a thread, with vector loads (kVec) or scalar ones
// (detail::load4): the order of the row's online sums depends on vocab alone, never on the
// alignment. No __restrict__ on logits/dlogits: they may alias.
template <bool kVec>
__global__ void __launch_bounds__(kBlock)
    softmax_cross_entropy_kernel(float* __restrict__ losses, float* dlogits, const float* logits,
                                 const int32_t* __restrict__ targets, int64_t n, int64_t vocab,
                                 int32_t ignore_index, float grad_scale) {
  __shared__ float shared_m[32];
  __shared__ float shared_s[32];
  __shared__ float shared_target_logit;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int64_t groups = vocab / 4;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const float* xr = logits + row * vocab;
    float* dr = dlogits + row * vocab;
    const int32_t target = targets[row];
    if (target == ignore_index) {
      if (tid == 0) losses[row] = 0.0f;
      for (int64_t j = tid; j < vocab; j += blockDim.x) dr[j] = 0.0f;
      continue;  // block-uniform
    }
    const bool target_ok = target >= 0 && target < vocab;
    if (tid == 0) shared_target_logit = target_ok ? xr[target] : NAN;

    MaxSum st{-INFINITY, 0.0f};
    for (int64_t j = tid; j < groups; j += blockDim.x) {
      const float4 v = detail::load4<kVec>(xr, j);
      accumulate(st, v.x);
      accumulate(st, v.y);
      accumulate(st, v.z);
      accumulate(st, v.w);
    }
    for (int64_t j = 4 * groups + tid; j < vocab; j += blockDim.x) accumulate(st, xr[j]);
    st = warp_combine(st);
    if (lane == 0) {
      shared_m[warp] = st.m;
      shared_s[warp] = st.s;
    }
    __syncthreads();  // also publishes shared_target_logit before anything is overwritten
    MaxSum total{-INFINITY, 0.0f};
    if (lane < warps) total = MaxSum{shared_m[lane], shared_s[lane]};
    total = warp_combine(total);  // every warp computes the same total in the same order
    const float row_max = total.m;
    const float log_sum = logf(total.s);
    if (tid == 0) losses[row] = log_sum + row_max - shared_target_logit;
    const float inv_sum = 1.0f / total.s;

    for (int64_t j = tid; j < groups; j += blockDim.x) {
      const float4 v = detail::load4<kVec>(xr, j);
      const int64_t base = 4 * j;
      detail::store4<kVec>(
          dr, j,
          make_float4(logit_grad(v.x, base + 0, target, row_max, inv_sum, grad_scale),
                      logit_grad(v.y, base + 1, target, row_max, inv_sum, grad_scale),
                      logit_grad(v.z, base + 2, target, row_max, inv_sum, grad_scale),
                      logit_grad(v.w, base + 3, target, row_max, inv_sum, grad_scale)));
    }
    for (int64_t j = 4 * groups + tid; j < vocab; j += blockDim.x)
      dr[j] = logit_grad(xr[j], j, target, row_max, inv_sum, grad_scale);
    __syncthreads();  // shared state is reused by the next row
  }
}

}  // namespace

void softmax_cross_entropy(const CudaContext& ctx, float* losses, float* dlogits,
                           const float* logits, const int32_t* targets, int64_t n, int64_t vocab,
                           int32_t ignore_index, float grad_scale) {
  detail::require_nonnegative("softmax_cross_entropy", "n", n);
  detail::require_at_least("softmax_cross_entropy", "vocab", vocab, 1);
  if (n == 0) return;
  const bool vec = vocab % 4 == 0 && detail::aligned16(logits) && detail::aligned16(dlogits);
  // Narrow rows do not need 16 warps; keep at least one full warp. The block size decides
  // which logits each thread sums, so it depends on vocab alone.
  const int64_t groups = (vocab + 3) / 4;
  const int block = static_cast<int>(std::min<int64_t>(kBlock, (groups + 31) / 32 * 32));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, detail::kFixedSmCount * 64));
  if (vec)
    softmax_cross_entropy_kernel<true><<<grid, block, 0, ctx.stream>>>(
        losses, dlogits, logits, targets, n, vocab, ignore_index, grad_scale);
  else
    softmax_cross_entropy_kernel<false><<<grid, block, 0, ctx.stream>>>(
        losses, dlogits, logits, targets, n, vocab, ignore_index, grad_scale);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda
