#pragma once
// Small helpers shared by the .cu files of this folder (not a public header): launch sizing,
// alignment tests, fixed-order warp/block reductions, and stream-ordered scratch memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/cuda_context.h"

namespace conveyor::kernels::cuda::detail {

// The multiprocessor count that grids and reduction partitions are sized for: an H200's 132,
// fixed rather than queried from the device. A reduction's partition decides the order of
// its additions, and the bits of a reduction must not depend on which GPU runs it.
constexpr int64_t kFixedSmCount = 132;

// Grid-stride launches: enough blocks to fill an H200 several times over, never more than
// the work needs. Results never depend on the grid size for element-wise kernels.
inline unsigned int grid_for(int64_t work_items, int block) {
  constexpr int64_t kMaxBlocks = kFixedSmCount * 32;
  int64_t blocks = (work_items + block - 1) / block;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned int>(blocks);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Elements 4j .. 4j+3 of p: one vector load when p is 16-byte aligned (kVec), four scalar
// loads otherwise. Kernels that read rows in groups of four through these add in the same
// order either way, so an operand's alignment changes their speed and never their bits.
template <bool kVec>
__device__ __forceinline__ float4 load4(const float* p, int64_t j) {
  if constexpr (kVec) {
    return reinterpret_cast<const float4*>(p)[j];
  } else {
    return make_float4(p[4 * j], p[4 * j + 1], p[4 * j + 2], p[4 * j + 3]);
  }
}
template <bool kVec>
__device__ __forceinline__ void store4(float* p, int64_t j, float4 v) {
  if constexpr (kVec) {
    reinterpret_cast<float4*>(p)[j] = v;
  } else {
    p[4 * j] = v.x;
    p[4 * j + 1] = v.y;
    p[4 * j + 2] = v.z;
    p[4 * j + 3] = v.w;
  }
}

// Warp sums with a fixed butterfly pattern: every lane ends with the same, reproducible bits.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Block sum in a fixed order (warp butterflies, then warp 0 over the warp partials).
// `shared` holds at least 32 values. Every thread gets the result. Contains __syncthreads.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = lane < warps ? shared[lane] : T(0);
  total = warp_sum(total);
  return total;
}

// Stream-ordered device scratch. Uses the context's workspace when it is large enough
// (the workspace belongs to ctx.stream, and everything on that stream runs in order), else
// allocates from the device's stream-ordered pool and frees in stream order.
class StreamScratch {
 public:
  StreamScratch(const CudaContext& ctx, size_t bytes) : stream_(ctx.stream) {
    if (bytes == 0) return;
    if (ctx.workspace != nullptr && ctx.workspace_bytes >= bytes) {
      ptr_ = ctx.workspace;
    } else {
      CONVEYOR_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream_));
      owned_ = true;
    }
  }
  ~StreamScratch() {
    if (owned_) cudaFreeAsync(ptr_, stream_);  // a destructor must not throw
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  bool owned_ = false;
};

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// Same message shape as the CPU kernels' checks.
inline void require_at_least(const char* kernel, const char* name, int64_t value, int64_t min) {
  if (value < min)
    throw std::invalid_argument(std::string(kernel) + ": " + name + " must be >= " +
                                std::to_string(min) + ", got " + std::to_string(value));
}
inline void require_nonnegative(const char* kernel, const char* name, int64_t value) {
  require_at_least(kernel, name, value, 0);
}

}  // namespace conveyor::kernels::cuda::detail
