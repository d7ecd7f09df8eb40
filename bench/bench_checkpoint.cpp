// Checkpoint save and load throughput of a whole training state (weights and AdamW moments,
// all ranks), next to the disk's own sequential write speed measured in the same run.
//   bench_checkpoint [PRESET] [DIR] [STAGES]   defaults: small, ./bench_checkpoint_dir, 1
// Builds the Trainer of PRESET on the CPU, runs one tiny step (so the optimizer state exists),
// then times, each over the full state:
//   sync save    TrainerCheckpointer::save(): shards written concurrently, fsynced, committed
//   async save   the time training is held (wait + host snapshot), and the time until the
//                background write has committed; plus the step times just before and just
//                after the save (the write competes with the step for cores and memory)
//   load         resume_trainer(): every file and checksum checked, then every rank read
//   dd           dd if=/dev/zero bs=1M count=1024 conv=fsync into DIR, for the disk's speed
// Not a Google Benchmark: each figure is one cold operation of about a gigabyte or more.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "engine/train/checkpoint_model.h"
#include "engine/train/trainer_checkpoint.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double step_seconds(conveyor::Trainer& trainer) {
  const auto t = Clock::now();
  trainer.step();
  return since(t);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace conveyor;
  const std::string preset = argc > 1 ? argv[1] : "small";
  const fs::path dir = argc > 2 ? argv[2] : "bench_checkpoint_dir";
  const int stages = argc > 3 ? std::atoi(argv[3]) : 1;
  fs::remove_all(dir);

  TrainConfig config;
  config.model = model_preset(preset);
  config.device = Device::cpu();
  config.steps = 100;
  config.batch_tokens = 32;
  config.microbatches = 1;
  config.stages = stages;
  Trainer trainer(config);
  const double first_step = step_seconds(trainer);
  double bytes = 0;
  for (int r = 0; r < trainer.executor().num_ranks(); ++r)
    for (const NamedTensor& t : rank_checkpoint_tensors(trainer.executor(), r))
      bytes += static_cast<double>(t.tensor.nbytes());
  const double gb = bytes / 1e9;
  std::printf("model %s, %d stage(s), state %.3f GB (weights + AdamW moments), step %.2f s\n",
              trainer.model().name.c_str(), stages, gb, first_step);

  {
    TrainerCheckpointOptions sync_options;
    sync_options.directory = dir / "sync";
    TrainerCheckpointer sync(trainer, sync_options);
    const double before = step_seconds(trainer);
    const auto t = Clock::now();
    sync.save();
    const double save = since(t);
    const double after = step_seconds(trainer);
    std::printf("sync save   %.2f s  %.2f GB/s | steps around it %.2f s, %.2f s; held %.2f s\n",
                save, gb / save, before, after, sync.last_stall_seconds());
  }
  {
    TrainerCheckpointOptions async_options;
    async_options.directory = dir / "async";
    async_options.async = true;
    TrainerCheckpointer async(trainer, async_options);
    const double before = step_seconds(trainer);
    const auto t = Clock::now();
    async.save();
    const double held = since(t);
    const double after = step_seconds(trainer);
    async.finish();  // also saves the step just taken: wait for the first save only
    const double total = since(t);
    std::printf(
        "async save  held %.2f s (snapshot %.2f GB/s) | steps around it %.2f s, %.2f s | "
        "until committed (two saves) %.2f s\n",
        held, gb / held, before, after, total);
  }
  {
    const auto t = Clock::now();
    resume_trainer(trainer, dir / "sync");
    const double load = since(t);
    std::printf("load        %.2f s  %.2f GB/s (check every file and checksum, then read)\n", load,
                gb / load);
  }
  const std::string dd = "dd if=/dev/zero of=" + (dir / "dd.bin").string() +
                         " bs=1M count=1024 conv=fsync 2>&1 | tail -1";
  std::printf("dd          ");
  std::fflush(stdout);
  if (std::system(dd.c_str()) != 0) std::printf("dd failed\n");
  fs::remove_all(dir);
  return 0;
}
