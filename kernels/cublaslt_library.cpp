#ifdef CONVEYOR_WITH_CUDA
#include "kernels/cublaslt_library.h"

#include <cublasLt.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace conveyor::kernels::cuda {

std::vector<std::string> cublaslt_library_candidates() {
  std::vector<std::string> files = {"libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR)};
#ifdef CONVEYOR_CUBLASLT_FILE
  files.emplace_back(CONVEYOR_CUBLASLT_FILE);
#endif
  return files;
}

void* open_first_library(const std::vector<std::string>& candidates, const std::string& what) {
  std::string failures;
  for (const std::string& file : candidates) {
    if (void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
    const char* why = dlerror();
    failures += (failures.empty() ? "" : "; ") + file + ": " + (why ? why : "unknown error");
  }
  throw std::runtime_error(what + " could not be loaded (" + failures +
                           "); install it or add its folder to LD_LIBRARY_PATH");
}

namespace {

std::atomic<bool> library_torn_down{false};

// The library's own definition of `name`, of the type the header declares.
template <typename Function>
Function* cublaslt_function(const char* name) {
  void* symbol = dlsym(cublaslt_library(), name);
  if (symbol == nullptr)
    throw std::runtime_error(std::string("the cuBLASLt library that was loaded has no ") + name +
                             " (built against cuBLAS " + std::to_string(CUBLAS_VERSION) +
                             "); use the CUDA toolkit's cuBLAS of that version or later");
  return reinterpret_cast<Function*>(symbol);
}

}  // namespace

void* cublaslt_library() {
  static void* const handle = [] {
    void* library =
        open_first_library(cublaslt_library_candidates(),
                           "cuBLASLt, the library of the CUDA backend's matrix products,");
    // At exit the library tears itself down by handlers it registered as it opened, after
    // those of every object the program had made by then; handlers run last registered
    // first. This one, registered after the library's, runs before them and marks the
    // teardown, so that the destructors of those earlier objects (a handle kept in a global)
    // skip their destroy calls instead of reaching a library that is gone.
    std::atexit([] { library_torn_down.store(true); });
    return library;
  }();
  return handle;
}

bool cublaslt_torn_down() { return library_torn_down.load(); }

}  // namespace conveyor::kernels::cuda

// The functions of <cublasLt.h> the project calls, with the header's own signatures (a
// mismatch does not compile). A call to one missing here fails to link: add it the same way.
// Each looks up the library's function of its own name and type (one spelling of the name,
// so the two cannot differ) on its first call.
#define CONVEYOR_CUBLASLT_REAL(name) \
  ::conveyor::kernels::cuda::cublaslt_function<decltype(name)>(#name)

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtCreate);
  return real(handle);
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (conveyor::kernels::cuda::cublaslt_torn_down()) return CUBLAS_STATUS_SUCCESS;
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtDestroy);
  return real(handle);
}

const char* cublasLtGetStatusName(cublasStatus_t status) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtGetStatusName);
  return real(status);
}

const char* cublasLtGetStatusString(cublasStatus_t status) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtGetStatusString);
  return real(status);
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc,
                                        cublasComputeType_t compute_type,
                                        cudaDataType_t scale_type) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulDescCreate);
  return real(desc, compute_type, scale_type);
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  if (conveyor::kernels::cuda::cublaslt_torn_down()) return CUBLAS_STATUS_SUCCESS;
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulDescDestroy);
  return real(desc);
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attribute,
                                              const void* value, size_t size) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulDescSetAttribute);
  return real(desc, attribute, value, size);
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatrixLayoutCreate);
  return real(layout, type, rows, cols, ld);
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  if (conveyor::kernels::cuda::cublaslt_torn_down()) return CUBLAS_STATUS_SUCCESS;
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatrixLayoutDestroy);
  return real(layout);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulPreferenceCreate);
  return real(preference);
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference) {
  if (conveyor::kernels::cuda::cublaslt_torn_down()) return CUBLAS_STATUS_SUCCESS;
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulPreferenceDestroy);
  return real(preference);
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t preference,
                                                    cublasLtMatmulPreferenceAttributes_t attribute,
                                                    const void* value, size_t size) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulPreferenceSetAttribute);
  return real(preference, attribute, value, size);
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t preference, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* returned) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmulAlgoGetHeuristic);
  return real(handle, desc, a, b, c, d, preference, requested, results, returned);
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* a, cublasLtMatrixLayout_t a_layout, const void* b,
                              cublasLtMatrixLayout_t b_layout, const void* beta, const void* c,
                              cublasLtMatrixLayout_t c_layout, void* d,
                              cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, size_t workspace_size, cudaStream_t stream) {
  static auto* const real = CONVEYOR_CUBLASLT_REAL(cublasLtMatmul);
  return real(handle, desc, alpha, a, a_layout, b, b_layout, beta, c, c_layout, d, d_layout, algo,
              workspace, workspace_size, stream);
}

}  // extern "C"
#endif
