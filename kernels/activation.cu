// Element-wise activations on CUDA. Activations and their input gradients are written (`=`);
// dx may alias dy (each element is read and written by the same thread).
// float4 loads/stores when every pointer is 16-byte aligned; a scalar tail covers n % 4.
#include "kernels/activation.h"
#include "kernels/cuda_util.cuh"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kBlock = 256;
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// GELU(tanh) through 0.5 (1 + tanh u) = sigmoid(2u) = 1 / (1 + e^(-2u)), as on the CPU: no
// cancellation in 1 + tanh u for negative x; the exponent is clamped so e^(-2u) stays finite.
struct GeluTerms {
  float s;    // sigmoid(2u)
  float e_s;  // 1 - s, computed as e^(-2u) s
};
__device__ __forceinline__ GeluTerms gelu_terms(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  const float e = expf(fminf(-2.0f * u, 80.0f));
  const float s = 1.0f / (1.0f + e);
  return {s, e * s};
}
struct GeluForward {
  __device__ float operator()(float x) const { return x * gelu_terms(x).s; }
};
// d/dx = 0.5 (1 + t) + 0.5 x (1 - t²) u' = s + 2 x s (1 - s) u'.
struct GeluBackward {
  __device__ float operator()(float dy, float x) const {
    const GeluTerms g = gelu_terms(x);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
    return dy * (g.s + 2.0f * x * g.s * g.e_s * du);
  }
};
struct ReluForward {
  __device__ float operator()(float x) const { return x > 0.0f ? x : 0.0f; }
};
struct ReluBackward {
  __device__ float operator()(float dy, float x) const { return x > 0.0f ? dy : 0.0f; }
};

template <bool kVec, class Op>
__global__ void unary_kernel(float* y, const float* x, int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* y4 = reinterpret_cast<float4*>(y);
    for (int64_t i = tid; i < n4; i += stride) {
      float4 v = x4[i];
      v.x = op(v.x);
      v.y = op(v.y);
      v.z = op(v.z);
      v.w = op(v.w);
      y4[i] = v;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = op(x[i]);
}

// No __restrict__: dx may alias dy.
template <bool kVec, class Op>
__global__ void binary_kernel(float* dx, const float* dy, const float* __restrict__ x, int64_t n,
                              Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    const float4* dy4 = reinterpret_cast<const float4*>(dy);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* dx4 = reinterpret_cast<float4*>(dx);
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 g = dy4[i];
      const float4 v = x4[i];
      dx4[i] = make_float4(op(g.x, v.x), op(g.y, v.y), op(g.z, v.z), op(g.w, v.w));
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) dx[i] = op(dy[i], x[i]);
}

template <class Op>
void launch_unary(const CudaContext& ctx, float* y, const float* x, int64_t n, Op op) {
  detail::require_nonnegative("activation forward", "n", n);
  if (n == 0) return;
  const bool vec = detail::aligned16(y) && detail::aligned16(x);
  const unsigned grid = detail::grid_for(vec ? (n + 3) / 4 : n, kBlock);
  if (vec)
    unary_kernel<true><<<grid, kBlock, 0, ctx.stream>>>(y, x, n, op);
  else
    unary_kernel<false><<<grid, kBlock, 0, ctx.stream>>>(y, x, n, op);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

template <class Op>
void launch_binary(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n,
                   Op op) {
  detail::require_nonnegative("activation backward", "n", n);
  if (n == 0) return;
  const bool vec = detail::aligned16(dx) && detail::aligned16(dy) && detail::aligned16(x);
  const unsigned grid = detail::grid_for(vec ? (n + 3) / 4 : n, kBlock);
  if (vec)
    binary_kernel<true><<<grid, kBlock, 0, ctx.stream>>>(dx, dy, x, n, op);
  else
    binary_kernel<false><<<grid, kBlock, 0, ctx.stream>>>(dx, dy, x, n, op);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gelu_forward(const CudaContext& ctx, float* y, const float* x, int64_t n) {
  launch_unary(ctx, y, x, n, GeluForward{});
}
void gelu_backward(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n) {
  launch_binary(ctx, dx, dy, x, n, GeluBackward{});
}
void relu_forward(const CudaContext& ctx, float* y, const float* x, int64_t n) {
  launch_unary(ctx, y, x, n, ReluForward{});
}
void relu_backward(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n) {
  launch_binary(ctx, dx, dy, x, n, ReluBackward{});
}

}  // namespace conveyor::kernels::cuda
