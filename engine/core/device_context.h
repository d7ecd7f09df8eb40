#pragma once
// Everything one rank needs to run kernels on its device: the caching allocator, the compute
// stream and, on CUDA, the cuBLASLt handle and workspace. One per rank (several ranks may
// share a GPU, each with its own context and streams). Not thread-safe: one rank, one thread.
#include <memory>
#include <string>

#include "engine/core/allocator.h"
#include "engine/core/device.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"
#include "kernels/cuda_context.h"
#include "kernels/thread_pool.h"

namespace conveyor {

struct DeviceContextOptions {
  size_t memory_limit_bytes = 0;  // 0 = no cap
  // A cap shared with the other contexts of the same device that are given it (the ranks of
  // a process that share a device): the allocator draws from it instead of a cap of its own,
  // and memory_limit_bytes must then be 0 or the budget's limit. `allocator_name` says whose
  // allocator it is when the budget runs out ("rank 2").
  std::shared_ptr<MemoryBudget> memory_budget;
  std::string allocator_name;
  bool allow_tf32 = false;
  size_t cublas_workspace_bytes = 32u << 20;
  // Threads of this context's CPU kernels, the rank's own thread included (CPU only; from 1
  // to kMaxCpuThreads, else the context throws std::invalid_argument). Kernels split work by
  // shape only, so the bits do not depend on it.
  static constexpr int kMaxCpuThreads = 4096;
  int cpu_threads = 1;
};

class DeviceContext {
 public:
  explicit DeviceContext(Device device, DeviceContextOptions options = {});
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  Device device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }
  CachingAllocator& allocator() { return *allocator_; }
  const std::shared_ptr<CachingAllocator>& allocator_ptr() const { return allocator_; }
  Stream& compute_stream() { return *compute_stream_; }
  // The CPU kernels' pool; null on a CUDA context.
  kernels::cpu::ThreadPool* cpu_pool() { return cpu_pool_.get(); }

  // Tensors on this device for use on the compute stream.
  Tensor empty(const Shape& shape, DType dtype = DType::kF32);
  Tensor zeros(const Shape& shape, DType dtype = DType::kF32);
  void fill_zero(const Tensor& t);  // on the compute stream
  void synchronize();               // waits for the compute stream

#ifdef CONVEYOR_WITH_CUDA
  const kernels::cuda::CudaContext& cuda() const { return cuda_; }
  // Scratch device memory of at least `bytes` for kernels that need it (grows, never shrinks;
  // valid until the next call).
  void* scratch(size_t bytes);
#endif

 private:
  Device device_;
  std::shared_ptr<CachingAllocator> allocator_;
  std::unique_ptr<Stream> compute_stream_;
  std::unique_ptr<kernels::cpu::ThreadPool> cpu_pool_;
#ifdef CONVEYOR_WITH_CUDA
  kernels::cuda::CudaContext cuda_{};
  Tensor workspace_;
  Tensor scratch_;
#endif
};

}  // namespace conveyor
