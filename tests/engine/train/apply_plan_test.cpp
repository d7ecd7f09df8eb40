// A plan's candidates run as planned: apply_plan sets a TrainConfig from any pipelined
// candidate of plan() (every schedule kind the planner tries), the trainer then builds
// exactly the candidate's stage ranges and steps; what cannot run is refused with a sentence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/pipeline/planner.h"
#include "engine/train/trainer.h"
#include "support/train_config.h"

namespace conveyor {
namespace {

// Six blocks: eight units to cut.
TrainConfig tiny_run() {
  TrainConfig c = testing::small_train_config(1, 1);
  c.model.n_layers = 6;
  return c;
}

// Costs of the 8 units of tiny_run's model: a heavy head, so that partitions differ from
// uniform ones.
UnitCosts made_up_costs() {
  UnitCosts costs;
  costs.microbatch_tokens = 64;
  for (int u = 0; u < 8; ++u) {
    UnitCost c;
    c.forward = u == 7 ? 3e-3 : 1e-3;
    c.backward_input = c.forward;
    c.backward_weight = c.forward;
    c.activation_bytes = 4096;
    c.state_bytes = 8192;
    costs.units.push_back(c);
  }
  return costs;
}

void expect_ranges(const std::vector<StageRange>& built, const std::vector<StageRange>& planned) {
  ASSERT_EQ(built.size(), planned.size());
  for (size_t s = 0; s < built.size(); ++s) {
    EXPECT_EQ(built[s].begin, planned[s].begin) << "stage " << s;
    EXPECT_EQ(built[s].end, planned[s].end) << "stage " << s;
  }
}

TEST(ApplyPlan, EveryPipelinedCandidateRunsAsPlanned) {
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = tiny_run().batch_tokens;
  options.microbatch_counts = {4};
  const Plan plan = conveyor::plan(made_up_costs(), options);
  std::set<std::string> kinds;
  for (const PlanCandidate& candidate : plan.candidates) {
    if (!candidate.pipelined || !candidate.rejected.empty()) continue;
    SCOPED_TRACE(candidate.layout);
    TrainConfig config = tiny_run();
    apply_plan(candidate, config);
    EXPECT_EQ(config.stages, 2);
    EXPECT_EQ(config.schedule, candidate.kind);
    EXPECT_EQ(config.chunks, candidate.chunks);
    EXPECT_EQ(config.microbatches, candidate.microbatches);
    Trainer trainer(config);
    expect_ranges(trainer.stage_ranges(), candidate.ranges);
    EXPECT_TRUE(std::isfinite(trainer.step().loss));
    kinds.insert(schedule::schedule_kind_name(candidate.kind));
  }
  EXPECT_EQ(kinds.size(), 5u) << "gpipe, 1f1b, interleaved, zbh1 and zbv";
  // The replicas, whose all-reduce is free here, rank first; the fastest pipeline is the
  // first pipelined candidate that fits.
  EXPECT_FALSE(plan.candidates.front().pipelined);
  const auto first_pipeline =
      std::find_if(plan.candidates.begin(), plan.candidates.end(),
                   [](const PlanCandidate& c) { return c.pipelined && c.rejected.empty(); });
  ASSERT_NE(first_pipeline, plan.candidates.end());
  EXPECT_EQ(plan.fastest_pipeline(), &*first_pipeline);
}

TEST(ApplyPlan, AReplicaRunsThePlannedMicroBatchesOfItsShare) {
  PlanCandidate candidate;
  candidate.layout = "1f1b";
  candidate.microbatches = 3;
  candidate.ranges = {{0, 4}, {4, 8}};
  TrainConfig config = tiny_run();
  config.data_parallel = 2;
  config.schedule_file = "old.schedule";
  apply_plan(candidate, config);
  EXPECT_EQ(config.microbatches, 6);
  EXPECT_TRUE(config.schedule_file.empty());
  EXPECT_EQ(config.partition.blocks, (std::vector<int64_t>{3, 3}));
}

void expect_refused(const PlanCandidate& candidate, const std::string& says) {
  TrainConfig config = tiny_run();
  try {
    apply_plan(candidate, config);
    ADD_FAILURE() << "accepted " << candidate.layout;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(ApplyPlan, RefusesWhatCannotRunAsAPipeline) {
  PlanCandidate replicas;
  replicas.layout = "data-parallel x2";
  replicas.pipelined = false;
  replicas.ranges = {{0, 8}};
  replicas.peak_bytes = {1, 1};
  expect_refused(replicas,
                 "is not a pipeline; train it as data-parallel x2 replicas (stages 1, "
                 "data_parallel 2)");

  PlanCandidate short_of_memory;
  short_of_memory.layout = "gpipe";
  short_of_memory.ranges = {{0, 4}, {4, 8}};
  short_of_memory.rejected = "rank 0 needs 3 MiB over the cap";
  expect_refused(short_of_memory, "cannot run: rank 0 needs 3 MiB over the cap");

  PlanCandidate odd;
  odd.layout = "interleaved v=2";
  odd.kind = schedule::ScheduleKind::kInterleaved;
  odd.chunks = 2;
  odd.ranges = {{0, 3}, {3, 5}, {5, 8}};
  expect_refused(odd, "has 3 stage ranges for 2 chunks");
}

}  // namespace
}  // namespace conveyor
