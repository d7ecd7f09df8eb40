#ifdef CONVEYOR_WITH_CUDA
#include "kernels/cuda_check.h"

#include <string>

namespace conveyor::kernels::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // A failed call whose error is not sticky (an allocation, say) also leaves it as the
  // thread's last error, which the next launch check would report against an unrelated
  // kernel once the caller has handled this one. It is reported here, so it is cleared; a
  // sticky error stays and fails every later call, as it must.
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ") in " + call + " at " + file + ":" +
                           std::to_string(line));
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("cuBLAS error ") + cublasLtGetStatusName(status) + " (" +
                           std::to_string(static_cast<int>(status)) + ": " +
                           cublasLtGetStatusString(status) + ") in " + call + " at " + file + ":" +
                           std::to_string(line));
}

}  // namespace conveyor::kernels::cuda
#endif
