#pragma once
// Test helpers for CUDA kernels: a move-only device buffer and a context that owns a stream,
// a cuBLASLt handle and a workspace. Transfers are synchronous: tests favour clarity.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/cuda_context.h"

namespace conveyor::testing {

// A copy between device memory and pageable host memory that is complete, and ordered after
// all earlier device work, when it returns. The kernels of a test run on a non-blocking
// stream, which the legacy default stream of cudaMemcpy neither waits for nor orders: so wait
// for the device before the copy (kernels still reading or writing the buffer), and after it,
// since a pageable host-to-device cudaMemcpy may return before its data has landed.
inline void copy_and_wait(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return;
  CONVEYOR_CUDA_CHECK(cudaDeviceSynchronize());
  CONVEYOR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
  CONVEYOR_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `pad` extra elements in front let a test hand kernels a pointer that is not 16-byte
  // aligned (data() = allocation + pad).
  explicit DeviceBuffer(size_t n, size_t pad = 0) : size_(n), pad_(pad) {
    if (n + pad > 0) {
      void* p = nullptr;
      CONVEYOR_CUDA_CHECK(cudaMalloc(&p, (n + pad) * sizeof(T)));
      base_ = static_cast<T*>(p);
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host, size_t pad = 0)
      : DeviceBuffer(host.size(), pad) {
    upload(host);
  }
  ~DeviceBuffer() {
    if (base_ != nullptr) cudaFree(base_);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    swap(other);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return base_ == nullptr ? nullptr : base_ + pad_; }
  const T* data() const { return base_ == nullptr ? nullptr : base_ + pad_; }
  size_t size() const { return size_; }

  void upload(const std::vector<T>& host) {
    if (host.size() != size_)
      throw std::invalid_argument("DeviceBuffer::upload: the buffer holds " +
                                  std::to_string(size_) + " elements, the host vector " +
                                  std::to_string(host.size()));
    copy_and_wait(data(), host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> host(size_);
    copy_and_wait(host.data(), data(), size_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  void swap(DeviceBuffer& other) noexcept {
    std::swap(base_, other.base_);
    std::swap(size_, other.size_);
    std::swap(pad_, other.pad_);
  }
  T* base_ = nullptr;
  size_t size_ = 0;
  size_t pad_ = 0;
};

// Owns what a kernels::cuda::CudaContext borrows.
class GpuContext {
 public:
  explicit GpuContext(bool allow_tf32 = false, size_t workspace_bytes = size_t{32} << 20) {
    CONVEYOR_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    CONVEYOR_CUBLAS_CHECK(cublasLtCreate(&ctx_.cublaslt));
    if (workspace_bytes > 0) CONVEYOR_CUDA_CHECK(cudaMalloc(&ctx_.workspace, workspace_bytes));
    ctx_.workspace_bytes = workspace_bytes;
    ctx_.allow_tf32 = allow_tf32;
  }
  ~GpuContext() {
    cudaStreamSynchronize(ctx_.stream);
    if (ctx_.workspace != nullptr) cudaFree(ctx_.workspace);
    cublasLtDestroy(ctx_.cublaslt);
    cudaStreamDestroy(ctx_.stream);
  }
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

  const kernels::cuda::CudaContext& ctx() const { return ctx_; }
  void sync() const { CONVEYOR_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream)); }

 private:
  kernels::cuda::CudaContext ctx_;
};

// Bitwise equality of two float vectors (determinism and exact-recipe checks).
inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  return true;
}

}  // namespace conveyor::testing
