// Checkpoints of tensors on a CUDA device: shards written from device memory by concurrent
// rank threads, and loaded into another device kind and stage layout bit for bit. Every test
// skips without a device.
#include <gtest/gtest.h>

#include <thread>

#include "engine/schedule/generators.h"
#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_model.h"
#include "support/executor_fixture.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

std::vector<std::pair<std::string, std::vector<unsigned char>>> named_bytes(PipelineExecutor& ex) {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> out;
  for (int r = 0; r < ex.num_ranks(); ++r)
    for (const NamedTensor& t : rank_checkpoint_tensors(ex, r))
      out.emplace_back(t.name, tensor_bytes(t.tensor));
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CheckpointGpu, DeviceStateSavesAndLoadsIntoTheCpuAndBackBitwise) {
  CONVEYOR_REQUIRE_GPU();
  constexpr int kMicrobatches = 2;
  auto gpu = make_executor(schedule::generate_1f1b(2, kMicrobatches), Device::cuda(0));
  for (int step = 1; step <= 2; ++step)
    gpu->run_step(make_microbatches(kMicrobatches, 5, step), 0.1f, step, 1e-2);

  TempDir dir;
  CheckpointWriter writer(dir.path(), 2, gpu->num_ranks());
  std::vector<std::thread> threads;
  for (int r = 0; r < gpu->num_ranks(); ++r)
    threads.emplace_back([&, r] { writer.write_shard(r, rank_checkpoint_tensors(*gpu, r)); });
  for (auto& t : threads) t.join();
  TrainingState state;
  state.step = 2;
  state.model = describe_model(test_model());
  state.model_fingerprint = model_fingerprint(state.model);
  state.stages = stage_placements(
      gpu->schedule(),
      stage_ranges(reference_model(test_model()),
                   partition_blocks(reference_model(test_model()), 2, PartitionSpec::uniform())));
  state.schedule = "1f1b";
  state.microbatches = kMicrobatches;
  state.optimizer_steps = 2;
  writer.commit(state);

  const Checkpoint ckpt = open_checkpoint(dir.path());
  auto cpu = make_executor(schedule::generate_1f1b(1, kMicrobatches));
  ckpt.check_tensors(checkpoint_tensor_specs(*cpu));
  load_rank_checkpoint(ckpt, *cpu, 0);
  EXPECT_EQ(named_bytes(*cpu), named_bytes(*gpu));

  auto gpu_again = make_executor(schedule::generate_1f1b(3, kMicrobatches), Device::cuda(0));
  for (int r = 0; r < gpu_again->num_ranks(); ++r) load_rank_checkpoint(ckpt, *gpu_again, r);
  EXPECT_EQ(named_bytes(*gpu_again), named_bytes(*gpu));
}

}  // namespace
}  // namespace conveyor
