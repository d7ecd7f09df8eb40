// Pipeline x data parallelism on CUDA: replicas whose ranks share cuda:0 (own streams and
// contexts, in-process transport, gradients through the host). With the optimizer state
// sharded (a reduce-scatter of the gradients, a gather of the weights) the losses, norms and
// weights are bitwise those of the unsharded run, as on the CPU: the pieces' norms and the
// AdamW update run the same kernels on the same elements.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "support/executor_fixture.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

std::unique_ptr<PipelineExecutor> make_gpu_executor(schedule::Schedule sched, bool shard) {
  const ModelDescription model = reference_model(test_model());
  auto ranges =
      stage_ranges(model, partition_blocks(model, sched.num_stages(), PartitionSpec::uniform()));
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  options.shard_optimizer = shard;
  std::vector<Device> devices(static_cast<size_t>(sched.num_ranks()) * sched.replicas,
                              Device::cuda(0));
  return std::make_unique<PipelineExecutor>(model, std::move(sched), std::move(ranges),
                                            std::move(devices), test_optimizer(), 17, options);
}

TEST(DataParallelGpu, ShardedWeightsAreBitwiseThoseOfTheUnshardedRun) {
  CONVEYOR_REQUIRE_GPU();
  constexpr int kTokens = 5;
  for (int replicas : {2, 3}) {
    SCOPED_TRACE("replicas " + std::to_string(replicas));
    const int total = 2 * replicas;
    auto plain = make_gpu_executor(
        schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, replicas), false);
    auto sharded = make_gpu_executor(
        schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, replicas), true);
    for (int step = 1; step <= 3; ++step) {
      const auto batch = make_microbatches(total, kTokens, step);
      const auto a = plain->run_step(batch, 1.0f / (total * kTokens), step, 1e-2);
      const auto b = sharded->run_step(batch, 1.0f / (total * kTokens), step, 1e-2);
      EXPECT_EQ(a.loss_sum, b.loss_sum) << "step " << step;
      EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
    }
    for (int r = 0; r < plain->num_world_ranks(); ++r) {
      const auto want = plain->rank_parameters(r), got = sharded->rank_parameters(r);
      ASSERT_EQ(want.size(), got.size());
      for (size_t i = 0; i < want.size(); ++i) {
        const auto w = to_vector_f32(want[i]->value), g = to_vector_f32(got[i]->value);
        ASSERT_EQ(w.size(), g.size());
        EXPECT_EQ(std::memcmp(w.data(), g.data(), w.size() * sizeof(float)), 0)
            << "rank " << r << " " << want[i]->name;
      }
    }
  }
}

}  // namespace
}  // namespace conveyor
