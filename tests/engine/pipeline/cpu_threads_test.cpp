// CPU ranks with several kernel threads each: kernels split work by output ranges whose bounds
// depend on the shapes only, so a pipeline run with 2 threads per rank gives bitwise the
// one-stage run, at 2 threads and at 1. And a step in the steady state takes no memory
// from the system: on one rank every tensor after the first step is served from the
// allocator's cache; on two, the cache only grows to a high-water mark.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <vector>

#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// Large enough that every GEMM, layernorm and activation splits into several tasks.
ModelConfig threaded_model() {
  ModelConfig c;
  c.preset = "test";
  c.d_model = 64;
  c.n_layers = 2;
  c.vocab = 67;
  c.hidden = 256;
  return c;
}

constexpr int kTokens = 640;  // per micro-batch

std::unique_ptr<PipelineExecutor> make_threaded_executor(int stages, int m, int threads) {
  const ModelDescription model = reference_model(threaded_model());
  schedule::Schedule sched = schedule::generate_1f1b(stages, m);
  auto ranges = stage_ranges(model, partition_blocks(model, stages, PartitionSpec::uniform()));
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  options.device_options.cpu_threads = threads;
  OptimizerConfig optimizer;
  optimizer.lr = 1e-2;
  optimizer.clip_norm = 0.5;
  std::vector<Device> devices(stages, Device::cpu());
  return std::make_unique<PipelineExecutor>(model, std::move(sched), std::move(ranges),
                                            std::move(devices), optimizer, /*seed=*/23, options);
}

std::vector<MicroBatchData> microbatches(int m, int step) {
  std::vector<MicroBatchData> out(m);
  for (int mb = 0; mb < m; ++mb) {
    out[mb].tokens = random_ints(kTokens, 300 * step + mb, 0, 66);
    out[mb].targets = random_ints(kTokens, 700 * step + mb, 0, 66);
  }
  return out;
}

struct Record {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> values;
};

Record run_steps(PipelineExecutor& ex, int m, int steps) {
  Record rec;
  for (int step = 1; step <= steps; ++step) {
    auto result = ex.run_step(microbatches(m, step), 1.0f / (m * kTokens), step, 1e-2);
    rec.losses.push_back(result.loss_sum);
    rec.norms.push_back(result.grad_norm);
  }
  for (Parameter* p : ex.parameters()) rec.values.push_back(to_vector_f32(p->value));
  return rec;
}

void expect_same_bits(const Record& a, const Record& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "loss of step " << i + 1;
    EXPECT_EQ(a.norms[i], b.norms[i]) << "gradient norm of step " << i + 1;
  }
  ASSERT_EQ(a.values.size(), b.values.size());
  for (size_t i = 0; i < a.values.size(); ++i)
    EXPECT_EQ(a.values[i], b.values[i]) << "parameter " << i;
}

TEST(CpuThreads, TwoStagePipelineWithTwoThreadsPerRankIsBitwiseTheOneStageRun) {
  const int m = 4;
  auto one_stage = make_threaded_executor(1, m, 2);
  ASSERT_EQ(one_stage->context(0).cpu_pool()->threads(), 2);
  const Record reference = run_steps(*one_stage, m, 2);
  auto pipeline = make_threaded_executor(2, m, 2);
  expect_same_bits(reference, run_steps(*pipeline, m, 2));
  // The split does not depend on the thread count either.
  auto single_thread = make_threaded_executor(1, m, 1);
  expect_same_bits(reference, run_steps(*single_thread, m, 2));
}

// One rank: every step makes the same requests in the same order, so after the first step
// every tensor comes from the cache.
TEST(CpuThreads, SteadyStateStepTakesNoMemoryFromTheSystem) {
  const int m = 3;
  auto ex = make_threaded_executor(1, m, 2);
  (void)ex->run_step(microbatches(m, 1), 1.0f / (m * kTokens), 1, 1e-2);
  const AllocatorStats after_first = ex->context(0).allocator().stats();
  for (int step = 2; step <= 3; ++step)
    (void)ex->run_step(microbatches(m, step), 1.0f / (m * kTokens), step, 1e-2);
  const AllocatorStats now = ex->context(0).allocator().stats();
  EXPECT_EQ(now.system_allocations, after_first.system_allocations) << now.to_string();
  EXPECT_LE(now.reserved_bytes, after_first.reserved_bytes);
  EXPECT_GT(now.requests, after_first.requests) << "allocated nothing";
}

// Two ranks: a receive is taken as soon as its message is there, so how long its buffer is
// held next to the others depends on when the message arrives, and an arrival order not seen
// before (on a loaded machine, late) can still raise the cache's high-water mark. What must
// hold is that it is a high-water mark: after a warm-up, fewer new blocks than steps (no
// per-step allocation), and never more than one step's received buffers above the warm-up.
TEST(CpuThreads, TwoRankSteadyStateTakesNoPerStepMemoryFromTheSystem) {
  const int m = 3, stages = 2, kWarmUp = 4, kMeasured = 8;
  auto ex = make_threaded_executor(stages, m, 2);
  for (int step = 1; step <= kWarmUp; ++step)
    (void)ex->run_step(microbatches(m, step), 1.0f / (m * kTokens), step, 1e-2);
  std::vector<AllocatorStats> after_warm_up;
  for (int r = 0; r < stages; ++r) after_warm_up.push_back(ex->context(r).allocator().stats());
  for (int step = kWarmUp + 1; step <= kWarmUp + kMeasured; ++step)
    (void)ex->run_step(microbatches(m, step), 1.0f / (m * kTokens), step, 1e-2);
  // Each rank receives m activations or m gradients of kTokens x d_model floats per step.
  const size_t received_per_step =
      static_cast<size_t>(m) * kTokens * static_cast<size_t>(threaded_model().d_model) * 4;
  for (int r = 0; r < stages; ++r) {
    const AllocatorStats now = ex->context(r).allocator().stats();
    EXPECT_LT(now.system_allocations - after_warm_up[r].system_allocations,
              static_cast<size_t>(kMeasured))
        << "rank " << r << ": " << now.to_string();
    EXPECT_LE(now.reserved_bytes, after_warm_up[r].reserved_bytes + received_per_step)
        << "rank " << r;
    EXPECT_GT(now.requests, after_warm_up[r].requests) << "rank " << r << " allocated nothing";
  }
}

}  // namespace
}  // namespace conveyor
