// Checkpoints from an application: train two pipeline stages for a few steps and save,
// read a tensor back by its global name, then resume a one-stage trainer from the checkpoint
// (names are global, so the layout may differ) and check that both continue alike.
// Usage: checkpoint_resume [DIR]   (default: a folder under the system's temp folder)
// DIR is removed and made anew, so it must be new, empty or one an earlier run made.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "conveyor/engine/conveyor.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  const char* const usage = "usage: checkpoint_resume [DIR] (DIR is removed and made anew)\n";
  if (argc == 2 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (argc > 2) {
    std::fprintf(stderr, "checkpoint_resume: takes at most one folder, got %d arguments; %s",
                 argc - 1, usage);
    return 2;
  }
  const fs::path dir =
      argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "conveyor_checkpoint_resume";
  // A folder given by mistake (the current one, a home folder) must not be emptied: only an
  // empty one or one this example made is taken, which holds its marker or, from a version
  // before the marker, just the step-3 checkpoint.
  const std::string marker = ".conveyor_checkpoint_resume";
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(dir, ec);
  if (fs::exists(status)) {
    if (!fs::is_directory(status)) {
      std::fprintf(stderr,
                   "checkpoint_resume: '%s' exists and is not a folder (a link is not "
                   "followed); give a new or empty folder\n",
                   dir.c_str());
      return 2;
    }
    bool ours = true;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      ours = ours && (name == marker || name == "latest" || name == "step_3");
    }
    if (ec || !ours) {
      std::fprintf(stderr,
                   "checkpoint_resume: folder '%s' already holds files this example did not "
                   "write, and it removes the folder it is given; give a new or empty folder\n",
                   dir.c_str());
      return 2;
    }
  }
  try {
    fs::remove_all(dir);
    fs::create_directories(dir);
  } catch (const fs::filesystem_error& e) {
    std::fprintf(stderr, "checkpoint_resume: cannot make folder '%s' anew: %s\n", dir.c_str(),
                 e.code().message().c_str());
    return 2;
  }
  std::ofstream(dir / marker).put('\n');

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
