// The writer of checkpoint.h: shards into step_<N>.tmp, the manifest and the commit (rename,
// fsync, `latest`), the old checkpoints pruned (through step_<N>.removing), and the refusal of
// a step that would overwrite one.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_layout.h"

namespace conveyor {
namespace fs = std::filesystem;

namespace {

using checkpoint_io::shown_path;
using checkpoint_layout::kLatestName;
using checkpoint_layout::kManifestName;
using checkpoint_layout::kRemovalSuffix;
using checkpoint_layout::published_step;
using checkpoint_layout::step_folder_name;
using checkpoint_layout::step_of_folder;
using checkpoint_layout::step_of_removal;

// A failed removal of `leftover` (DIR/step_<N>.removing), in the same words at every save that
// meets it, so that a training run says it once.
std::string removal_warning(const fs::path& leftover, const std::error_code& ec) {
  const std::string left = leftover.filename().string();
  const std::string step = left.substr(0, left.size() - std::string_view(kRemovalSuffix).size());
  return "cannot remove old checkpoint " + shown_path(leftover.parent_path() / step) + ": " +
         ec.message() + "; what is left of it is named " + left +
         ", which no load takes for a checkpoint and the next saves try again to remove";
}

}  // namespace

CheckpointWriter::CheckpointWriter(Joined joined, fs::path dir, int64_t step, int num_ranks,
                                   CheckpointWriterOptions options)
    : dir_(std::move(dir)),
      step_(step),
      num_ranks_(num_ranks),
      options_(options),
      joined_(joined.value),
      written_(num_ranks > 0 ? num_ranks : 0),
      started_(num_ranks > 0 ? num_ranks : 0, false) {
  if (step < 0)
    throw std::invalid_argument("checkpoint step must be >= 0, got " + std::to_string(step));
  if (num_ranks < 1)
    throw std::invalid_argument("a checkpoint needs at least one rank, got " +
                                std::to_string(num_ranks));
  if (options.keep_last < 0)
    throw std::invalid_argument("keep_last must be >= 0 (0 keeps every checkpoint), got " +
                                std::to_string(options.keep_last));
  final_ = dir_ / step_folder_name(step);
  temp_ = dir_ / (step_folder_name(step) + ".tmp");
}

CheckpointWriter::CheckpointWriter(fs::path dir, int64_t step, int num_ranks,
                                   CheckpointWriterOptions options)
    : CheckpointWriter(Joined{false}, std::move(dir), step, num_ranks, options) {
  checkpoint_io::create_checkpoint_folder(dir_);
  if (std::optional<std::string> why = save_refusal(dir_, step, options_.continues_folder))
    throw CheckpointError(*why);
  std::error_code ec;
  if (fs::exists(final_, ec)) {
    // Out of the way first, as an unfinished save (which the loader ignores), then removed
    // with the others below.
    fs::remove_all(temp_, ec);
    checkpoint_io::rename_path(final_, temp_);
    checkpoint_io::sync_directory(dir_);
  }
  // Unfinished saves of earlier runs (a crash, a full disk) are of no use to anyone.
  std::vector<fs::path> unfinished;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (step_of_folder(name, /*temp=*/true) || name == std::string(kLatestName) + ".tmp")
      unfinished.push_back(entry.path());
  }
  if (ec)
    throw CheckpointError("cannot list checkpoint folder " + shown_path(dir_) + ": " +
                          ec.message());
  for (const fs::path& p : unfinished) {
    fs::remove_all(p, ec);
    if (ec)
      throw CheckpointError("cannot remove the unfinished save " + shown_path(p) + ": " +
                            ec.message());
  }
  if (!fs::create_directory(temp_, ec) || ec)
    throw CheckpointError("cannot create folder " + shown_path(temp_) + ": " +
                          (ec ? ec.message() : "it exists already"));
  owns_temp_ = true;
}

std::unique_ptr<CheckpointWriter> CheckpointWriter::join(fs::path dir, int64_t step, int num_ranks,
                                                         CheckpointWriterOptions options) {
  std::unique_ptr<CheckpointWriter> writer(
      new CheckpointWriter(Joined{true}, std::move(dir), step, num_ranks, options));
  std::error_code ec;
  if (!fs::is_directory(writer->temp_, ec))
    throw CheckpointError(
        "cannot save step " + std::to_string(step) + ": " + shown_path(writer->temp_) +
        ", which the process of rank 0 made, is not there; every process "
        "must see the same TrainerCheckpointOptions::directory (a file system all "
        "nodes share)");
  return writer;
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_ || !owns_temp_) return;
  std::error_code ec;
  fs::remove_all(temp_, ec);  // best effort; the next save removes what is left
}

std::string CheckpointWriter::shard_file_name(int rank) {
  return "rank_" + std::to_string(rank) + ".safetensors";
}

void CheckpointWriter::check_rank(int rank, const char* call) const {
  if (rank < 0 || rank >= num_ranks_)
    throw std::invalid_argument(std::string(call) + ": rank " + std::to_string(rank) +
                                " is not in [0, " + std::to_string(num_ranks_) + ")");
}

std::optional<ShardFileInfo> CheckpointWriter::written(int rank) const {
  check_rank(rank, "written");
  std::lock_guard lock(mutex_);
  return written_[rank];
}

void CheckpointWriter::add_written(int rank, ShardFileInfo info) {
  check_rank(rank, "add_written");
  std::lock_guard lock(mutex_);
  if (started_[rank] || written_[rank])
    throw std::logic_error("add_written: rank " + std::to_string(rank) + " has a shard already");
  written_[rank] = info;
}

void CheckpointWriter::write_shard(int rank, const std::vector<NamedTensor>& tensors) {
  check_rank(rank, "write_shard");
  {
    std::lock_guard lock(mutex_);
    if (committed_) throw std::logic_error("write_shard: the checkpoint is committed already");
    if (started_[rank])
      throw std::logic_error("write_shard: rank " + std::to_string(rank) +
                             " has written its shard already");
    started_[rank] = true;
  }
  try {
    const ShardFileInfo info = write_shard_file(temp_ / shard_file_name(rank), step_, rank, tensors,
                                                options_.refuse_non_finite);
    std::lock_guard lock(mutex_);
    written_[rank] = info;
  } catch (...) {
    std::lock_guard lock(mutex_);
    started_[rank] = false;  // the rank may try again
    throw;
  }
}

CommitResult CheckpointWriter::commit(const TrainingState& state) {
  std::lock_guard lock(mutex_);
  if (joined_) throw std::logic_error("commit: a writer that joined a save never commits it");
  if (committed_) throw std::logic_error("commit: the checkpoint is committed already");
  if (state.step != step_)
    throw std::invalid_argument("commit: the state is of step " + std::to_string(state.step) +
                                ", this save is of step " + std::to_string(step_));
  CheckpointManifest manifest;
  manifest.state = state;
  for (int r = 0; r < num_ranks_; ++r) {
    if (!written_[r])
      throw CheckpointError("cannot commit " + shown_path(final_) + ": rank " + std::to_string(r) +
                            " has not written its shard");
    manifest.shards.push_back({r, shard_file_name(r), written_[r]->bytes, written_[r]->checksum});
  }
  manifest.state_checksum = training_state_checksum(manifest);
  manifest.manifest_checksum = manifest_checksum(manifest);
  const fs::path manifest_path = temp_ / kManifestName;
  const std::string text = manifest_to_json(manifest).dump(2) + "\n";
  // What is committed must load: a state the loader would reject is the caller's mistake
  // (an rng holding a NaN, which JSON writes as null, would not match its checksum).
  try {
    const std::string manifest_file = shown_path(manifest_path);
    const CheckpointManifest written = parse_manifest(text, manifest_file);
    check_manifest_counters(written, manifest_file);
    check_manifest_model_fingerprint(written, manifest_file);
    check_manifest_state_checksum(written, manifest_file);
    check_manifest_checksum(written, manifest_file);
  } catch (const CheckpointError& e) {
    throw std::invalid_argument(std::string("commit: the training state cannot be saved: ") +
                                e.what());
  }
  checkpoint_io::File file = checkpoint_io::File::create(manifest_path, text.size());
  file.write_all(text.data(), text.size());
  file.sync();
  file.close();
  checkpoint_io::sync_directory(temp_);
  checkpoint_io::pause_for_crash_test("commit");
  checkpoint_io::rename_path(temp_, final_);
  checkpoint_io::sync_directory(dir_);
  checkpoint_io::pause_for_crash_test("publish");
  try {
    checkpoint_io::write_file_atomically(dir_ / kLatestName, step_folder_name(step_) + "\n");
  } catch (const CheckpointError&) {
    // Not published (a full disk): back to an unfinished save, which the destructor removes,
    // so that the space of a step no one loads through `latest` is free for the next save.
    // Once `latest` names the step (only its folder's fsync failed), the step stays.
    std::error_code ec;
    if (published_step(dir_) != step_) {
      fs::remove(fs::path(dir_ / kLatestName) += ".tmp", ec);
      fs::rename(final_, temp_, ec);
    }
    throw;
  }
  committed_ = true;

  CommitResult result;
  result.directory = final_;
  prune(result);
  return result;
}

void CheckpointWriter::prune(CommitResult& result) const {
  // The step folders, and what removals of earlier saves left: each is of no use to anyone.
  std::vector<std::pair<int64_t, fs::path>> saved, left;
  std::error_code list_error;
  for (const auto& entry : fs::directory_iterator(dir_, list_error)) {
    const std::string name = entry.path().filename().string();
    std::error_code type_error;
    if (!entry.is_directory(type_error)) continue;
    if (const auto step = step_of_folder(name, /*temp=*/false))
      saved.emplace_back(*step, entry.path());
    else if (const auto removing = step_of_removal(name))
      left.emplace_back(*removing, entry.path());
  }
  if (list_error)
    result.warnings.push_back("cannot list " + shown_path(dir_) + ": " + list_error.message());
  const auto newest_first = [](const auto& a, const auto& b) { return a.first > b.first; };
  std::sort(saved.begin(), saved.end(), newest_first);
  std::sort(left.begin(), left.end(), newest_first);
  std::error_code ec;
  // Removes a step_<N>.removing folder, listed in `result` as `removed`, or warns.
  const auto remove_leftover = [&](const fs::path& leftover, const fs::path& removed) {
    fs::remove_all(leftover, ec);
    if (ec)
      result.warnings.push_back(removal_warning(leftover, ec));
    else
      result.removed.push_back(removed);
  };
  // First, so that a step removed again finds its leftover's name free.
  for (const auto& [step, path] : left) remove_leftover(path, path);
  if (options_.keep_last == 0) return;
  // Renamed before their files go, and the renames made durable: a removal that fails or
  // crashes halfway leaves a folder that no load takes for a checkpoint.
  std::vector<std::pair<fs::path, fs::path>> renamed;  // (old name, new name)
  for (size_t i = static_cast<size_t>(options_.keep_last); i < saved.size(); ++i) {
    const fs::path& path = saved[i].second;
    if (path == final_) continue;  // what `latest` names stays, whatever its step
    fs::path leftover = path;
    leftover += kRemovalSuffix;
    fs::rename(path, leftover, ec);
    if (ec)
      result.warnings.push_back("cannot remove old checkpoint " + shown_path(path) +
                                ", which stays whole: " + ec.message());
    else
      renamed.emplace_back(path, leftover);
  }
  if (renamed.empty()) return;
  try {
    checkpoint_io::sync_directory(dir_);
  } catch (const CheckpointError& e) {
    result.warnings.push_back(std::string(e.what()) +
                              "; the old checkpoints renamed step_<N>.removing stay for the next "
                              "save to remove");
    return;
  }
  for (const auto& [path, leftover] : renamed) remove_leftover(leftover, path);
}

std::optional<std::string> save_refusal(const fs::path& dir, int64_t step, bool continues_folder) {
  const fs::path final_folder = dir / step_folder_name(step);
  const std::optional<int64_t> published = published_step(dir);
  std::error_code ec;
  // The commit renames a file over `latest`, which fails on a folder: found only after the
  // whole save, with the step folder renamed into place but never published.
  if (const fs::file_status latest = fs::status(dir / kLatestName, ec);
      fs::exists(latest) && !fs::is_regular_file(latest))
    return "cannot save step " + std::to_string(step) + ": " + shown_path(dir / kLatestName) +
           " is " + (fs::is_directory(latest) ? "a folder" : "not a regular file") +
           ", where a save writes the file naming the newest checkpoint; remove it or save "
           "into another folder";
  if (fs::exists(final_folder, ec)) {
    // A step folder newer than what `latest` names was renamed into place by a save that
    // stopped before publishing it (a crash between the two): the run that resumed from
    // the folder is redoing that step and replaces it. Any other existing step is a
    // checkpoint someone may rely on, and is never overwritten; a run that did not resume
    // from the folder does not continue its run, so for it no step folder is a leftover.
    const bool a_checkpoint =
        fs::is_directory(final_folder, ec) && fs::is_regular_file(final_folder / kManifestName, ec);
    const bool newer = !published || *published < step;
    if (a_checkpoint && newer && continues_folder) return std::nullopt;
    std::string why;
    if (!a_checkpoint)
      why = " and is not a checkpoint folder";
    else if (!newer && *published == step)
      why = " and is the one 'latest' names";
    else if (newer)
      why = std::string(published ? ", newer than the step 'latest' names," : " (no 'latest'),") +
            " and this run does not continue the folder's run: it did not resume from it";
    return "cannot save step " + std::to_string(step) + ": " + shown_path(final_folder) +
           " exists already" + why + "; remove it or save into another folder";
  }
  // A save behind the step `latest` names would move `latest` back, and the later checkpoints
  // would then read as unpublished leftovers that the run's next saves replace: a second run
  // into a folder whose older steps --keep had removed replaced the first run's checkpoints.
  if (published && *published > step)
    return "cannot save step " + std::to_string(step) + ": 'latest' of " + shown_path(dir) +
           " names step " + std::to_string(*published) +
           ", a later checkpoint, which this save would hide and the run's later saves "
           "replace; resume from it or save into another folder";
  return std::nullopt;
}

std::optional<std::string> run_save_refusal(const fs::path& dir, int64_t first_step,
                                            int64_t last_step, int64_t every,
                                            bool continues_folder) {
  if (first_step > last_step) return std::nullopt;
  const auto saves = [&](int64_t step) {
    return step >= first_step && step <= last_step &&
           (step == last_step || (every > 0 && step % every == 0));
  };
  const int64_t first_save =
      every > 0 ? std::min(last_step, (first_step + every - 1) / every * every) : last_step;
  if (auto why = save_refusal(dir, first_save, continues_folder)) return why;
  // The folders already there that a later save meets, in step order, so the refusal names
  // the first one the run would reach.
  std::vector<int64_t> met;
  std::error_code list_error;
  for (const auto& entry : fs::directory_iterator(dir, list_error))
    if (const auto step = step_of_folder(entry.path().filename().string(), /*temp=*/false);
        step && saves(*step))
      met.push_back(*step);
  std::sort(met.begin(), met.end());
  for (int64_t step : met)
    if (auto why = save_refusal(dir, step, continues_folder)) return why;
  return std::nullopt;
}

}  // namespace conveyor
