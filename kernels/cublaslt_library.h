#pragma once
// cuBLASLt is opened on the first matrix product of a CUDA device, not when a program starts:
// loading it costs every process a tenth of a second and about 200 MiB of resident memory
// (its initialisers), which CPU runs and the test suite's thousands of short processes
// would pay for nothing. kernels/cublaslt_library.cpp defines the cuBLASLt functions the
// project calls, each forwarding to the library's own, found by name once it is open.
#ifdef CONVEYOR_WITH_CUDA
#include <string>
#include <vector>

namespace conveyor::kernels::cuda {

// The files tried, in order: the library's name for the dynamic loader's search
// (LD_LIBRARY_PATH, the loader's cache), then the one this build was linked against.
std::vector<std::string> cublaslt_library_candidates();

// Opens the first of `candidates` that loads (kept open for the life of the process) and
// returns its handle; throws std::runtime_error naming every file tried and why each failed.
void* open_first_library(const std::vector<std::string>& candidates, const std::string& what);

// The cuBLASLt library of this process, opened on the first call.
void* cublaslt_library();

// Whether the process is exiting and the library tearing itself down: its destroy functions
// then return success without a call, the process's end freeing what they would.
bool cublaslt_torn_down();

}  // namespace conveyor::kernels::cuda
#endif
