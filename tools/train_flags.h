#pragma once
// `conveyor train`'s flags and what they become: the TrainConfig they set (a schedule file
// or a plan deciding part of it, with the flags given next to those checked to agree), and
// the configuration every rank under mpirun must share.
#include <cstdint>
#include <optional>
#include <string>

#include "engine/core/device.h"
#include "engine/train/trainer.h"
#include "tools/checkpoint_flags.h"
#include "tools/mpi_launch.h"
#include "tools/run_flags.h"

namespace CLI {
class App;  // tools/cli_flags.h includes CLI11 where flags are declared or read
}  // namespace CLI

namespace conveyor::cli {

// Typed settings are spelled as words on the command line and parsed here.
struct TrainFlags {
  RunFlags run;    // model, batch, device, memory cap, TF32, recomputation (shared with plan)
  int chunks = 0;  // 0: 2 for interleaved (as `conveyor schedule`), else 1
  std::string schedule = "1f1b";
  std::string partition = "uniform";
  std::string placement = "auto";
  std::string transport = "auto";
  TrainConfig config;
  std::string log_json;
  int64_t log_every = 10;
  double timeout_s = 120.0;
  std::string trace;
  bool quiet = false;
  CheckpointFlags checkpoint;
  std::string plan_file;  // --plan FILE
  bool weights_checksum = false;
  int64_t eval_batches = 0;  // held-out batches after the training data; 0: none
  int64_t eval_every = 0;    // evaluate after every N steps as well as the last; 0: the last only
};

// Whether a schedule file, a plan or --partition auto chooses the micro-batch count when
// --microbatches is left out.
bool microbatches_chosen_elsewhere(const TrainFlags& f, const TrainConfig& config);

// The config the flags give, checked (a schedule file against the flags given next to it,
// the transport against the launcher). Throws UsageError.
TrainConfig resolve_config(TrainFlags& f, const CLI::App& cmd);

// --plan FILE and --partition auto: the pipeline settings come from a plan (a file, or one
// made now by profiling on `device`); an explicit block list or --recompute still wins.
void apply_planning(const TrainFlags& f, const CLI::App& cmd, const MpiSession& mpi, Device device,
                    TrainConfig& config);

// One rank among several processes (mpirun, srun): MPI starts when --transport mpi asks for
// it, or, with auto or nccl (which MPI bootstraps then), when the launcher started several
// processes.
bool wants_mpi(const TrainConfig& config);

// A GPU process under mpirun takes the GPU of its node-local rank, modulo the GPUs it sees;
// --device cuda:N pins it. Ranks that end up on one GPU are refused next
// (check_gpus_not_shared).
Device process_device(const MpiSession& mpi, const std::string& device_flag, Device resolved);

// What every rank must agree on for the ranks to compute one model's step: a rank with
// another model, cut, schedule, batch or seed would compute something else, or deadlock.
ConfigFields configuration_fields(const TrainFlags& f, const TrainConfig& c);

}  // namespace conveyor::cli
