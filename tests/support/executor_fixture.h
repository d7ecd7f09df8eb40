#pragma once
// What the executor tests share: a small model that can be cut into up to 8 stages, its
// optimizer, seeded micro-batches, executors on given devices, and a two-step run record.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/pipeline/executor.h"
#include "support/test_util.h"

namespace conveyor::testing {

inline ModelConfig test_model() {
  ModelConfig c;
  c.preset = "test";
  c.d_model = 16;
  c.n_layers = 6;  // up to 8 stages: embedding + 6 blocks + head
  c.vocab = 19;
  c.hidden = 24;
  return c;
}

inline OptimizerConfig test_optimizer() {
  OptimizerConfig o;
  o.lr = 1e-2;
  o.clip_norm = 0.5;  // active: the clipping factor must match too
  return o;
}

inline std::vector<MicroBatchData> make_microbatches(int m, int n, int step) {
  std::vector<MicroBatchData> out(m);
  for (int mb = 0; mb < m; ++mb) {
    out[mb].tokens = random_ints(n, 1000 * step + mb, 0, 18);
    out[mb].targets = random_ints(n, 5000 * step + mb, 0, 18);
  }
  return out;
}

// Rank r on devices[r]; blocks per stage from `partition`.
inline std::unique_ptr<PipelineExecutor> make_executor(
    schedule::Schedule sched, std::vector<Device> devices,
    const PartitionSpec& partition = PartitionSpec::uniform(),
    const OptimizerConfig& optimizer = test_optimizer(),
    const RecomputeSpec& recompute = RecomputeSpec::none()) {
  const ModelDescription model = reference_model(test_model());
  auto ranges = stage_ranges(model, partition_blocks(model, sched.num_stages(), partition));
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  options.recompute = recompute;
  return std::make_unique<PipelineExecutor>(model, std::move(sched), std::move(ranges),
                                            std::move(devices), optimizer, /*seed=*/17, options);
}

// Every rank (of every data-parallel replica) on `device`.
inline std::unique_ptr<PipelineExecutor> make_executor(schedule::Schedule sched,
                                                       Device device = Device::cpu()) {
  std::vector<Device> devices(static_cast<size_t>(sched.num_ranks()) * sched.replicas, device);
  return make_executor(std::move(sched), std::move(devices));
}

struct RunRecord {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> grads, values;  // after the second step
};

// Two optimizer steps at rate `lr` over seeded micro-batches of 5 tokens (an odd count, so
// every micro-batch's rows sit at an odd 4-byte offset in the step's [m, 5] id tensors).
inline RunRecord run_two_steps(PipelineExecutor& ex, int m, double lr = 1e-2) {
  constexpr int kTokens = 5;
  RunRecord rec;
  for (int step = 1; step <= 2; ++step) {
    auto result = ex.run_step(make_microbatches(m, kTokens, step), 1.0f / (m * kTokens), step, lr);
    rec.losses.push_back(result.loss_sum);
    rec.norms.push_back(result.grad_norm);
  }
  for (Parameter* p : ex.parameters()) {
    rec.grads.push_back(to_vector_f32(p->grad));
    rec.values.push_back(to_vector_f32(p->value));
  }
  return rec;
}

}  // namespace conveyor::testing
