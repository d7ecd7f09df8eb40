// Checkpoints of tensors on a CUDA device: shards written from device memory by concurrent
// rank threads, and loaded into another device kind and stage layout bit for bit; a
// background save writes the pinned host snapshot of its step while training goes on. Every
// test skips without a device.
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "engine/schedule/generators.h"
#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_model.h"
#include "engine/train/trainer_checkpoint.h"
#include "support/executor_fixture.h"
#include "support/train_config.h"
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

// Every tensor a checkpoint of the trainer holds, by global name.
std::map<std::string, std::vector<unsigned char>> trainer_state(Trainer& trainer) {
  std::map<std::string, std::vector<unsigned char>> out;
  for (int r = 0; r < trainer.executor().num_ranks(); ++r)
    for (const NamedTensor& t : rank_checkpoint_tensors(trainer.executor(), r))
      out[t.name] = tensor_bytes(t.tensor);
  return out;
}

// The snapshot is copied from the device into pinned host memory before save() returns, so
// the steps that follow (which overwrite every weight and moment on the device while the
// background thread writes) cannot reach the files of the saved step.
TEST(CheckpointGpu, BackgroundSaveWritesTheDeviceStateOfItsStepWhileTrainingGoesOn) {
  CONVEYOR_REQUIRE_GPU();
  TempDir dir;
  TrainConfig config = small_train_config(2, 1);
  config.device = Device::cuda(0);
  std::map<std::string, std::vector<unsigned char>> at_save, at_end;
  {
    Trainer trainer(config);
    TrainerCheckpointOptions options;
    options.directory = dir.path();
    options.async = true;
    TrainerCheckpointer checkpointer(trainer, options);
    trainer.step();
    trainer.step();
    at_save = trainer_state(trainer);
    checkpointer.save();
    trainer.step();
    trainer.step();
    at_end = trainer_state(trainer);
    checkpointer.finish();
    ASSERT_EQ(checkpointer.last_saved_step(), 4);
  }
  ASSERT_NE(at_save, at_end);
  Trainer saved(config);
  resume_trainer(saved, dir / "step_2");
  EXPECT_EQ(trainer_state(saved), at_save);
  Trainer last(config);
  resume_trainer(last, dir / "step_4");
  EXPECT_EQ(trainer_state(last), at_end);
}

}  // namespace
}  // namespace conveyor
