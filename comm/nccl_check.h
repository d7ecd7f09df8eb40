#pragma once
// Every NCCL call is checked; a failure throws TransportError naming the call, file, line,
// NCCL's error string and, when NCCL recorded one, its last error message.
#ifdef CONVEYOR_WITH_CUDA
#include <nccl.h>

namespace conveyor::comm {

[[noreturn]] void throw_nccl_error(ncclResult_t result, const char* call, const char* file,
                                   int line);

}  // namespace conveyor::comm

#define CONVEYOR_NCCL_CHECK(call)                                                           \
  do {                                                                                      \
    ncclResult_t conveyor_nccl_result_ = (call);                                            \
    if (conveyor_nccl_result_ != ncclSuccess)                                               \
      ::conveyor::comm::throw_nccl_error(conveyor_nccl_result_, #call, __FILE__, __LINE__); \
  } while (0)
#endif
