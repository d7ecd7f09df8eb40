#pragma once
// How CUDA loads the kernels of a `conveyor train` run that may reach NCCL.
#include "tools/train_flags.h"

namespace conveyor::cli {

// Whether the run these flags describe may move tensors over NCCL: on a GPU, with more than
// one rank (stages x replicas, several launched processes, or a plan, a schedule file or
// --partition auto that may choose them) and a transport that can be NCCL.
bool may_use_nccl(const TrainFlags& f);

// A run that may use NCCL loads every kernel when CUDA starts, unless CUDA_MODULE_LOADING
// already says how. NCCL's kernels wait on the GPU for their peer's data; under CUDA's lazy
// loading a kernel is loaded at its first launch, and a load may wait for the context's
// running kernels (the CUDA programming guide's lazy-loading hazards). A rank whose first
// backward needs a kernel not yet loaded, while its NCCL receive waits for a peer that waits
// for that backward, would hang in step 1. Eager loading costs start-up time and the device
// memory of kernels never run. Call before anything starts CUDA (MPI_Init may).
void load_cuda_kernels_eagerly_if_nccl(const TrainFlags& f);

}  // namespace conveyor::cli
