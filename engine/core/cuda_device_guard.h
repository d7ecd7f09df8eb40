#pragma once
// Internal to the engine: makes CUDA device `index` current for a scope and restores the
// caller's device afterwards, so that allocating or copying on another GPU does not silently
// move the calling thread (a rank) off its own device. The one way engine code switches the
// device for a scope; only binding a rank's thread to its device (DeviceContext, the rank
// threads) makes a device current for good. Kernels never switch: they launch on the
// current device, which is the rank's.
#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace conveyor::detail {

// Whether device `index` has its primary context (the one the runtime uses) already; true
// when the driver cannot tell, so that a caller keeps the behaviour of restoring.
bool cuda_primary_context_active(int index);

class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int index) {
    CONVEYOR_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ == index) {
      previous_ = -1;  // nothing to restore
      return;
    }
    // A thread that never chose a device reads device 0 even where no context exists there,
    // and setting a device creates its context (a few hundred MiB): restoring would claim GPU
    // 0 for every process whose ranks are elsewhere. Such a thread stays on `index`.
    if (!cuda_primary_context_active(previous_)) previous_ = -1;
    CONVEYOR_CUDA_CHECK(cudaSetDevice(index));
  }
  ~CudaDeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);  // destructors must not throw
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace conveyor::detail
#endif
