// Checkpoints from an application: train two pipeline stages for a few steps and save,
// read a tensor back by its global name, then resume a one-stage trainer from the checkpoint
// (names are global, so the layout may differ) and check that both continue alike.
// Usage: checkpoint_resume [DIR]   (default: a folder under the system's temp folder)
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "conveyor/engine/conveyor.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  const fs::path dir =
      argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "conveyor_checkpoint_resume";
  fs::remove_all(dir);

  conveyor::TrainConfig config;
  config.model = conveyor::model_preset("tiny");
  config.steps = 6;
  config.batch_tokens = 512;
  config.microbatches = 2;
  config.device = conveyor::Device::cpu();  // bitwise-equal continuations are a CPU promise
  config.stages = 2;

  // Train 3 steps and save: every rank's parameters and optimizer state, by global name.
  conveyor::Trainer first(config);
  for (int s = 0; s < 3; ++s) first.step();
  {
    conveyor::TrainerCheckpointer checkpointer(first, {.directory = dir});
    checkpointer.finish();  // saves step 3 and waits until it is committed
  }

  // Any tensor can be read by its global name, whichever stage held it.
  const conveyor::Checkpoint checkpoint = conveyor::open_checkpoint(dir);  // checks every byte
  std::printf("step %lld: %zu tensors in %zu shards\n", static_cast<long long>(checkpoint.step()),
              checkpoint.tensors().size(), checkpoint.manifest().shards.size());
  const conveyor::CheckpointTensor& last = checkpoint.tensors().back();
  const std::vector<unsigned char> saved = checkpoint.read_bytes(last.name);
  bool same = false;
  for (int rank = 0; rank < config.stages; ++rank)
    for (const conveyor::NamedTensor& live :
         conveyor::rank_checkpoint_tensors(first.executor(), rank))
      if (live.name == last.name)
        same = live.tensor.nbytes() == saved.size() &&
               std::memcmp(live.tensor.raw(), saved.data(), saved.size()) == 0;
  std::printf("%s: %zu bytes, %s the trainer's\n", last.name.c_str(), saved.size(),
              same ? "equal to" : "NOT equal to");

  // Resume on one stage: parameters, optimizer state, step and data position.
  config.stages = 1;
  conveyor::Trainer second(config);
  conveyor::resume_trainer(second, dir);
  bool continues = true;
  while (first.steps_done() < config.steps) {
    const double a = first.step().loss, b = second.step().loss;
    std::printf("step %lld: loss %.6f (2 stages) %.6f (resumed on 1)\n",
                static_cast<long long>(first.steps_done()), a, b);
    continues = continues && a == b;
  }
  return same && continues ? 0 : 1;
}
