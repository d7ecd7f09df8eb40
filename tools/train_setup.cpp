// What `conveyor train` checks and arranges before its first step (train_setup.h).
#include "tools/train_setup.h"

#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/core/number_text.h"
#include "tools/cli_common.h"
#include "tools/output_file.h"

namespace conveyor::cli {
namespace {

// Whether `path` is checkpoint folder `root` itself or a name its checkpoints own there
// (`latest`, step_<N>, step_<N>.tmp, step_<N>.removing and what they hold). Other files in the
// folder, such as a log kept next to the checkpoints, are the user's.
bool in_checkpoint_layout(const std::string& path, const std::string& root) {
  const std::filesystem::path rel = resolved_path(path).lexically_relative(resolved_path(root));
  if (rel.empty()) return false;
  if (rel == ".") return true;
  const std::string first = rel.begin()->string();
  return first == "latest" || first.rfind("step_", 0) == 0;
}

}  // namespace

void refuse_outputs_over_inputs(const TrainFlags& f) {
  const std::vector<std::pair<const char*, const std::string*>> outputs = {
      {"--log-json", &f.log_json}, {"--trace", &f.trace}};
  const std::vector<std::pair<const char*, const std::string*>> inputs = {
      {"--data", &f.config.data_path},
      {"--schedule-file", &f.config.schedule_file},
      {"--plan", &f.plan_file}};
  // --resume DIR/latest or DIR/step_<N>: the checkpoints of DIR.
  std::string resumed = f.checkpoint.resume == "latest" ? "" : f.checkpoint.resume;
  if (!resumed.empty()) {
    const std::string name = resolved_path(resumed).filename().string();
    if (name == "latest" || name.rfind("step_", 0) == 0)
      resumed = resolved_path(resumed).parent_path().string();
  }
  // (flag, its value as given, the checkpoint folder it names)
  const std::vector<std::tuple<const char*, const std::string*, std::string>> checkpoints = {
      {"--save-dir", &f.checkpoint.save_dir, f.checkpoint.save_dir},
      {"--resume", &f.checkpoint.resume, resumed}};
  // A save replaces its step_<N> folder whole and --keep removes old ones: a file the run
  // reads from inside them would be lost with them.
  for (const auto& [input, input_path] : inputs)
    if (!input_path->empty() && !f.checkpoint.save_dir.empty() &&
        in_checkpoint_layout(*input_path, f.checkpoint.save_dir))
      throw UsageError(std::string(input) + " file " + quoted_file_name(*input_path) +
                       " lies in the checkpoints of --save-dir '" +
                       escaped_for_message(f.checkpoint.save_dir) +
                       "' (its latest or a step_<N>), which a save or --keep deletes; move it "
                       "outside them");
  for (size_t o = 0; o < outputs.size(); ++o) {
    const auto& [flag, path] = outputs[o];
    if (path->empty()) continue;
    if (written_in_place(*path)) continue;
    const std::string shown = quoted_file_name(*path);
    for (size_t other = o + 1; other < outputs.size(); ++other)
      if (!outputs[other].second->empty() && same_file(*path, *outputs[other].second))
        throw UsageError(std::string(flag) + " and " + outputs[other].first + " both name " +
                         shown + "; each writes a file of its own, so give each its own name");
    for (const auto& [input, input_path] : inputs)
      if (!input_path->empty() && same_file(*path, *input_path))
        throw UsageError(std::string(flag) + " file " + shown + " is the file " + input +
                         " reads, which writing it would destroy; give " + flag +
                         " a file of its own");
    for (const auto& [folder_flag, given, folder] : checkpoints)
      if (!folder.empty() && in_checkpoint_layout(*path, folder))
        throw UsageError(std::string(flag) + " file " + shown +
                         " would overwrite the checkpoints of " + folder_flag + " '" +
                         escaped_for_message(*given) +
                         "' (the folder itself, its latest or a step_<N>); give " + flag +
                         " a file outside them");
  }
}

void quiet_unless_rank_zero(const MpiSession& mpi, TrainFlags& f) {
  if (!mpi.active() || mpi.rank() == 0) return;
  if (std::freopen("/dev/null", "w", stdout) == nullptr)
    throw std::runtime_error("cannot silence the output of rank " + std::to_string(mpi.rank()));
  f.log_json.clear();
  f.trace.clear();
}

void check_eval_fits(const TrainConfig& config, int64_t eval_batches, uint64_t file_bytes) {
  if (eval_batches == 0) return;
  const uint64_t trained = static_cast<uint64_t>(config.steps);
  const uint64_t needed =
      (trained + static_cast<uint64_t>(eval_batches)) * static_cast<uint64_t>(config.batch_tokens);
  // One token per byte.
  const uint64_t have = file_bytes;
  if (needed + 1 <= have) return;
  // What would fit: the batches left after the training's, or, when the training takes the
  // whole file, more than it, or leaves less than a batch after it, no held-out batch at all.
  const uint64_t batch = static_cast<uint64_t>(config.batch_tokens);
  const uint64_t pairs = have - 1;
  const uint64_t in_file = pairs / batch;
  const uint64_t training_pairs = trained * batch;
  std::string fix;
  if (in_file > trained)
    fix = "use --eval-batches " + std::to_string(in_file - trained) + " or fewer, or fewer --steps";
  else if (training_pairs < pairs)
    fix = "the training batches leave " + counted(pairs - training_pairs, "(input, target) pair") +
          " after them, fewer than one held-out batch; use fewer --steps or a larger file";
  else if (training_pairs == pairs)
    fix = "the training batches alone fill it; use fewer --steps or a larger file";
  else
    fix = "the training batches alone need " + std::to_string(training_pairs) +
          " (input, target) pairs, more than its " + std::to_string(pairs) +
          "; use fewer --steps or a larger file";
  throw UsageError(
      "--eval-batches " + std::to_string(eval_batches) + " needs " + std::to_string(needed + 1) +
      " bytes of --data (" + counted(trained, "training batch", "training batches") + " and " +
      counted(eval_batches, "held-out batch", "held-out batches") + " of " +
      std::to_string(config.batch_tokens) + " tokens each, and the last target) but the file has " +
      std::to_string(have) + "; " + fix);
}

}  // namespace conveyor::cli
