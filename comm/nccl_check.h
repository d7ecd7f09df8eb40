#pragma once
// Every NCCL call is checked; a failure throws TransportError naming the call, file, line,
// NCCL's error string and, when NCCL recorded one, its last error message. Calls on a
// non-blocking communicator (and ncclGroupEnd over one) may also answer ncclInProgress: NCCL
// goes on with them in its own threads, and the caller polls the communicator until it has
// settled before its next call (CONVEYOR_NCCL_START, then the clique's settle()).
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

#define CONVEYOR_NCCL_START(call)                                                           \
  do {                                                                                      \
    ncclResult_t conveyor_nccl_result_ = (call);                                            \
    if (conveyor_nccl_result_ != ncclSuccess && conveyor_nccl_result_ != ncclInProgress)    \
      ::conveyor::comm::throw_nccl_error(conveyor_nccl_result_, #call, __FILE__, __LINE__); \
  } while (0)
#endif
