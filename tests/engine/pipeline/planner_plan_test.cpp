// plan(): candidates ranked by simulated step time, the head's own room, one rank, replicas
// sharing optimizer state, when data parallelism beats the pipeline, its buckets' cost, the
// table measured at each micro-batch size, and bad options.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;

// A model whose loss head costs as much as several blocks.
UnitCosts head_heavy(int blocks) {
  UnitCosts costs;
  costs.microbatch_tokens = 256;
  costs.transfer_seconds = 1e-5;
  UnitCost block{1e-3, 1e-3, 1e-3, 4096, 1000, 4000};
  UnitCost embedding{1e-4, 0, 1e-4, 1024, 8000, 32000};
  UnitCost head{4e-3, 4e-3, 4e-3, 16384, 8000, 32000};
  costs.units.push_back(embedding);
  for (int b = 0; b < blocks; ++b) costs.units.push_back(block);
  costs.units.push_back(head);
  return costs;
}

TEST(Planner, PlanRanksBySimulatedStepTimeAndGivesTheHeadItsOwnRoom) {
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 2048;
  options.allreduce_bandwidth = 1e3;  // slow all-reduce: the pipeline wins
  const Plan result = plan(head_heavy(8), options);
  ASSERT_FALSE(result.candidates.empty());
  const PlanCandidate& best = result.best();
  EXPECT_TRUE(best.pipelined);
  for (size_t i = 1; i < result.candidates.size(); ++i)
    if (result.candidates[i].rejected.empty())
      EXPECT_LE(result.candidates[i - 1].step_seconds, result.candidates[i].step_seconds);
  // The head (12 ms per micro-batch) weighs four blocks, so the last stage gets fewer blocks.
  if (best.chunks == 1) {
    const auto blocks = blocks_of(best.ranges);
    EXPECT_GT(blocks.front(), blocks.back());
  }
  // The best pipeline is no slower than the uniform partition under its schedule.
  const auto sched = schedule::generate(best.kind, 2, best.microbatches, best.chunks);
  const UnitCosts costs = head_heavy(8);
  const double factor = 2048.0 / best.microbatches / costs.microbatch_tokens;
  auto simulate_ranges = [&](const std::vector<StageRange>& ranges) {
    schedule::CostModel model;
    model.forward.clear(), model.backward_input.clear(), model.backward_weight.clear();
    for (const auto& r : ranges) {
      double f = 0, i = 0, w = 0;
      for (int64_t u = r.begin; u < r.end; ++u)
        f += costs.units[u].forward, i += costs.units[u].backward_input,
            w += costs.units[u].backward_weight;
      model.forward.push_back(f * factor);
      model.backward_input.push_back(i * factor);
      model.backward_weight.push_back(w * factor);
    }
    model.latency = costs.transfer_seconds * factor;
    return schedule::simulate(sched, model);
  };
  const schedule::SimResult best_sim = simulate_ranges(best.ranges);
  EXPECT_DOUBLE_EQ(best_sim.makespan, best.step_seconds);
  // Each rank's predicted compute, which `plan --out` writes next to the step time.
  ASSERT_EQ(best.busy_seconds.size(), best_sim.ranks.size());
  for (size_t r = 0; r < best_sim.ranks.size(); ++r) {
    EXPECT_DOUBLE_EQ(best.busy_seconds[r], best_sim.ranks[r].busy) << "rank " << r;
    EXPECT_GT(best.busy_seconds[r], 0.0);
    EXPECT_LE(best.busy_seconds[r], best.step_seconds);
  }
  if (best.chunks == 1) EXPECT_LT(best.step_seconds, simulate_ranges({{0, 5}, {5, 10}}).makespan);
  const std::string table = format_plan(result);
  EXPECT_NE(table.find("step (ms)"), std::string::npos) << table;
  EXPECT_NE(table.find(best.layout), std::string::npos) << table;
  EXPECT_EQ(table.find("pipelining loses"), std::string::npos) << table;
}

TEST(Planner, OneRankPlansTheScheduleAskedFor) {
  // On one rank 1F1B stands for every schedule, unless the run fixed another: then that one
  // is planned (train --stages 1 --schedule zbh1 --partition auto found no layout before).
  PlanOptions options;
  options.num_ranks = 1;
  options.batch_tokens = 2048;
  std::set<schedule::ScheduleKind> kinds;
  for (const PlanCandidate& c : plan(head_heavy(4), options).candidates)
    if (c.pipelined) kinds.insert(c.kind);
  EXPECT_EQ(kinds, std::set<schedule::ScheduleKind>{schedule::ScheduleKind::k1F1B});
  for (const auto kind : {schedule::ScheduleKind::kZBH1, schedule::ScheduleKind::kGPipe}) {
    options.schedule = kind;
    const Plan planned = plan(head_heavy(4), options);
    const PlanCandidate* chosen = planned.fastest_pipeline();
    ASSERT_NE(chosen, nullptr) << schedule::schedule_kind_name(kind);
    EXPECT_EQ(chosen->kind, kind);
    EXPECT_EQ(chosen->ranges, (std::vector<StageRange>{{0, 6}}));
  }
}

TEST(Planner, ReplicasSharingTheOptimizerStateFitWhereWholeOnesDoNot) {
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 2048;  // free all-reduce: replicas beat the pipeline when they fit
  UnitCosts costs = head_heavy(4);
  double state = 0, optimizer = 0;
  for (auto& u : costs.units) {
    u.optimizer_bytes = 2 * u.parameter_bytes;  // AdamW's two moments
    state += u.state_bytes, optimizer += u.optimizer_bytes;
  }
  auto replicas = [](const Plan& plan, bool sharded) -> const PlanCandidate* {
    for (const auto& c : plan.candidates)
      if (!c.pipelined && c.shard_optimizer == sharded) return &c;
    return nullptr;
  };
  // Whole replicas fit: no sharded one is listed.
  const Plan roomy = plan(costs, options);
  ASSERT_NE(replicas(roomy, false), nullptr);
  EXPECT_TRUE(replicas(roomy, false)->rejected.empty());
  EXPECT_EQ(replicas(roomy, true), nullptr);

  // A cap between the sharded and the whole state, with room for the step's token ids and
  // losses of the micro-batches whose activations fit beside (16 of a replica's 1024 tokens):
  // only the sharded replicas fit, at the same predicted step time (reduce-scatter +
  // all-gather move what the all-reduce did).
  const double sharded_state = state - optimizer / 2;
  const StepInputBytes inputs = step_input_bytes(64, 16);
  options.memory_cap = (state + sharded_state) / 2 + inputs.first_unit + inputs.last_unit;
  const Plan capped = plan(costs, options);
  const PlanCandidate* whole = replicas(capped, false);
  const PlanCandidate* sharded = replicas(capped, true);
  ASSERT_NE(whole, nullptr);
  ASSERT_NE(sharded, nullptr);
  EXPECT_NE(whole->rejected.find("does not fit"), std::string::npos) << whole->rejected;
  ASSERT_TRUE(sharded->rejected.empty()) << sharded->rejected;
  EXPECT_DOUBLE_EQ(sharded->step_seconds, replicas(roomy, false)->step_seconds);
  ASSERT_EQ(sharded->peak_bytes.size(), 2u);
  EXPECT_GE(sharded->peak_bytes[0], sharded_state);
  EXPECT_LE(sharded->peak_bytes[0], options.memory_cap);
  EXPECT_EQ(&capped.best(), sharded);
  const std::string table = format_plan(capped);
  EXPECT_NE(table.find("optimizer state sharded (TrainConfig::shard_optimizer)"), std::string::npos)
      << table;
  EXPECT_NE(table.find("pipelining loses for this model and batch: data-parallel x2 sharing the "
                       "optimizer state"),
            std::string::npos)
      << table;

  // Below even the sharded state, both are refused, each saying so.
  options.memory_cap = sharded_state * 0.9;
  const Plan tight = plan(costs, options);
  ASSERT_NE(replicas(tight, true), nullptr);
  EXPECT_NE(replicas(tight, true)->rejected.find("does not fit"), std::string::npos);
  EXPECT_NE(format_plan(tight).find("does not fit sharing the optimizer state"), std::string::npos)
      << format_plan(tight);

  // Activations too large for any pipeline's micro-batches, while replicas can run one token
  // at a time: only the sharded replicas fit, and the table says so.
  UnitCosts heavy = costs;
  for (auto& u : heavy.units) u.activation_bytes = u.input_bytes = 1e6;
  // A token's activations on one replica: 6 units x 1e6 / 256 bytes, about 23 KB; with the
  // ids, targets and losses of the step the least a whole replica needs is some 300 KB (at
  // 256 micro-batches), which a plan under a cap too small for anything reports. A cap half
  // way from there to the sharded replicas' least (20 KB less: half the moments).
  options.memory_cap = 1024;
  const Plan nothing_fits = plan(heavy, options);
  ASSERT_NE(replicas(nothing_fits, false), nullptr);
  const double whole_least = replicas(nothing_fits, false)->peak_bytes.at(0);
  EXPECT_NE(replicas(nothing_fits, false)->rejected.find("needs at least"), std::string::npos)
      << replicas(nothing_fits, false)->rejected;
  options.memory_cap = whole_least - (state - sharded_state) / 2;
  const Plan only_replicas = plan(heavy, options);
  ASSERT_NE(replicas(only_replicas, true), nullptr);
  EXPECT_TRUE(replicas(only_replicas, true)->rejected.empty())
      << replicas(only_replicas, true)->rejected;
  for (const auto& c : only_replicas.candidates)
    if (c.pipelined) EXPECT_FALSE(c.rejected.empty()) << c.layout;
  EXPECT_NE(format_plan(only_replicas)
                .find("no pipeline layout fits; data-parallel x2 sharing the optimizer state "
                      "(TrainConfig::shard_optimizer) does"),
            std::string::npos)
      << format_plan(only_replicas);

  // Without optimizer state (SGD without momentum) there is nothing to share.
  for (auto& u : costs.units) u.state_bytes -= u.optimizer_bytes, u.optimizer_bytes = 0;
  options.memory_cap = (state - optimizer) * 0.9;
  EXPECT_EQ(replicas(plan(costs, options), true), nullptr);
}

TEST(Planner, SaysWhenDataParallelBeatsThePipeline) {
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 2048;  // free all-reduce, so replicas have no bubble at all
  UnitCosts costs = head_heavy(4);
  costs.transfer_seconds = 1e-3;
  const Plan result = plan(costs, options);
  EXPECT_FALSE(result.best().pipelined);
  EXPECT_NE(format_plan(result).find("pipelining loses for this model and batch"),
            std::string::npos)
      << format_plan(result);

  // With a cap below the whole model's state, replicas cannot run and a pipeline is chosen.
  double state = 0;
  for (const auto& u : costs.units) state += u.state_bytes;
  options.memory_cap = state * 0.8;
  const Plan capped = plan(costs, options);
  EXPECT_TRUE(capped.best().pipelined);
  for (const auto& c : capped.candidates)
    if (!c.pipelined) EXPECT_NE(c.rejected.find("does not fit"), std::string::npos) << c.rejected;
}

TEST(Planner, RanksThatPeakAlikeShowOneFigure) {
  // Eight replicas peak alike: one figure, not eight; pipeline rows keep one per rank.
  PlanOptions options;
  options.num_ranks = 8;
  options.batch_tokens = 8192;
  const Plan result = plan(head_heavy(8), options);
  const std::string table = format_plan(result);
  const PlanCandidate* replicas = nullptr;
  for (const auto& c : result.candidates)
    if (!c.pipelined && c.rejected.empty()) replicas = &c;
  ASSERT_NE(replicas, nullptr) << table;
  const std::string one = bytes_text(replicas->peak_bytes[0]);
  EXPECT_NE(table.find("  " + one + " on each of 8 / whole model on every device"),
            std::string::npos)
      << table;
  EXPECT_EQ(table.find(one + " " + one), std::string::npos) << table;
  const PlanCandidate* pipeline = result.fastest_pipeline();
  ASSERT_NE(pipeline, nullptr);
  EXPECT_NE(
      table.find(bytes_text(pipeline->peak_bytes[0]) + " " + bytes_text(pipeline->peak_bytes[1])),
      std::string::npos)
      << table;
}

// The replicas' all-reduce in k buckets costs what the simulator charges k buckets of one
// stage: k - 1 latencies more than one message, the same bytes.
TEST(Planner, DataParallelBucketsCostWhatTheSimulatorCharges) {
  const int p = 3;
  UnitCosts costs;
  costs.microbatch_tokens = 256;
  UnitCost unit;  // no compute: the step is the all-reduce alone
  unit.parameter_bytes = 1000;
  unit.state_bytes = 4000;
  costs.units = {unit, unit, unit, unit};
  PlanOptions options;
  options.num_ranks = p;
  options.batch_tokens = 256 * p;
  options.allreduce_latency = 1e-3;
  options.allreduce_bandwidth = 1e5;
  auto replicas_step = [&](double bucket_bytes) {
    options.gradient_bucket_bytes = bucket_bytes;
    for (const PlanCandidate& c : plan(costs, options).candidates)
      if (!c.pipelined) return c.step_seconds;
    ADD_FAILURE() << "no data-parallel candidate";
    return 0.0;
  };
  // The planner's ring (2(p-1) steps of a latency and 1/p of the bytes) as the simulator's
  // latency and bandwidth of one all-reduce.
  schedule::CostModel model = schedule::CostModel::uniform(0, 0, 0);
  model.gradient_bytes = {4000.0};
  model.reduce_latency = 2.0 * (p - 1) * options.allreduce_latency;
  model.reduce_bandwidth = options.allreduce_bandwidth * p / (2.0 * (p - 1));
  for (const auto& [bucket_bytes, k] : {std::pair{0.0, 1}, {4000.0, 1}, {1000.0, 4}, {900.0, 5}}) {
    schedule::Schedule s = schedule::generate(ScheduleKind::k1F1B, 1, 1, 1, p);
    schedule::add_gradient_all_reduces(&s, p, {k});
    const double simulated = schedule::simulate(s, model).makespan;
    EXPECT_NEAR(replicas_step(bucket_bytes), simulated, 1e-12 * simulated)
        << bucket_bytes << " bytes a bucket, " << k << " bucket(s)";
  }
  EXPECT_NEAR(replicas_step(1000.0) - replicas_step(0.0), 3 * model.reduce_latency, 1e-12);
}

TEST(Planner, UsesTheTableMeasuredAtEachMicroBatchSize) {
  UnitCosts at_256 = head_heavy(4), at_512 = head_heavy(4);
  at_512.microbatch_tokens = 512;
  for (auto& u : at_512.units) u.forward *= 3, u.backward_input *= 3, u.backward_weight *= 3;
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 2048;
  options.include_data_parallel = false;
  auto step_of = [](const Plan& p, const std::string& layout, int m) {
    for (const auto& c : p.candidates)
      if (c.layout == layout && c.microbatches == m) return c.step_seconds;
    ADD_FAILURE() << "no " << layout << " with " << m << " micro-batches";
    return 0.0;
  };
  options.microbatch_counts = {4, 8};
  const Plan both = plan(std::vector<UnitCosts>{at_256, at_512}, options);
  options.microbatch_counts = {4};
  EXPECT_DOUBLE_EQ(step_of(both, "1f1b", 4), step_of(plan(at_512, options), "1f1b", 4));
  options.microbatch_counts = {8};
  EXPECT_DOUBLE_EQ(step_of(both, "1f1b", 8), step_of(plan(at_256, options), "1f1b", 8));
}

TEST(Planner, DefaultMicroBatchCountsSplitTheBatch) {
  EXPECT_EQ(default_microbatch_counts(2, 4096), (std::vector<int>{2, 4, 8, 16}));
  // 3 does not split 4096: the smallest count up to twice each target that does.
  EXPECT_EQ(default_microbatch_counts(3, 4096), (std::vector<int>{4, 8, 16, 32}));
  EXPECT_EQ(default_microbatch_counts(3, 18), (std::vector<int>{3, 6, 18}));
  EXPECT_EQ(default_microbatch_counts(4, 7), (std::vector<int>{7}));
  EXPECT_EQ(default_microbatch_counts(5, 3), (std::vector<int>{1}));
  // plan() without counts plans those, each splitting the batch.
  PlanOptions options;
  options.num_ranks = 3;
  options.batch_tokens = 4096;
  const Plan result = plan(head_heavy(6), options);
  std::set<int> planned;
  for (const PlanCandidate& c : result.candidates)
    if (c.pipelined) planned.insert(c.microbatches);
  EXPECT_EQ(planned, (std::set<int>{4, 8, 16, 32}));
}

TEST(Planner, BadOptionsAreErrors) {
  PlanOptions options;
  options.batch_tokens = 0;
  EXPECT_THROW(plan(head_heavy(2), options), PlanError);
  UnitCosts costs = head_heavy(2);
  costs.microbatch_tokens = 0;
  options.batch_tokens = 64;
  EXPECT_THROW(plan(costs, options), PlanError);
  // A NaN cap would pass every comparison it is in; a negative or infinite one means nothing.
  for (const double cap : {std::nan(""), -1.0, std::numeric_limits<double>::infinity()}) {
    options.memory_cap = cap;
    EXPECT_THROW(plan(head_heavy(2), options), PlanError) << cap;
  }
  options.memory_cap = 0;
  options.allreduce_bandwidth = std::nan("");
  EXPECT_THROW(plan(head_heavy(2), options), PlanError);
}

// Each of these was taken for something else without a word: one bucket for a NaN or negative
// bucket size, no candidate at all for a count or chunk count that cannot run.
TEST(Planner, OptionsOutsideTheirRangeAreRefusedNamingTheField) {
  const auto refusal = [](const std::function<void(PlanOptions&)>& set) {
    PlanOptions options;
    options.num_ranks = 2;
    options.batch_tokens = 64;
    set(options);
    try {
      plan(head_heavy(2), options);
    } catch (const PlanError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::string bucket =
      "PlanOptions::gradient_bucket_bytes must be a finite number of bytes, at least 0 (0: one "
      "bucket), got ";
  EXPECT_EQ(refusal([](PlanOptions& o) { o.gradient_bucket_bytes = std::nan(""); }),
            bucket + "nan");
  EXPECT_EQ(refusal([](PlanOptions& o) { o.gradient_bucket_bytes = -4096; }), bucket + "-4096");
  EXPECT_EQ(refusal([](PlanOptions& o) {
              o.gradient_bucket_bytes = std::numeric_limits<double>::infinity();
            }),
            bucket + "inf");
  const std::string chunks =
      "PlanOptions::interleaved_chunks must list chunk counts of at least 2 (one chunk per rank "
      "is 1F1B, planned anyway), got ";
  EXPECT_EQ(refusal([](PlanOptions& o) { o.interleaved_chunks = {2, 1}; }), chunks + "1");
  EXPECT_EQ(refusal([](PlanOptions& o) { o.interleaved_chunks = {-3}; }), chunks + "-3");
  const std::string counts =
      "PlanOptions::microbatch_counts must list counts of at least 1 that divide "
      "PlanOptions::batch_tokens (64), got ";
  EXPECT_EQ(refusal([](PlanOptions& o) { o.microbatch_counts = {4, 0}; }), counts + "0");
  EXPECT_EQ(refusal([](PlanOptions& o) { o.microbatch_counts = {-2}; }), counts + "-2");
  EXPECT_EQ(refusal([](PlanOptions& o) { o.microbatch_counts = {4, 6}; }), counts + "6");
  // What the ranges allow plans.
  EXPECT_EQ(refusal([](PlanOptions& o) {
              o.gradient_bucket_bytes = 0;
              o.interleaved_chunks = {2, 4};
              o.microbatch_counts = {1, 4, 64};
            }),
            "(accepted)");
  EXPECT_EQ(refusal([](PlanOptions& o) { o.interleaved_chunks.clear(); }), "(accepted)");
}

}  // namespace
}  // namespace conveyor
