// `conveyor train`: builds a TrainConfig from a preset and flags (train_flags.h), checks what
// must hold before the first step (train_setup.h), places this process's device and plans the
// pipeline on it, then trains (training_run.h): one line per logged step and a summary
// (train_report.h), and optionally one JSON object per step.

#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/launch_environment.h"
#include "engine/core/device.h"
#include "engine/train/run_limits.h"
#include "engine/train/train_config.h"
#include "tools/checkpoint_flags.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/cuda_module_loading.h"
#include "tools/mpi_launch.h"
#include "tools/resume_settings.h"
#include "tools/run_flags.h"
#include "tools/train_flags.h"
#include "tools/train_setup.h"
#include "tools/training_run.h"

namespace conveyor::cli {
namespace {

// The device this process trains on (said, and checked against the other processes' under
// MPI), then the plan that cuts the pipeline on it (--plan, --partition auto) and the threads
// its ranks take. Sets config.device.
Device place_and_plan(const TrainFlags& f, const CLI::App& cmd, const MpiSession& mpi,
                      TrainConfig& config) {
  std::string note;
  Device device;
  try {
    device = resolve_device(config.device, &note);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (!note.empty()) std::printf("conveyor: %s\n", note.c_str());
  device = process_device(mpi, f.run.device, device);
  std::vector<std::string> ignored = f.run.ignored_on(cmd, device);
  // As --tf32 on the CPU: said from the placement the run got, so that a run does not look
  // as if its ranks were placed. A process of a launch holds one rank, on the device its
  // node-local rank picks (process_device) or the CPU: that reason holds on either.
  if (config.placement == RankPlacement::kShared && mpi.active())
    ignored.push_back(
        "--placement shared puts the ranks of a process on one GPU and does nothing when each "
        "process holds one rank (under mpirun or srun)");
  else if (config.placement == RankPlacement::kShared && device.is_cpu())
    ignored.push_back("--placement shared puts the ranks on one GPU and does nothing on the CPU");
  for (const std::string& note : ignored) std::printf("note   %s\n", note.c_str());
  // A collective: every rank asks or none, which the agreed --device flag decides; CPU runs
  // have no GPU to share and skip its round trip.
  if (f.run.device != "cpu") check_gpus_not_shared(mpi, device);
  config.device = device;
  try {
    apply_planning(f, cmd, mpi, device, config);
  } catch (const UsageError& e) {  // a plan for another batch than the checkpoint's, say
    throw UsageError(with_inherited_origin(e.what(), f.checkpoint.inherited));
  }
  // Under a launcher of several processes each process holds one rank.
  check_threads_in_process(
      config.cpu_threads,
      comm::launched_process_count() > 1 ? 1 : int64_t{config.stages} * config.data_parallel,
      device,
      "--stages " + std::to_string(config.stages) + " x --dp " +
          std::to_string(config.data_parallel));
  return device;
}

void run_train(TrainFlags& f, const CLI::App& cmd) {
  load_cuda_kernels_eagerly_if_nccl(f);  // before CUDA starts: MPI_Init or the device's count
  check_checkpoint_flags(f.checkpoint, cmd);
  refuse_outputs_over_inputs(f);
  TrainConfig config = resolve_config(f, cmd);
  // Before the trainer, which builds this rank's MPI transport; after it, MPI_Finalize.
  MpiSession mpi(wants_mpi(config), config.transport_timeout);
  // Only under MPI: the fields read every file the run names.
  if (mpi.active()) check_same_configuration(mpi, configuration_fields(f, config));
  quiet_unless_rank_zero(mpi, f);
  const Device device = place_and_plan(f, cmd, mpi, config);
  TrainingRun run(f, cmd, mpi, config, device);
  run.build();
  run.resume_and_check_limits();
  run.watch_signals_and_outputs();
  run.train_steps();
  run.close();
  run.report();
  run.end();
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto flags = std::make_shared<TrainFlags>();
  TrainConfig& c = flags->config;
  CLI::App* cmd = app.add_subcommand("train", "Train the reference model");
  add_run_flags(cmd, flags->run, RunFlagsFor::kTrain);
  add_int_flag(cmd, "--steps", c.steps, 1, 1000000000, "Optimizer steps");
  add_int_flag(cmd, "--microbatches", c.microbatches, 1, kMaxMicrobatches,
               "Micro-batches per step");
  cmd->add_option("--optimizer", c.optimizer.kind, "adamw or sgd")->capture_default_str();
  constexpr double kMax = std::numeric_limits<double>::max();
  add_float_flag(cmd, "--lr", c.optimizer.lr, 0.0, kMax, true, "Peak learning rate");
  add_float_flag(cmd, "--min-lr", c.optimizer.min_lr, 0.0, kMax, false,
                 "Final learning rate of the cosine decay (left out: 0.0003, or --lr when "
                 "that is smaller)");
  add_int_flag(cmd, "--warmup", c.optimizer.warmup_steps, 0, 1000000000, "Linear warm-up steps");
  add_float_flag(cmd, "--weight-decay", c.optimizer.weight_decay, 0.0, kMax, false,
                 "Decoupled weight decay");
  add_float_flag(cmd, "--clip", c.optimizer.clip_norm, 0.0, kMax, false,
                 "Clip the global gradient norm to this (0 disables clipping)");
  add_int_flag(cmd, "--seed", c.seed, 0, std::numeric_limits<int64_t>::max(),
               "Seed of the weights and of the Markov source");
  add_path_flag(cmd, "--data", c.data_path,
                "Train on the bytes of FILE (a regular file of at most 1024 MiB) instead of "
                "the Markov source")
      ->type_name("FILE");
  add_path_flag(cmd, "--log-json", flags->log_json,
                "Write one JSON object per step to FILE (locked; flushed every line)")
      ->type_name("FILE");
  add_int_flag(cmd, "--log-every", flags->log_every, 1, 1000000000, "Print every N steps");
  add_switch(cmd, "--quiet", flags->quiet,
             "Leave out the per-step lines, the periodic saves' lines and --partition auto's "
             "report; the run's header, notes and closing lines stay (default off)");
  add_int_flag(cmd, "--stages", c.stages, 1, kMaxStages, "Pipeline ranks (p)");
  add_int_flag(cmd, "--chunks", flags->chunks, 1, kMaxChunks,
               "Virtual stages per rank (interleaved; zbv always has 2)")
      ->default_str("2 for interleaved, else 1");
  cmd->add_option("--schedule", flags->schedule, "Schedule: " + schedule_choices_text())
      ->capture_default_str();
  add_path_flag(cmd, "--schedule-file", c.schedule_file,
                "Run the schedule in FILE (text or CSV, see `conveyor schedule --dump`); it "
                "fixes the ranks, chunks and kind, and --stages, --chunks or --schedule given "
                "with it must agree")
      ->type_name("FILE");
  cmd->add_option(
         "--partition", flags->partition,
         "Blocks per stage: uniform, params, auto (profile and plan), or counts such as 3,5,5,3")
      ->capture_default_str();
  cmd->add_option("--placement", flags->placement,
                  "auto (one rank per GPU when there are enough) or shared (all on one GPU)")
      ->capture_default_str();
  cmd->add_option("--transport", flags->transport,
                  "auto (under mpirun or srun with several processes: NCCL bootstrapped over "
                  "MPI for CUDA ranks, MPI for CPU ranks; else NCCL when every rank has its own "
                  "GPU), inproc (one process only), nccl or mpi")
      ->capture_default_str();
  add_float_flag(cmd, "--timeout", flags->timeout_s, 0.0, 1000000.0, true,
                 "Seconds a rank waits for a peer before failing");
  add_path_flag(
      cmd, "--trace", flags->trace,
      "Write a Chrome trace to FILE: the run's steps, held-out evaluations and "
      "checkpoint saves (a background save on its own thread), and the last step's "
      "measured timeline per rank, with a pipeline's simulated timeline under it (the printed "
      "simulated bubble's)")
      ->type_name("FILE");
  add_checkpoint_flags(cmd, flags->checkpoint);
  add_path_flag(cmd, "--plan", flags->plan_file,
                "Run the plan in FILE (written by `conveyor plan --out`)")
      ->type_name("FILE");
  add_int_flag(cmd, "--eval-batches", flags->eval_batches, 0, 1000000,
               "After the last step, print the mean loss on N held-out batches: with --data "
               "those after the --steps training batches (they must fit in the file), else the "
               "Markov chain on a walk of its own");
  add_int_flag(cmd, "--eval-every", flags->eval_every, 0, 1000000000,
               "With --eval-batches: evaluate after every N steps too, on the same held-out "
               "batches (0: after the last step only)");
  add_switch(cmd, "--weights-checksum", flags->weights_checksum,
             "Print an XXH3 checksum of the final weights (to compare runs bit for bit)");
  // Data parallelism.
  add_int_flag(cmd, "--dp", c.data_parallel, 1, kMaxReplicas,
               "Data-parallel replicas D: --stages x D ranks (rank r is pipeline rank r mod "
               "--stages of replica r div --stages; under mpirun -np stages x D), each on "
               "--microbatches / D of the step's micro-batches (a multiple of D)");
  add_switch(cmd, "--shard-optimizer", c.shard_optimizer,
             "With --dp: each replica keeps the AdamW/SGD state of 1/D of every "
             "parameter, receives only the sum of that part of the gradients (a "
             "reduce-scatter), and the replicas gather the updated weights (ZeRO-1; "
             "default off)");
  cmd->footer(std::string("Example: conveyor train --stages 4 --schedule zbh1 --microbatches 8 "
                          "--log-json steps.jsonl\n") +
              kExitStatusText);
  cmd->callback([flags, cmd] { run_train(*flags, *cmd); });
}

}  // namespace conveyor::cli
