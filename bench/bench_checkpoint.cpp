// Checkpoint save and load throughput of a whole training state (weights and AdamW moments,
// all ranks), next to the disk's own sequential write speed measured in the same run.
//   bench_checkpoint [PRESET] [DIR] [STAGES] [--dd-mib=N]
//   defaults: small, ./bench_checkpoint_dir, 1, N the state's size in MiB
// Builds the Trainer of PRESET on the CPU, runs one tiny step (so the optimizer state exists),
// then times, each over the full state:
//   sync save    TrainerCheckpointer::save(): shards written concurrently, fsynced, committed
//   async save   the time training is held (wait + host snapshot), and the time until the
//                background write has committed; plus the step times just before and just
//                after the save (the write competes with the step for cores and memory)
//   load         resume_trainer(): every file and checksum checked, then every rank read
//   dd           zeros written into DIR in 1 MiB writes, then one fsync (dd bs=1M conv=fsync),
//                as many bytes as the state (rounded up to a MiB) or N MiB: the disk's speed
//                for a write of the same size
// Not a Google Benchmark: each figure is one cold operation of about a gigabyte or more.
// Before the first save it checks that DIR's file system has room for what the run writes.
// DIR is removed at the end, so it must be new, empty, or one an earlier run left (it holds
// the file .bench_checkpoint): a folder of the user's is refused, never emptied.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

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
    "usage: bench_checkpoint [PRESET] [DIR] [STAGES] [--dd-mib=N]\n"
    "       (defaults: small, bench_checkpoint_dir, 1, and the state's size in MiB;\n"
    "       DIR is removed at the end: it must be new, empty or left by an earlier run)\n";
constexpr const char* kMarker = ".bench_checkpoint";
constexpr long kMib = 1L << 20;
constexpr long kMaxDdMib = 1L << 30;  // 1 PiB

int bad_input(const std::string& message) {
  std::fprintf(stderr, "bench_checkpoint: %s\n", message.c_str());
  return 2;
}

// A whole number in [min, max] spelled as nothing else, or nothing.
std::optional<long> whole_number(std::string_view text, long min, long max) {
  long value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < min || value > max)
    return std::nullopt;
  return value;
}

// What a run has left in `dir` goes; a folder the user made (empty) stays, and so do the
// folders above `dir` that were there before the run (`first_made` is the outermost one the
// run made, empty when it made none).
void clean_up(const fs::path& dir, bool existed, const fs::path& first_made) {
  std::error_code ec;
  if (existed) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) fs::remove_all(entry.path(), ec);
    return;
  }
  fs::remove_all(dir, ec);
  if (first_made.empty() || first_made == dir) return;
  for (fs::path up = dir.parent_path(); !up.empty(); up = up.parent_path()) {
    if (!fs::remove(up, ec)) return;  // not empty: something else is in it now
    if (up == first_made) return;
  }
}

struct RunResult {
  int status = 0;
  std::string error;  // said on stderr when status is not 0
};

RunResult run(const std::string& preset, const fs::path& dir, int stages,
              std::optional<long> dd_mib);

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string_view> positional;
  std::optional<long> dd_mib;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (arg == "--dd-mib" || arg.starts_with("--dd-mib=")) {
      std::string_view value;
      if (arg.size() > std::strlen("--dd-mib")) {
        value = arg.substr(std::strlen("--dd-mib="));
      } else if (i + 1 < argc) {
        value = argv[++i];
      }
      dd_mib = whole_number(value, 1, kMaxDdMib);
      if (!dd_mib)
        return bad_input("--dd-mib expects a whole number of MiB in [1, " +
                         std::to_string(kMaxDdMib) + "], got '" + std::string(value) + "'");
      continue;
    }
    if (arg.size() > 1 && arg.starts_with('-'))
      return bad_input("unknown flag '" + std::string(arg) +
                       "': the arguments are [PRESET] [DIR] [STAGES] [--dd-mib=N] (--help)");
    positional.push_back(arg);
  }
  if (positional.size() > 3) {
    std::fprintf(stderr, "%s", kUsage);
    return bad_input("expected at most 3 arguments besides --dd-mib, got " +
                     std::to_string(positional.size()));
  }
  const std::string preset(positional.size() > 0 ? positional[0] : "small");
  const fs::path dir(positional.size() > 1 ? positional[1] : "bench_checkpoint_dir");
  if (dir.empty()) return bad_input("DIR expects a folder name, got an empty one");
  int stages = 1;
  if (positional.size() > 2) {
    const auto value = whole_number(positional[2], 1, 1024);
    if (!value)
      return bad_input("STAGES must be a whole number in [1, 1024], got '" +
                       std::string(positional[2]) + "'");
    stages = static_cast<int>(*value);
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
  fs::path first_made;
  for (fs::path p = dir; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    first_made = p;
    if (p == p.parent_path()) break;
  }
  if (!fs::create_directories(dir, ec) && ec) {
    std::fprintf(stderr, "bench_checkpoint: cannot make DIR '%s': %s\n", dir.c_str(),
                 ec.message().c_str());
    clean_up(dir, existed, first_made);
    return 1;
  }
  std::FILE* marker = std::fopen((dir / kMarker).c_str(), "w");
  if (marker == nullptr) {
    std::fprintf(stderr, "bench_checkpoint: cannot write in DIR '%s': %s\n", dir.c_str(),
                 std::strerror(errno));
    clean_up(dir, existed, first_made);
    return 1;
  }
  std::fclose(marker);
  RunResult result;
  try {
    result = run(preset, dir, stages, dd_mib);
  } catch (const std::invalid_argument& e) {
    result = {2, e.what()};  // a layout the preset cannot take, such as more stages than units
  } catch (const std::exception& e) {
    result = {1, std::string("error: ") + e.what()};
  }
  clean_up(dir, existed, first_made);
  if (result.status != 0) std::fprintf(stderr, "bench_checkpoint: %s\n", result.error.c_str());
  return result.status;
}

namespace {

// Zeros in 1 MiB writes, then one fsync: what `dd if=/dev/zero of=FILE bs=1M count=MIB
// conv=fsync` does, timed from the first write to the end of the fsync.
double write_seconds(const fs::path& file, long mib) {
  const std::vector<char> block(kMib, 0);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw std::runtime_error("cannot create '" + file.string() + "': " + std::strerror(errno));
  const auto fail = [&](const char* what) {
    const int error = errno;
    ::close(fd);
    throw std::runtime_error(std::string(what) + " '" + file.string() +
                             "': " + std::strerror(error));
  };
  const auto t = Clock::now();
  for (long i = 0; i < mib; ++i) {
    for (size_t done = 0; done < block.size();) {
      const ssize_t n = ::write(fd, block.data() + done, block.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot write");
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) fail("cannot fsync");
  const double seconds = since(t);
  ::close(fd);
  return seconds;
}

RunResult run(const std::string& preset, const fs::path& dir, int stages,
              std::optional<long> dd_mib) {
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
  const long mib = dd_mib.value_or(std::max(1L, static_cast<long>((bytes + kMib - 1) / kMib)));
  // Each part is removed once measured: at most the three saves (the sync one and the async
  // one with the save finish() adds) at once, then the dd file; 64 MiB more for the manifests
  // and the file system's own blocks.
  const double needed = std::max(3 * bytes, static_cast<double>(mib) * kMib) + 64.0 * kMib;
  std::error_code ec;
  const fs::space_info space = fs::space(dir, ec);
  if (!ec && static_cast<double>(space.available) < needed) {
    const auto gb_text = [](double b) {
      char text[32];
      std::snprintf(text, sizeof text, "%.3f GB", b / 1e9);
      return std::string(text);
    };
    return {1, "DIR '" + dir.string() + "' has " + gb_text(static_cast<double>(space.available)) +
                   " free, and the run needs about " + gb_text(needed) +
                   " there (the larger of 3 saves of the " + gb_text(bytes) + " state and " +
                   gb_text(static_cast<double>(mib) * kMib) + " of dd, and 64 MiB to spare)"};
  }
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
  fs::remove_all(dir / "async");
  {
    const auto t = Clock::now();
    resume_trainer(trainer, dir / "sync");
    const double load = since(t);
    std::printf("load        %.2f s  %.2f GB/s (check every file and checksum, then read)\n", load,
                gb / load);
  }
  fs::remove_all(dir / "sync");
  const fs::path dd_file = dir / "dd.bin";
  const double dd_seconds = write_seconds(dd_file, mib);
  fs::remove(dd_file);
  const double dd_gb = static_cast<double>(mib) * kMib / 1e9;
  std::printf(
      "dd          %.2f s  %.2f GB/s (%ld MiB of zeros in 1 MiB writes, then one fsync: "
      "dd bs=1M conv=fsync)\n",
      dd_seconds, dd_gb / dd_seconds, mib);
  return {};
}

}  // namespace
