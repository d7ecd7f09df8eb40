// The data-parallel row's memory against the check before a run: a replica the planner says
// fits a cap is one `train --stages 1 --dp P` with its micro-batches runs within that cap, as
// estimate_rank_memory counts it (the backward's output gradients and the largest workspace
// included), for whole and sharded optimizer states.
#include <gtest/gtest.h>

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

  // What the check before `train --stages 1 --dp 2 --microbatches 2m` holds each replica to,
  // m micro-batches of its tokens in a one-rank 1F1B.
  auto checked = [&](int m, bool sharded) {
    RankMemoryEstimate e = estimate_rank_memory(
        model, {{0, model.num_units}}, schedule::generate(schedule::ScheduleKind::k1F1B, 1, m),
        "adamw", kReplicaTokens / m)[0];
    if (sharded) e.optimizer_bytes /= kRanks;
    return e.total();
  };

  PlanOptions options;
  options.num_ranks = kRanks;
  options.batch_tokens = kBatch;
  const double whole = checked(1, false);
  // Caps just above what the check counts for one and for two micro-batches, and caps a
  // hundredth below it, which the replicas must not be planned into.
  for (const double cap : {whole * 1.001, whole * 0.99, checked(2, false) * 1.001,
                           checked(2, false) * 0.99, checked(4, true) * 1.001}) {
    SCOPED_TRACE("cap " + bytes_text(cap) + " (" + std::to_string(cap) + " B)");
    options.memory_cap = cap;
    const Plan planned = plan(tables, options);
    int replica_rows = 0;
    for (const PlanCandidate& c : planned.candidates) {
      if (c.pipelined) continue;
      ++replica_rows;
      if (!c.rejected.empty()) continue;
      ASSERT_EQ(c.peak_bytes.size(), static_cast<size_t>(kRanks));
      const double needed = checked(c.microbatches, c.shard_optimizer);
      EXPECT_LE(needed, cap) << c.layout << (c.shard_optimizer ? " sharded" : "") << ", m "
                             << c.microbatches << ": planned " << bytes_text(c.peak_bytes[0]);
      EXPECT_NEAR(c.peak_bytes[0], needed, 1e-6 * needed)
          << c.layout << (c.shard_optimizer ? " sharded" : "") << ", m " << c.microbatches;
    }
    EXPECT_GT(replica_rows, 0);
  }
}

}  // namespace
}  // namespace conveyor
