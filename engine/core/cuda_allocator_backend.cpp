// The CUDA side of the caching allocator: cudaMalloc/cudaFree on one device and events that
// mark when a stream has passed its last use of a freed block; and page-locked host memory.
#include <stdexcept>
#include <string>

#include "engine/core/allocator.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"
#endif

namespace conveyor {

#ifdef CONVEYOR_WITH_CUDA
namespace {

class CudaAllocatorBackend final : public AllocatorBackend {
 public:
  explicit CudaAllocatorBackend(int index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }

  void* system_allocate(size_t bytes) override {
    detail::CudaDeviceGuard guard(index_);
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky; clear it so the next check does not see it
      return nullptr;            // the allocator frees its cache and retries
    }
    CONVEYOR_CUDA_CHECK(err);
    return ptr;
  }

  void system_free(void* ptr) override {
    detail::CudaDeviceGuard guard(index_);
    CONVEYOR_CUDA_CHECK(cudaFree(ptr));
  }

  void* record_event(void* stream) override {
    // The event must live on the stream's device, which is not this allocator's device when
    // a peer rank's stream read the block (in-process transport between GPUs): recording on
    // a stream of another device fails, and the block would never be freed.
    auto s = static_cast<cudaStream_t>(stream);
    int stream_device = index_;
    if (s != nullptr) CONVEYOR_CUDA_CHECK(cudaStreamGetDevice(s, &stream_device));
    detail::CudaDeviceGuard guard(stream_device);
    cudaEvent_t event = nullptr;
    CONVEYOR_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    const cudaError_t err = cudaEventRecord(event, s);
    if (err != cudaSuccess) {
      (void)cudaEventDestroy(event);
      CONVEYOR_CUDA_CHECK(err);
    }
    return event;
  }

  bool event_done(void* event) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    CONVEYOR_CUDA_CHECK(err);
    return true;
  }

  void destroy_event(void* event) override {
    CONVEYOR_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  }

  void synchronize_event(void* event) override {
    CONVEYOR_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }

 private:
  int index_;
};

// Page-locked host memory: CPU memory that CUDA copies reach directly.
class PinnedHostBackend final : public AllocatorBackend {
 public:
  Device device() const override { return Device::cpu(); }

  void* system_allocate(size_t bytes) override {
    void* ptr = nullptr;
    const cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    CONVEYOR_CUDA_CHECK(err);
    return ptr;
  }

  void system_free(void* ptr) override { CONVEYOR_CUDA_CHECK(cudaFreeHost(ptr)); }

  // Copies into and out of these blocks are synchronous (copy_bytes): once freed, unused.
  void* record_event(void*) override { return nullptr; }
  bool event_done(void*) override { return true; }
  void destroy_event(void*) override {}
};

}  // namespace

std::shared_ptr<CachingAllocator> make_pinned_host_allocator() {
  if (cuda_device_count() == 0) return make_cpu_allocator();
  return std::make_shared<CachingAllocator>(std::make_unique<PinnedHostBackend>());
}

std::shared_ptr<CachingAllocator> make_cuda_allocator(int index,
                                                      std::shared_ptr<MemoryBudget> budget,
                                                      std::string name) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count)
    throw std::invalid_argument("cannot create an allocator on cuda:" + std::to_string(index) +
                                ": this machine has " + std::to_string(count) +
                                " usable CUDA device(s)");
  return std::make_shared<CachingAllocator>(std::make_unique<CudaAllocatorBackend>(index),
                                            std::move(budget), std::move(name));
}

#else

std::shared_ptr<CachingAllocator> make_pinned_host_allocator() { return make_cpu_allocator(); }

std::shared_ptr<CachingAllocator> make_cuda_allocator(int index, std::shared_ptr<MemoryBudget>,
                                                      std::string) {
  throw std::runtime_error("cannot create an allocator on cuda:" + std::to_string(index) +
                           ": this binary was built without the CUDA backend");
}

#endif

std::shared_ptr<CachingAllocator> make_cuda_allocator(int index, size_t limit_bytes) {
  return make_cuda_allocator(index, std::make_shared<MemoryBudget>(limit_bytes));
}

}  // namespace conveyor
