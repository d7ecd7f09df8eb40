#include "tools/cuda_module_loading.h"

#include <cstdlib>

#include "comm/launch_environment.h"
#include "engine/core/device.h"

namespace conveyor::cli {

bool may_use_nccl(const TrainFlags& f) {
  if (!built_with_cuda() || f.run.device == "cpu") return false;
  if (f.transport == "inproc" || f.transport == "mpi") return false;
  return comm::launched_process_count() > 1 || f.transport == "nccl" ||
         int64_t{f.config.stages} * f.config.data_parallel > 1 || !f.plan_file.empty() ||
         !f.config.schedule_file.empty() || f.partition == "auto";
}

void load_cuda_kernels_eagerly_if_nccl(const TrainFlags& f) {
  if (may_use_nccl(f)) setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
}

}  // namespace conveyor::cli
