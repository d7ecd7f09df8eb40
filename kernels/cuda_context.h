#pragma once
// What a CUDA kernel launcher needs besides its tensors: the stream to enqueue on and, for
// GEMMs, a cuBLASLt handle with its workspace. Owned by the engine's device context; kernels
// only borrow it.
#ifdef CONVEYOR_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace conveyor::kernels::cuda {

struct CudaContext {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t cublaslt = nullptr;
  void* workspace = nullptr;  // device memory for cuBLASLt, may be null
  size_t workspace_bytes = 0;
  bool allow_tf32 = false;  // fp32 GEMMs may use TF32 tensor cores
};

}  // namespace conveyor::kernels::cuda
#endif
