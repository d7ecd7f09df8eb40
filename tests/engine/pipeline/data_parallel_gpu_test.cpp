// Pipeline x data parallelism on CUDA: replicas whose ranks share cuda:0 (own streams and
// contexts, in-process transport, gradients through the host). With the optimizer state
// sharded (a reduce-scatter of the gradients, a gather of the weights) the losses, norms and
// weights are bitwise those of the unsharded run, as on the CPU: the pieces' norms and the
// AdamW update run the same kernels on the same elements. Over NCCL (one GPU per rank, two
// or more), the group calls give the in-process transport's bits on the same devices.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "support/executor_fixture.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// Rank r on cuda:0, or with `spread` on cuda:r, over `transport`.
std::unique_ptr<PipelineExecutor> make_gpu_executor(schedule::Schedule sched, bool shard,
                                                    TransportKind transport = TransportKind::kAuto,
                                                    bool spread = false) {
  const ModelDescription model = reference_model(test_model());
  auto ranges =
      stage_ranges(model, partition_blocks(model, sched.num_stages(), PartitionSpec::uniform()));
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  options.shard_optimizer = shard;
  options.transport = transport;
  std::vector<Device> devices(static_cast<size_t>(sched.num_ranks()) * sched.replicas,
                              Device::cuda(0));
  if (spread)
    for (size_t r = 0; r < devices.size(); ++r) devices[r] = Device::cuda(static_cast<int>(r));
  return std::make_unique<PipelineExecutor>(model, std::move(sched), std::move(ranges),
                                            std::move(devices), test_optimizer(), 17, options);
}

// Three steps of both on the same micro-batches (`total` of them per step): the same losses and
// norms, and then the same weights on every rank, bit for bit.
void expect_same_steps(PipelineExecutor& want_run, PipelineExecutor& got_run, int total) {
  constexpr int kTokens = 5;
  for (int step = 1; step <= 3; ++step) {
    const auto batch = make_microbatches(total, kTokens, step);
    const auto a = want_run.run_step(batch, 1.0f / (total * kTokens), step, 1e-2);
    const auto b = got_run.run_step(batch, 1.0f / (total * kTokens), step, 1e-2);
    EXPECT_EQ(a.loss_sum, b.loss_sum) << "step " << step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
  }
  for (int r = 0; r < want_run.num_world_ranks(); ++r) {
    const auto want = want_run.rank_parameters(r), got = got_run.rank_parameters(r);
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const auto w = to_vector_f32(want[i]->value), g = to_vector_f32(got[i]->value);
      ASSERT_EQ(w.size(), g.size());
      EXPECT_EQ(std::memcmp(w.data(), g.data(), w.size() * sizeof(float)), 0)
          << "rank " << r << " " << want[i]->name;
    }
  }
}

TEST(DataParallelGpu, ShardedWeightsAreBitwiseThoseOfTheUnshardedRun) {
  CONVEYOR_REQUIRE_GPU();
  for (int replicas : {2, 3}) {
    SCOPED_TRACE("replicas " + std::to_string(replicas));
    const int total = 2 * replicas;
    auto plain = make_gpu_executor(
        schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, replicas), false);
    auto sharded = make_gpu_executor(
        schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, replicas), true);
    expect_same_steps(*plain, *sharded, total);
  }
}

// (1, 2) with two GPUs, and (2, 2) with four: every rank on a GPU of its own, sharded and not.
TEST(DataParallelGpu, OverNcclTheRunIsBitwiseTheInProcessOne) {
  CONVEYOR_REQUIRE_GPU();
  if (cuda_device_count() < 2)
    GTEST_SKIP() << "data parallelism over NCCL needs a GPU per rank, two or more; found "
                 << cuda_device_count();
  const int stages = cuda_device_count() >= 4 ? 2 : 1;
  constexpr int kReplicas = 2;
  const int total = 2 * kReplicas;
  for (bool shard : {false, true}) {
    SCOPED_TRACE(shard ? "sharded" : "not sharded");
    auto make = [&](TransportKind kind) {
      return make_gpu_executor(
          schedule::generate(schedule::ScheduleKind::k1F1B, stages, 2, 1, kReplicas), shard, kind,
          /*spread=*/true);
    };
    auto reference = make(TransportKind::kInProcess);
    auto nccl = make(TransportKind::kNccl);
    ASSERT_TRUE(nccl->uses_nccl());
    expect_same_steps(*reference, *nccl, total);
  }
}

}  // namespace
}  // namespace conveyor
