#pragma once
// Planning a training run: profile the model on its device, rank the layouts, and turn the
// chosen one (or a plan file) into the pipeline settings of a TrainConfig. Used by
// `conveyor plan` and by `conveyor train --plan FILE` / `--partition auto`.
#include <string>

#include "engine/pipeline/planner.h"
#include "engine/train/trainer.h"
#include "tools/output_file.h"

namespace conveyor::cli {

struct PlannedRun {
  UnitCosts costs;  // the profile at the largest micro-batch size planned for
  Plan plan;
};

// Profiles the reference model of `config` on `device` and plans for config.stages devices and
// config.batch_tokens tokens, under config.memory_limit_bytes per device (0: no cap). Prints
// the profile and the ranked table when `print`.
PlannedRun plan_training(const TrainConfig& config, Device device, int repetitions, bool print);

// The fastest feasible pipelined candidate (what the trainer can run); UsageError when none.
const PlanCandidate& best_pipeline(const Plan& plan);

// The pipeline settings of `candidate` as the JSON of a plan file: stages, schedule, chunks,
// micro-batches, blocks per stage, recomputation, the predicted step time. write_plan_file
// writes it into `file` and closes it.
std::string plan_text(const PlanCandidate& candidate, int stages);
void write_plan_file(OutputFile& file, const PlanCandidate& candidate, int stages);
// Sets stages, schedule, chunks, micro-batches, partition and recomputation of `config` from
// the text of a plan (`source` names it in errors) or from a plan file; UsageError for a file
// that cannot be read or a plan that does not fit the model.
void apply_plan_text(const std::string& text, const std::string& source, TrainConfig& config);
void apply_plan_file(const std::string& path, TrainConfig& config);

}  // namespace conveyor::cli
