#pragma once
// What `conveyor train` prints about a run: the layout before the first step (pipeline,
// replicas), the rate of a step, and after the last one the summary and the measured bubble
// against the simulator's (with both timelines as a Chrome trace when asked).
#include <cstdint>
#include <string>
#include <vector>

#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"
#include "tools/output_file.h"
#include "tools/run_trace.h"

namespace conveyor::cli {

// Tokens per second as "106.8k" or "1.25M".
std::string human_rate(double per_second);

// Data parallelism: how the ranks make up the replicas, and each replica's share.
void print_data_parallel(Trainer& trainer);
// The pipeline's ranks, chunks, schedule, transport and each stage's units and device.
void print_pipeline(Trainer& trainer);

// The summary after the last step or an interrupt: tokens, time, losses and references.
struct RunTotals {
  int64_t steps = 0;      // run by this process (a resumed run starts later)
  int64_t last_step = 0;  // the number of the last finished step
  double seconds = 0.0, last_loss = 0.0;
  std::vector<double> losses;
  size_t peak = 0;
};

// `logging_steps`: the run writes a --log-json log (an interrupted run's line points to it).
void print_summary(Trainer& trainer, const TrainConfig& config, const RunTotals& t, int signal,
                   bool logging_steps);

// Measured bubble of the last step per rank, next to the simulator's prediction for the
// costs measured in that step (a one-stage run has no bubble); optionally the measured
// timeline as a Chrome trace, with that simulation's timeline under it, put in place of the
// file whole. Under MPI it first gathers every rank's timeline into `last`.
void report_bubble(Trainer& trainer, PipelineStepResult& last, ReplacedFile* trace,
                   const RunTrace& run, const std::vector<SaveTiming>& saves);

}  // namespace conveyor::cli
