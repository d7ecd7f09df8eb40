// The element-wise kernels on CUDA: activations and their input gradients (activation.h),
// y += x (elementwise.h), x *= s (reduce.h) and fill (init.h). Outputs are written (`=`) and
// may alias an input: each element is read and written by the same thread, its inputs before
// its output.
// One launcher serves them all: a grid-stride loop with float4 loads and stores when every
// pointer is 16-byte aligned and a scalar tail for n % 4. Each element is computed alone, so
// the results do not depend on the grid size or on the vector path.
#include <type_traits>

#include "kernels/activation.h"
#include "kernels/cuda_util.cuh"
#include "kernels/elementwise.h"
#include "kernels/init.h"
#include "kernels/reduce.h"

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
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Scale {
  float s;
  __device__ float operator()(float x) const { return x * s; }
};
struct Constant {
  float value;
  __device__ float operator()() const { return value; }
};

// op on the four lanes of its float4 arguments.
template <class Op, class... V>
__device__ __forceinline__ float4 apply4(const Op& op, const V&... v) {
  return make_float4(op(v.x...), op(v.y...), op(v.z...), op(v.w...));
}

// out[i] = op(in[i]...) for i < n. No __restrict__: out may alias an input.
template <bool kVec, class Op, class... In>
__global__ void map_kernel(float* out, int64_t n, Op op, const In*... in) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    float4* out4 = reinterpret_cast<float4*>(out);
    for (int64_t i = tid; i < n4; i += stride)
      out4[i] = apply4(op, reinterpret_cast<const float4*>(in)[i]...);
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = op(in[i]...);
}

// The one launch of every element-wise kernel: checks n (named after `kernel` in errors),
// picks the float4 path when every pointer allows it, and sizes the grid for the work items.
template <class Op, class... In>
void launch_map(const CudaContext& ctx, const char* kernel, float* out, int64_t n, Op op,
                const In*... in) {
  static_assert((std::is_same_v<In, float> && ...), "element-wise kernels read floats");
  detail::require_nonnegative(kernel, "n", n);
  if (n == 0) return;
  const bool vec = detail::aligned16(out) && (detail::aligned16(in) && ...);
  const unsigned grid = detail::grid_for(vec ? (n + 3) / 4 : n, kBlock);
  if (vec)
    map_kernel<true><<<grid, kBlock, 0, ctx.stream>>>(out, n, op, in...);
  else
    map_kernel<false><<<grid, kBlock, 0, ctx.stream>>>(out, n, op, in...);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gelu_forward(const CudaContext& ctx, float* y, const float* x, int64_t n) {
  launch_map(ctx, "activation forward", y, n, GeluForward{}, x);
}
void gelu_backward(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n) {
  launch_map(ctx, "activation backward", dx, n, GeluBackward{}, dy, x);
}
void relu_forward(const CudaContext& ctx, float* y, const float* x, int64_t n) {
  launch_map(ctx, "activation forward", y, n, ReluForward{}, x);
}
void relu_backward(const CudaContext& ctx, float* dx, const float* dy, const float* x, int64_t n) {
  launch_map(ctx, "activation backward", dx, n, ReluBackward{}, dy, x);
}

void add_inplace(const CudaContext& ctx, float* y, const float* x, int64_t n) {
  launch_map(ctx, "add_inplace", y, n, Add{}, static_cast<const float*>(y), x);
}

void scale(const CudaContext& ctx, float* x, float s, int64_t n) {
  launch_map(ctx, "scale", x, n, Scale{s}, static_cast<const float*>(x));
}

void fill(const CudaContext& ctx, float* out, int64_t n, float value) {
  launch_map(ctx, "fill", out, n, Constant{value});
}

}  // namespace conveyor::kernels::cuda
