#pragma once
// Planning a training run: profile the model on its device, rank the layouts, and turn the
// chosen one (or a plan file) into the pipeline settings of a TrainConfig. Used by
// `conveyor plan` and by `conveyor train --plan FILE` / `--partition auto`.
#include <cstdint>
#include <optional>
#include <string>

#include "engine/pipeline/planner.h"
#include "engine/train/trainer.h"

namespace conveyor::cli {

struct PlannedRun {
  UnitCosts costs;  // the profile at the largest micro-batch size planned for
  Plan plan;
  int64_t units = 0;  // of the model planned for
  int stages = 0;
  int replicas = 1;         // --dp D: the plan is of one replica's share of the batch
  std::string constraints;  // "--schedule gpipe", ...: what limited the search; empty: nothing
};

// What the caller fixed of the layout (`train --partition auto` with --schedule, --chunks or
// --microbatches): only pipelined candidates that agree are kept; and where the ranks run.
struct PlanConstraints {
  std::optional<schedule::ScheduleKind> schedule;
  std::optional<int> chunks;
  std::optional<int64_t> microbatches;  // of one replica's share of the batch
  int replicas = 1;  // --dp: named next to --microbatches, which is `microbatches` x this
  // Each rank runs in a process of its own (under mpirun or srun), whose allocators hold the
  // memory cap for that rank alone, as the run's check before the first step counts it
  // (check_memory_fits); on the CPU the memory the machine has available is still shared by
  // all, a GPU rank has its process's GPU to itself.
  bool one_rank_per_process = false;
};

// Profiles the reference model of `config` on `device` and plans for config.stages devices and
// config.batch_tokens tokens, under config.memory_limit_bytes per device (per rank with
// ranks as processes), or else the device's memory (shared by the ranks that share it). Prints the
// profile and the ranked table when `print`.
PlannedRun plan_training(const TrainConfig& config, Device device, int repetitions, bool print,
                         const PlanConstraints& constraints = {});

// The fastest feasible pipelined candidate (what the trainer can run); UsageError, saying
// why none is and what would work, when none is.
const PlanCandidate& best_pipeline(const PlannedRun& run);
// UsageError, as best_pipeline's, when no candidate at all is feasible (pipelined or not).
void require_some_layout(const PlannedRun& run);

// The pipeline settings of `candidate` as the JSON of a plan file: stages, schedule, chunks,
// micro-batches, blocks per stage, recomputation, the predicted step time, and what it was
// planned for: the model, the batch and the device kind of `config`.
std::string plan_text(const PlanCandidate& candidate, const TrainConfig& config);
// Sets stages, schedule, chunks, micro-batches, partition and recomputation of `config` from
// the text of a plan (`source` names it in errors) or from a plan file; UsageError for a file
// that cannot be read, a plan that does not fit the model, or one planned for another model,
// batch or device kind than `config`'s (config.device must be set). A plan is of one
// pipeline: with `replicas` (--dp D) > 1, `config` is one replica's share of the run's batch,
// and the errors say so.
void apply_plan_text(const std::string& text, const std::string& source, TrainConfig& config,
                     int64_t replicas = 1);
void apply_plan_file(const std::string& path, TrainConfig& config, int64_t replicas = 1);

}  // namespace conveyor::cli
