// Deterministic reductions on CUDA, accumulated in double.
// Stage 1: a grid whose size depends only on n; each thread sums a fixed grid-stride set of
// elements, each block reduces its threads in a fixed tree and writes one partial to scratch.
// Stage 2: one block reduces the partials in a fixed tree and writes the result.
// Same input, same n -> same bits, on every run and every stream.
#include "kernels/cuda_util.cuh"
#include "kernels/reduce.h"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kBlock = 256;
constexpr int64_t kMaxPartials = 1024;
constexpr int64_t kItemsPerThread = 16;

int64_t partial_count(int64_t n) {
  if (n <= 0) return 0;
  const int64_t blocks = (n + kBlock * kItemsPerThread - 1) / (kBlock * kItemsPerThread);
  return std::min(blocks, kMaxPartials);
}

template <bool kSquare>
__global__ void reduce_partials_kernel(double* __restrict__ partials, const float* __restrict__ x,
                                       int64_t n) {
  __shared__ double shared[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double acc = 0.0;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four loads in flight per thread; they are added in the same order as the plain loop.
  for (; i + 3 * stride < n; i += 4 * stride) {
    const float a = x[i], b = x[i + stride], c = x[i + 2 * stride], d = x[i + 3 * stride];
    const double v[4] = {a, b, c, d};
#pragma unroll
    for (int k = 0; k < 4; ++k) acc += kSquare ? v[k] * v[k] : v[k];
  }
  for (; i < n; i += stride) {
    const double v = x[i];
    acc += kSquare ? v * v : v;
  }
  acc = detail::block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void reduce_final_kernel(double* __restrict__ out, const double* __restrict__ partials,
                                    int count) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = detail::block_sum(acc, shared);
  if (threadIdx.x == 0) *out = acc;
}

template <bool kSquare>
void reduce(const CudaContext& ctx, double* out, const float* x, int64_t n, void* scratch) {
  detail::require_nonnegative(kSquare ? "sum_squares" : "sum", "n", n);
  const int64_t partials = partial_count(n);
  auto* partial = static_cast<double*>(scratch);
  if (partials > 0) {
    detail::require(scratch != nullptr,
                    "reduce: scratch is null; allocate reduce_scratch_bytes(n) bytes");
    reduce_partials_kernel<kSquare>
        <<<static_cast<unsigned>(partials), kBlock, 0, ctx.stream>>>(partial, x, n);
    CONVEYOR_CUDA_CHECK_LAUNCH();
  }
  // Runs for n = 0 too, so *out is always written (0).
  reduce_final_kernel<<<1, kBlock, 0, ctx.stream>>>(out, partial, static_cast<int>(partials));
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t reduce_scratch_bytes(int64_t n) {
  detail::require_nonnegative("reduce_scratch_bytes", "n", n);
  return static_cast<size_t>(partial_count(n)) * sizeof(double);
}

void sum(const CudaContext& ctx, double* out, const float* x, int64_t n, void* scratch) {
  reduce<false>(ctx, out, x, n, scratch);
}

void sum_squares(const CudaContext& ctx, double* out, const float* x, int64_t n, void* scratch) {
  reduce<true>(ctx, out, x, n, scratch);
}

}  // namespace conveyor::kernels::cuda
