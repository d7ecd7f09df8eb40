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
// DIR is removed at the end, so it must be new, empty, or one an earlier run left (it holds
// the file .bench_checkpoint): a folder of the user's is refused, never emptied.
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>

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

constexpr const char* kUsage =
    "usage: bench_checkpoint [PRESET] [DIR] [STAGES]  (defaults: small, bench_checkpoint_dir, 1;\n"
    "       DIR is removed at the end: it must be new, empty or left by an earlier run)\n";
constexpr const char* kMarker = ".bench_checkpoint";

int bad_input(const std::string& message) {
  std::fprintf(stderr, "bench_checkpoint: %s\n", message.c_str());
  return 2;
}

// A shell word that stands for `text` alone, whatever it holds.
std::string shell_quoted(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int run(const std::string& preset, const fs::path& dir, int stages);

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (argc > 4) {
    std::fprintf(stderr, "%s", kUsage);
    return bad_input("expected at most 3 arguments, got " + std::to_string(argc - 1));
  }
  const std::string preset = argc > 1 ? argv[1] : "small";
  const fs::path dir = argc > 2 ? argv[2] : "bench_checkpoint_dir";
  int stages = 1;
  if (argc > 3) {
    const std::string_view text = argv[3];
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), stages);
    if (error != std::errc() || end != text.data() + text.size() || stages < 1 || stages > 1024)
      return bad_input("STAGES must be a whole number in [1, 1024], got '" + std::string(text) +
                       "'");
  }
  try {
    conveyor::model_preset(preset);
  } catch (const std::invalid_argument& e) {
    return bad_input(e.what());
  }
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  if (existed) {
    if (!fs::is_directory(dir, ec))
      return bad_input("DIR '" + dir.string() + "' exists and is not a folder");
    if (!fs::is_empty(dir, ec) && !fs::exists(dir / kMarker, ec))
      return bad_input("DIR '" + dir.string() +
                       "' already holds files this benchmark did not write, and it removes DIR "
                       "at the end: give a new or empty folder");
  }
  try {
    fs::create_directories(dir);
    std::FILE* marker = std::fopen((dir / kMarker).c_str(), "w");
    if (marker == nullptr) return bad_input("cannot write in DIR '" + dir.string() + "'");
    std::fclose(marker);
    const int status = run(preset, dir, stages);
    // A folder the user made (empty) stays; what the run wrote goes.
    if (existed) {
      for (const auto& entry : fs::directory_iterator(dir)) fs::remove_all(entry.path());
    } else {
      fs::remove_all(dir);
    }
    return status;
  } catch (const std::invalid_argument& e) {
    if (!existed) fs::remove_all(dir, ec);
    return bad_input(e.what());  // a layout the preset cannot take, such as more stages than units
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: error: %s\n", e.what());
    return 1;
  }
}

namespace {

int run(const std::string& preset, const fs::path& dir, int stages) {
  using namespace conveyor;
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
  const std::string dd = "dd if=/dev/zero of=" + shell_quoted((dir / "dd.bin").string()) +
                         " bs=1M count=1024 conv=fsync 2>&1 | tail -1";
  std::printf("dd          ");
  std::fflush(stdout);
  if (std::system(dd.c_str()) != 0) std::printf("dd failed\n");
  return 0;
}

}  // namespace
