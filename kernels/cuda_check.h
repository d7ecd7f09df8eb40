#pragma once
// Every CUDA, cuBLAS and NCCL call is checked; a failure throws with the call, file and line.
#ifdef CONVEYOR_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace conveyor::kernels::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);

}  // namespace conveyor::kernels::cuda

#define CONVEYOR_CUDA_CHECK(call)                                                            \
  do {                                                                                       \
    cudaError_t conveyor_err_ = (call);                                                      \
    if (conveyor_err_ != cudaSuccess)                                                        \
      ::conveyor::kernels::cuda::throw_cuda_error(conveyor_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define CONVEYOR_CUBLAS_CHECK(call)                                                               \
  do {                                                                                            \
    cublasStatus_t conveyor_status_ = (call);                                                     \
    if (conveyor_status_ != CUBLAS_STATUS_SUCCESS)                                                \
      ::conveyor::kernels::cuda::throw_cublas_error(conveyor_status_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: catches bad launch configurations at the launch site.
#define CONVEYOR_CUDA_CHECK_LAUNCH() CONVEYOR_CUDA_CHECK(cudaGetLastError())
#endif
