// The data-parallel row's memory against the check before a run: a replica the planner says
// fits a cap is one `train --stages 1 --dp P` with its micro-batches runs within that cap, as
// estimate_replica_memory counts it (the backward's output gradients and the largest workspace
// included), for whole and sharded optimizer states.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/generators.h"
#include "layers/model.h"

namespace conveyor {
namespace {

TEST(PlannerReplicaMemory, AReplicaThatFitsPassesTheCheckBeforeTheRun) {
  ModelConfig config = model_preset("tiny");
  config.d_model = 32;
  config.hidden = 128;
  config.vocab = 256;
  config.n_layers = 4;
  const ModelDescription model = reference_model(config);
  constexpr int kRanks = 2;
  constexpr int64_t kBatch = 256, kReplicaTokens = kBatch / kRanks;

  // A table at each micro-batch size a replica may run, as `conveyor plan` profiles them:
  // small tensors round up, so a table does not scale down to a smaller micro-batch exactly.
  std::vector<UnitCosts> tables;
  for (int64_t tokens = kReplicaTokens; tokens >= 1; tokens /= 2) {
    UnitCosts& costs = tables.emplace_back();
    costs.microbatch_tokens = tokens;
    costs.units = described_unit_costs(model, tokens, "adamw");
    for (UnitCost& u : costs.units)
      u.forward = u.backward_input = u.backward_weight = 1e-6 * tokens;
  }

  // What the check before `train --stages 1 --dp 2 --microbatches 2m` holds replica d to, m
  // micro-batches of its tokens in a one-rank 1F1B; sharded, its pieces of the optimizer state.
  auto checked = [&](int m, bool sharded, int d) {
    return estimate_replica_memory(model, {{0, model.num_units}},
                                   schedule::generate(schedule::ScheduleKind::k1F1B, 1, m), "adamw",
                                   kReplicaTokens / m, kRanks, sharded)[d]
        .total();
  };
  // The most any replica needs: the pieces of one replica may take more than another's.
  auto most = [&](int m, bool sharded) {
    double bytes = 0;
    for (int d = 0; d < kRanks; ++d) bytes = std::max(bytes, checked(m, sharded, d));
    return bytes;
  };

  PlanOptions options;
  options.num_ranks = kRanks;
  options.batch_tokens = kBatch;
  const double whole = most(1, false);
  double least_whole = whole;
  for (int m = 2; m <= kReplicaTokens; m *= 2) least_whole = std::min(least_whole, most(m, false));
  // The least sharded replicas need at any micro-batch count, and what they would need were
  // their pieces of the optimizer state each half the whole: the allocator rounds up the
  // pieces of the small parameters' moments on their own, to more than that.
  double sharded = std::numeric_limits<double>::infinity(), halved = sharded;
  for (int m = 1; m <= kReplicaTokens; m *= 2) {
    sharded = std::min(sharded, most(m, true));
    const RankMemoryEstimate e = estimate_rank_memory(
        model, {{0, model.num_units}}, schedule::generate(schedule::ScheduleKind::k1F1B, 1, m),
        "adamw", kReplicaTokens / m)[0];
    halved = std::min(halved, e.total() - e.optimizer_bytes / kRanks);
  }
  ASSERT_GT(sharded, halved);
  ASSERT_LT(sharded, least_whole);
  // Caps just above what the check counts for one and for two micro-batches, and caps a
  // hundredth below it, which the replicas must not be planned into; a byte above and below
  // the least sharded replicas need, which only sharded replicas fit, or none.
  for (const double cap : {whole * 1.001, whole * 0.99, most(2, false) * 1.001,
                           most(2, false) * 0.99, sharded + 1, sharded - 1}) {
    SCOPED_TRACE("cap " + bytes_text(cap) + " (" + std::to_string(cap) + " B)");
    options.memory_cap = cap;
    const Plan planned = plan(tables, options);
    int replica_rows = 0;
    bool sharded_planned = false;
    for (const PlanCandidate& c : planned.candidates) {
      if (c.pipelined) continue;
      ++replica_rows;
      if (!c.rejected.empty()) continue;
      sharded_planned |= c.shard_optimizer;
      ASSERT_EQ(c.peak_bytes.size(), static_cast<size_t>(kRanks));
      for (int d = 0; d < kRanks; ++d) {
        const double needed = checked(c.microbatches, c.shard_optimizer, d);
        EXPECT_LE(needed, cap) << c.layout << (c.shard_optimizer ? " sharded" : "") << ", m "
                               << c.microbatches << ": planned " << bytes_text(c.peak_bytes[d]);
        EXPECT_NEAR(c.peak_bytes[d], needed, 1e-6 * needed)
            << c.layout << (c.shard_optimizer ? " sharded" : "") << ", m " << c.microbatches
            << ", replica " << d;
      }
    }
    EXPECT_GT(replica_rows, 0);
    EXPECT_EQ(sharded_planned, cap == sharded + 1);
  }
}

}  // namespace
}  // namespace conveyor
