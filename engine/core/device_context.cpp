#include "engine/core/device_context.h"

#include <cstring>
#include <stdexcept>
#include <string>

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"
#endif

namespace conveyor {
#ifdef CONVEYOR_WITH_CUDA
namespace {

// A tensor of at least `bytes` bytes (f32 elements, the unit our dtypes share).
Shape bytes_shape(size_t bytes) { return {static_cast<int64_t>((bytes + 3) / 4)}; }

}  // namespace
#endif

namespace {

// The context's cap: the shared budget it was given, or one of its own.
std::shared_ptr<MemoryBudget> budget_of(const DeviceContextOptions& options, Device device) {
  if (!options.memory_budget) return std::make_shared<MemoryBudget>(options.memory_limit_bytes);
  const size_t shared = options.memory_budget->limit_bytes();
  if (options.memory_limit_bytes != 0 && options.memory_limit_bytes != shared)
    throw std::invalid_argument(
        "a context of " + device.to_string() + " was given a memory limit of " +
        std::to_string(options.memory_limit_bytes) + " bytes and a shared budget of " +
        std::to_string(shared) + " bytes; give one, or the same limit in both");
  return options.memory_budget;
}

}  // namespace

DeviceContext::DeviceContext(Device device, DeviceContextOptions options) : device_(device) {
  if (device.is_cpu()) {
    allocator_ = make_cpu_allocator(budget_of(options, device), options.allocator_name);
    compute_stream_ = std::make_unique<Stream>(device);
    // Checked before the pool starts them: a million threads exhausted the machine.
    if (options.cpu_threads < 1 || options.cpu_threads > DeviceContextOptions::kMaxCpuThreads)
      throw std::invalid_argument("DeviceContextOptions::cpu_threads must be from 1 to " +
                                  std::to_string(DeviceContextOptions::kMaxCpuThreads) + " on " +
                                  device.to_string() + ", got " +
                                  std::to_string(options.cpu_threads));
    cpu_pool_ = std::make_unique<kernels::cpu::ThreadPool>(options.cpu_threads);
    return;
  }
#ifdef CONVEYOR_WITH_CUDA
  const int count = cuda_device_count();
  if (device.index < 0 || device.index >= count)
    throw std::invalid_argument("cannot use " + device.to_string() + ": this machine has " +
                                std::to_string(count) + " usable CUDA device(s)");
  // The rank's thread works on this device from now on: kernels launch on the current device.
  CONVEYOR_CUDA_CHECK(cudaSetDevice(device.index));
  allocator_ =
      make_cuda_allocator(device.index, budget_of(options, device), options.allocator_name);
  compute_stream_ = std::make_unique<Stream>(device);
  CONVEYOR_CUBLAS_CHECK(cublasLtCreate(&cuda_.cublaslt));
  cuda_.stream = static_cast<cudaStream_t>(compute_stream_->native());
  cuda_.allow_tf32 = options.allow_tf32;
  if (options.cublas_workspace_bytes > 0) {
    try {
      workspace_ = empty(bytes_shape(options.cublas_workspace_bytes));
    } catch (...) {
      (void)cublasLtDestroy(cuda_.cublaslt);  // the destructor will not run
      throw;
    }
    cuda_.workspace = workspace_.raw();
    cuda_.workspace_bytes = options.cublas_workspace_bytes;
  }
#else
  throw std::runtime_error("cannot use " + device.to_string() +
                           ": this binary was built without the CUDA backend");
#endif
}

DeviceContext::~DeviceContext() {
  try {
    synchronize();
  } catch (...) {
    // A destructor must not throw.
  }
#ifdef CONVEYOR_WITH_CUDA
  scratch_ = Tensor();
  workspace_ = Tensor();
  if (cuda_.cublaslt != nullptr) (void)cublasLtDestroy(cuda_.cublaslt);
#endif
}

Tensor DeviceContext::empty(const Shape& shape, DType dtype) {
  return Tensor::empty(shape, dtype, allocator_, compute_stream_->native());
}

Tensor DeviceContext::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  fill_zero(t);
  return t;
}

void DeviceContext::fill_zero(const Tensor& t) {
  check_device(t, device_, "fill_zero");
  if (t.nbytes() == 0) return;
  if (device_.is_cpu()) {
    std::memset(t.raw(), 0, t.nbytes());
    return;
  }
#ifdef CONVEYOR_WITH_CUDA
  CONVEYOR_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), cuda_.stream));
#endif
}

void DeviceContext::synchronize() { compute_stream_->synchronize(); }

#ifdef CONVEYOR_WITH_CUDA
void* DeviceContext::scratch(size_t bytes) {
  if (!scratch_.defined() || scratch_.nbytes() < bytes) {
    // Freed on the compute stream and reallocated for it: stream order makes this safe even
    // while kernels still use the old scratch.
    scratch_ = Tensor();
    scratch_ = empty(bytes_shape(bytes));
  }
  return scratch_.raw();
}
#endif

}  // namespace conveyor
