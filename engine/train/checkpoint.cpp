#include "engine/train/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <set>
#include <stdexcept>
#include <system_error>
#include <unordered_map>

#include "engine/train/checkpoint_io.h"

namespace conveyor {
namespace fs = std::filesystem;

namespace {

using checkpoint_io::in_quotes;
using checkpoint_io::shown_path;

constexpr const char* kManifestName = "manifest.json";
constexpr const char* kLatestName = "latest";
constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

// The step of a folder named "step_<N>" (and, with `temp`, "step_<N>.tmp"); nullopt otherwise.
std::optional<int64_t> step_of_folder(const std::string& name, bool temp) {
  std::string_view rest = name;
  if (!rest.starts_with("step_")) return std::nullopt;
  rest.remove_prefix(5);
  if (temp) {
    if (!rest.ends_with(".tmp")) return std::nullopt;
    rest.remove_suffix(4);
  }
  if (rest.empty() || rest.size() > 18) return std::nullopt;
  for (char c : rest)
    if (c < '0' || c > '9') return std::nullopt;
  int64_t step = 0;
  std::from_chars(rest.data(), rest.data() + rest.size(), step);
  return step;
}

std::string step_folder_name(int64_t step) { return "step_" + std::to_string(step); }

// The folder name a `latest` file holds: its one line, without the line end.
std::string read_latest_name(const fs::path& latest) {
  std::string name = checkpoint_io::read_small_file(latest, 4096);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
    name.pop_back();
  return name;
}

// The step of the folder that `dir`/latest names; nullopt when there is no readable `latest`
// naming a step folder.
std::optional<int64_t> published_step(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / kLatestName, ec)) return std::nullopt;
  try {
    return step_of_folder(read_latest_name(dir / kLatestName), /*temp=*/false);
  } catch (const CheckpointError&) {
    return std::nullopt;
  }
}

std::string describe(DType dtype, const Shape& shape) {
  return std::string(dtype_name(dtype)) + shape_to_string(shape);
}

// A path without a trailing separator, so that filename() is its last component.
fs::path normalized(const fs::path& path) {
  fs::path p = path.lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------- Writer

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
  std::error_code ec;
  if (fs::exists(final_, ec)) {
    if (std::optional<std::string> why = save_refusal(dir_, step)) throw CheckpointError(*why);
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

std::unique_ptr<CheckpointWriter> CheckpointWriter::join(fs::path dir, int64_t step,
                                                         int num_ranks) {
  std::unique_ptr<CheckpointWriter> writer(
      new CheckpointWriter(Joined{true}, std::move(dir), step, num_ranks, {}));
  std::error_code ec;
  if (!fs::is_directory(writer->temp_, ec))
    throw CheckpointError("cannot save step " + std::to_string(step) + ": " +
                          shown_path(writer->temp_) +
                          ", which the process of rank 0 made, is not there; every process "
                          "must see the same --save-dir (a file system all nodes share)");
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
    const ShardFileInfo info =
        write_shard_file(temp_ / shard_file_name(rank), step_, rank, tensors);
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
  checkpoint_io::File file = checkpoint_io::File::create(manifest_path);
  file.write_all(text.data(), text.size());
  file.sync();
  file.close();
  checkpoint_io::sync_directory(temp_);
  checkpoint_io::pause_for_crash_test("commit");
  checkpoint_io::rename_path(temp_, final_);
  checkpoint_io::sync_directory(dir_);
  checkpoint_io::pause_for_crash_test("publish");
  checkpoint_io::write_file_atomically(dir_ / kLatestName, step_folder_name(step_) + "\n");
  committed_ = true;

  CommitResult result;
  result.directory = final_;
  if (options_.keep_last == 0) return result;
  std::vector<std::pair<int64_t, fs::path>> saved;
  std::error_code list_error;
  for (const auto& entry : fs::directory_iterator(dir_, list_error)) {
    std::error_code type_error;
    if (const auto step = step_of_folder(entry.path().filename().string(), /*temp=*/false);
        step && entry.is_directory(type_error))
      saved.emplace_back(*step, entry.path());
  }
  if (list_error)
    result.warnings.push_back("cannot list " + shown_path(dir_) + ": " + list_error.message());
  std::error_code ec;
  std::sort(saved.begin(), saved.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(options_.keep_last); i < saved.size(); ++i) {
    if (saved[i].second == final_) continue;  // what `latest` names stays, whatever its step
    fs::remove_all(saved[i].second, ec);
    if (ec)
      result.warnings.push_back("cannot remove old checkpoint " + shown_path(saved[i].second) +
                                ": " + ec.message());
    else
      result.removed.push_back(saved[i].second);
  }
  return result;
}

std::optional<std::string> save_refusal(const fs::path& dir, int64_t step) {
  const fs::path final_folder = dir / step_folder_name(step);
  std::error_code ec;
  if (!fs::exists(final_folder, ec)) return std::nullopt;
  // A step folder newer than what `latest` names was renamed into place by a save that
  // stopped before publishing it (a crash between the two): the run that resumed from
  // `latest` is redoing that step and replaces it. Any other existing step is a checkpoint
  // someone may rely on, and is never overwritten.
  const std::optional<int64_t> published = published_step(dir);
  const bool a_checkpoint =
      fs::is_directory(final_folder, ec) && fs::is_regular_file(final_folder / kManifestName, ec);
  if (a_checkpoint && !(published && *published >= step)) return std::nullopt;
  return "cannot save step " + std::to_string(step) + ": " + shown_path(final_folder) +
         " exists already" +
         (!a_checkpoint        ? " and is not a checkpoint folder"
          : *published == step ? " and is the one 'latest' names"
                               : "") +
         "; remove it or save into another folder";
}

// ---------------------------------------------------------------------------------- Loader

fs::path resolve_checkpoint_directory(const fs::path& path) {
  const fs::path p = normalized(path);
  std::error_code ec;
  const fs::file_status status = fs::status(p, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw NotACheckpointError("cannot look at " + shown_path(p) + ": " + ec.message() +
                              "; give a checkpoint this process may read");
  if (!fs::exists(status))
    throw NotACheckpointError("no checkpoint at " + shown_path(p) +
                              ": it does not exist; give DIR, DIR/latest or DIR/step_<N>");
  if (fs::is_regular_file(status)) {
    // A `latest` file: one line naming a sibling folder. Another file that does not name one
    // is most likely a file of a checkpoint (its manifest, a shard): say so, not that it
    // holds the wrong text.
    const bool named_latest = p.filename() == kLatestName;
    const auto not_a_checkpoint = [&] {
      const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
      std::error_code exists_error;
      if (fs::exists(folder / kManifestName, exists_error))
        return NotACheckpointError(shown_path(p) + " is a file of the checkpoint folder " +
                                   shown_path(folder) + "; give the folder itself");
      return NotACheckpointError(shown_path(p) +
                                 " is a file, neither a checkpoint folder nor a 'latest' file "
                                 "naming one; give DIR, DIR/latest or DIR/step_<N>");
    };
    std::string name;
    try {
      name = read_latest_name(p);
    } catch (const CheckpointError&) {
      if (named_latest) throw;
      throw not_a_checkpoint();
    }
    if (!named_latest && !step_of_folder(name, /*temp=*/false)) throw not_a_checkpoint();
    if (!step_of_folder(name, /*temp=*/false))
      throw CheckpointError(shown_path(p) +
                            " should name a checkpoint folder step_<N>, but it holds " +
                            in_quotes(name));
    const fs::path target = p.parent_path() / name;
    if (!fs::is_directory(target, ec))
      throw CheckpointError(shown_path(p) + " names " + name + ", but " + shown_path(target) +
                            " does not exist");
    return target;
  }
  if (!fs::is_directory(status))
    throw NotACheckpointError(shown_path(p) +
                              " is neither a folder nor a regular file (a device, pipe or "
                              "socket), so neither a checkpoint folder nor a 'latest' file; give "
                              "DIR, DIR/latest or DIR/step_<N>");
  const std::string name = p.filename().string();
  if (name.ends_with(".tmp"))
    throw NotACheckpointError(shown_path(p) +
                              " is an unfinished save (it was never committed); open its parent "
                              "folder to load the newest complete checkpoint");
  if (fs::exists(p / kManifestName, ec)) return p;
  if (fs::exists(p / kLatestName, ec)) return resolve_checkpoint_directory(p / kLatestName);
  throw NotACheckpointError(shown_path(p) + " holds no checkpoint: it has neither a '" +
                            kLatestName + "' file nor a " + kManifestName +
                            "; give a folder that checkpoints were saved into, or one of its "
                            "step_<N> folders");
}

Checkpoint open_checkpoint(const fs::path& path, CheckpointCheck check) {
  Checkpoint ckpt;
  ckpt.dir_ = resolve_checkpoint_directory(path);
  const fs::path manifest_path = ckpt.dir_ / kManifestName;
  const std::string manifest_file = shown_path(manifest_path);
  ckpt.manifest_ = parse_manifest(checkpoint_io::read_small_file(manifest_path, kMaxManifestBytes),
                                  manifest_file);
  const CheckpointManifest& m = ckpt.manifest_;

  if (const auto folder_step = step_of_folder(ckpt.dir_.filename().string(), false);
      folder_step && *folder_step != m.state.step)
    throw CheckpointError(manifest_file + " is of step " + std::to_string(m.state.step) +
                          ", but its folder is named for step " + std::to_string(*folder_step));
  check_manifest_counters(m, manifest_file);
  check_manifest_model_fingerprint(m, manifest_file);
  check_manifest_state_checksum(m, manifest_file);
  check_manifest_checksum(m, manifest_file);

  // The shards: all those listed, and no others.
  std::set<std::string> listed;
  for (const ShardEntry& e : m.shards) listed.insert(e.file);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(ckpt.dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".safetensors") && !listed.count(name))
      throw CheckpointError(shown_path(entry.path()) + " is present but not listed in " +
                            manifest_file + ": a shard of another save or layout?");
  }
  if (ec)
    throw CheckpointError("cannot list checkpoint folder " + shown_path(ckpt.dir_) + ": " +
                          ec.message());
  for (const ShardEntry& e : m.shards)
    if (!fs::exists(ckpt.dir_ / e.file, ec))
      throw CheckpointError(shown_path(ckpt.dir_ / e.file) + " is listed in " + manifest_file +
                            " but missing");

  // Every tensor whole in one shard, or in pieces that tile it: gather them by name.
  std::map<std::string, CheckpointTensor> by_name;
  for (const ShardEntry& e : m.shards) {
    auto shard = std::make_unique<ShardReader>(ckpt.dir_ / e.file, check);
    const std::string file = shown_path(shard->path());
    if (shard->rank() != e.rank)
      throw CheckpointError(file + " is the shard of rank " + std::to_string(shard->rank()) +
                            ", but " + manifest_file + " lists it for rank " +
                            std::to_string(e.rank));
    if (shard->step() != m.state.step)
      throw CheckpointError(file + " holds step " + std::to_string(shard->step()) + ", but " +
                            manifest_file + " is of step " + std::to_string(m.state.step));
    if (shard->file_bytes() != e.bytes)
      throw CheckpointError(file + " has " + std::to_string(shard->file_bytes()) + " bytes, but " +
                            manifest_file + " says " + std::to_string(e.bytes));
    if (shard->file_checksum() && *shard->file_checksum() != e.checksum)
      throw CheckpointError(file + " has XXH3-64 " + checkpoint_io::hex64(*shard->file_checksum()) +
                            ", but " + manifest_file + " says " + checkpoint_io::hex64(e.checksum) +
                            ": the file was changed after it was saved");
    for (size_t i = 0; i < shard->tensors().size(); ++i) {
      const ShardTensor& t = shard->tensors()[i];
      const Shape& shape = t.piece ? t.piece->shape : t.shape;
      const CheckpointPiece piece{e.rank, t.piece ? t.piece->begin : 0,
                                  t.piece ? t.piece->end : shape_numel(t.shape), t.checksum, i};
      const auto [it, fresh] = by_name.try_emplace(t.name);
      CheckpointTensor& entry = it->second;
      if (fresh) {
        entry = {
            t.name, t.dtype, shape, 0, t.piece ? 0 : t.checksum, e.rank, {}, t.piece.has_value()};
      } else if (!entry.pieced || !t.piece) {
        const std::string other = shown_path(ckpt.dir_ / m.shards[entry.rank].file);
        if (!entry.pieced && !t.piece)
          throw CheckpointError(file + " holds tensor " + in_quotes(t.name) + ", which " + other +
                                " holds too");
        throw CheckpointError(file + " holds tensor " + in_quotes(t.name) +
                              (t.piece ? " in part" : " whole") + ", which " + other + " holds " +
                              (entry.pieced ? "in part" : "whole") +
                              " too: a tensor is stored whole in one shard or in pieces");
      } else if (entry.dtype != t.dtype || entry.shape != shape) {
        throw CheckpointError(file + " holds a piece of tensor " + in_quotes(t.name) + " of " +
                              describe(t.dtype, shape) + ", but " +
                              shown_path(ckpt.dir_ / m.shards[entry.rank].file) +
                              " holds a piece of it of " + describe(entry.dtype, entry.shape));
      }
      entry.bytes += t.bytes();
      entry.pieces.push_back(piece);
    }
    ckpt.shards_.push_back(std::move(shard));
  }
  for (auto& [name, t] : by_name) {
    if (!t.pieced) {
      ckpt.tensors_.push_back(std::move(t));
      continue;
    }
    // The pieces must tile [0, numel) exactly: sorted by begin, each starts where the one
    // before ended.
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const CheckpointPiece& a, const CheckpointPiece& b) { return a.begin < b.begin; });
    const int64_t numel = shape_numel(t.shape);
    int64_t next = 0;
    const CheckpointPiece* previous = nullptr;
    for (const CheckpointPiece& p : t.pieces) {
      auto where = [&](const CheckpointPiece& q) {
        return shown_path(ckpt.dir_ / m.shards[q.rank].file) + " (elements [" +
               std::to_string(q.begin) + ", " + std::to_string(q.end) + "))";
      };
      if (p.begin < next)
        throw CheckpointError("the pieces of tensor " + in_quotes(name) +
                              " overlap: " + where(*previous) + " and " + where(p));
      if (p.begin > next)
        throw CheckpointError("the pieces of tensor " + in_quotes(name) + " " +
                              describe(t.dtype, t.shape) + " leave elements [" +
                              std::to_string(next) + ", " + std::to_string(p.begin) +
                              ") in no shard; the piece after the gap is in " + where(p));
      next = p.end;
      previous = &p;
    }
    if (next != numel)
      throw CheckpointError("the pieces of tensor " + in_quotes(name) + " " +
                            describe(t.dtype, t.shape) + " leave elements [" +
                            std::to_string(next) + ", " + std::to_string(numel) +
                            ") in no shard; the last piece is in " +
                            shown_path(ckpt.dir_ / m.shards[previous->rank].file));
    t.rank = t.pieces.front().rank;
    ckpt.tensors_.push_back(std::move(t));
  }
  return ckpt;
}

fs::path Checkpoint::shard_path(int rank) const { return dir_ / manifest_.shards.at(rank).file; }

const CheckpointTensor* Checkpoint::find(std::string_view name) const {
  const auto it =
      std::lower_bound(tensors_.begin(), tensors_.end(), name,
                       [](const CheckpointTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const CheckpointTensor& Checkpoint::require(std::string_view name) const {
  const CheckpointTensor* t = find(name);
  if (!t)
    throw CheckpointError(shown_path(dir_) + ": the checkpoint has no tensor " + in_quotes(name));
  return *t;
}

void Checkpoint::check_model(std::string_view fingerprint) const {
  if (fingerprint == manifest_.state.model_fingerprint) return;
  std::string model = manifest_.state.model.dump();
  if (model.size() > 200) model = model.substr(0, 200) + "...";
  throw CheckpointError(shown_path(dir_ / kManifestName) +
                        " is a checkpoint of another model: its fingerprint is " +
                        in_quotes(manifest_.state.model_fingerprint) + ", this model's is " +
                        in_quotes(fingerprint) + " (the checkpoint's model: " + model + ")");
}

void Checkpoint::check_tensors(const std::vector<TensorSpec>& expected) const {
  check_holds(expected);
  std::set<std::string_view> wanted;
  for (const TensorSpec& spec : expected) wanted.insert(spec.name);
  for (const CheckpointTensor& t : tensors_)
    if (!wanted.count(t.name))
      throw CheckpointError(shown_path(shard_path(t.rank)) + " holds tensor " + in_quotes(t.name) +
                            " (" + describe(t.dtype, t.shape) + "), which the model does not have");
}

void Checkpoint::check_holds(const std::vector<TensorSpec>& expected) const {
  std::set<std::string_view> wanted;
  for (const TensorSpec& spec : expected) {
    if (!wanted.insert(spec.name).second)
      throw std::invalid_argument("check_tensors: tensor " + in_quotes(spec.name) +
                                  " is expected twice");
    const CheckpointTensor* t = find(spec.name);
    if (!t)
      throw CheckpointError(shown_path(dir_) + ": the checkpoint has no tensor " +
                            in_quotes(spec.name) + " (" + describe(spec.dtype, spec.shape) +
                            "), which the model needs");
    if (t->dtype != spec.dtype || t->shape != spec.shape)
      throw CheckpointError(shown_path(shard_path(t->rank)) + ": tensor " + in_quotes(t->name) +
                            " is " + describe(t->dtype, t->shape) + ", the model expects " +
                            describe(spec.dtype, spec.shape));
  }
}

std::vector<unsigned char> Checkpoint::read_bytes(std::string_view name) const {
  const CheckpointTensor& t = require(name);
  return read_bytes(name, 0, shape_numel(t.shape));
}

std::vector<unsigned char> Checkpoint::read_bytes(std::string_view name, int64_t begin,
                                                  int64_t end) const {
  const CheckpointTensor& t = require(name);
  const int64_t numel = shape_numel(t.shape);
  if (begin < 0 || end < begin || end > numel)
    throw std::invalid_argument("checkpoint read of " + in_quotes(name) + ": elements [" +
                                std::to_string(begin) + ", " + std::to_string(end) +
                                ") are not within its " + std::to_string(numel));
  const size_t element = dtype_size(t.dtype);
  std::vector<unsigned char> out(static_cast<size_t>(end - begin) * element);
  std::vector<unsigned char> piece_bytes;
  for (const CheckpointPiece& p : t.pieces) {
    const int64_t from = std::max(begin, p.begin), to = std::min(end, p.end);
    if (from >= to) continue;
    const ShardReader& shard = *shards_[p.rank];
    const ShardTensor& stored = shard.tensors()[p.index];
    if (from == p.begin && to == p.end) {
      shard.read(stored, out.data() + static_cast<size_t>(from - begin) * element);
      continue;
    }
    // A part of the piece: the whole piece is read so that its checksum can be checked.
    piece_bytes.resize(static_cast<size_t>(stored.bytes()));
    shard.read(stored, piece_bytes.data());
    std::copy_n(piece_bytes.data() + static_cast<size_t>(from - p.begin) * element,
                static_cast<size_t>(to - from) * element,
                out.data() + static_cast<size_t>(from - begin) * element);
  }
  return out;
}

void Checkpoint::read(const std::string& name, const Tensor& dst) const {
  const CheckpointTensor& t = require(name);
  if (!dst.defined())
    throw std::invalid_argument("checkpoint read of " + in_quotes(name) +
                                ": the destination tensor is undefined");
  if (dst.dtype() != t.dtype || dst.shape() != t.shape)
    throw CheckpointError(shown_path(shard_path(t.rank)) + ": tensor " + in_quotes(name) + " is " +
                          describe(t.dtype, t.shape) + ", the model expects " +
                          describe(dst.dtype(), dst.shape()));
  const std::vector<unsigned char> bytes = read_bytes(name);
  copy_from_host(dst, bytes.data(), bytes.size());
}

void Checkpoint::read_range(const std::string& name, int64_t offset, const Tensor& dst) const {
  const CheckpointTensor& t = require(name);
  if (!dst.defined())
    throw std::invalid_argument("checkpoint read of " + in_quotes(name) +
                                ": the destination tensor is undefined");
  const int64_t numel = shape_numel(t.shape);
  if (dst.dtype() != t.dtype || offset < 0 || offset + dst.numel() > numel)
    throw CheckpointError(shown_path(shard_path(t.rank)) + ": tensor " + in_quotes(name) + " is " +
                          describe(t.dtype, t.shape) + ", the model expects elements [" +
                          std::to_string(offset) + ", " + std::to_string(offset + dst.numel()) +
                          ") of it as " + dtype_name(dst.dtype()));
  const std::vector<unsigned char> bytes = read_bytes(name, offset, offset + dst.numel());
  copy_from_host(dst, bytes.data(), bytes.size());
}

void Checkpoint::verify(const std::vector<NamedTensor>& tensors) const {
  for (const NamedTensor& t : tensors) {
    const CheckpointTensor& saved = require(t.name);
    // A whole tensor checks every piece, even an empty one (whose checksum is still the
    // metadata's to get right); a range checks the pieces it overlaps.
    const int64_t begin = t.piece ? t.piece->offset : 0;
    const int64_t end = t.piece ? begin + t.tensor.numel() : 0;
    for (const CheckpointPiece& p : saved.pieces)
      if (!t.piece || std::max(begin, p.begin) < std::min(end, p.end))
        shards_[p.rank]->verify(shards_[p.rank]->tensors()[p.index]);
  }
}

void Checkpoint::read(const std::vector<NamedTensor>& tensors) const {
  for (const NamedTensor& t : tensors) {
    if (t.piece) {
      const CheckpointTensor& saved = require(t.name);
      if (saved.shape != t.piece->shape || saved.dtype != t.tensor.dtype())
        throw CheckpointError(shown_path(shard_path(saved.rank)) + ": tensor " + in_quotes(t.name) +
                              " is " + describe(saved.dtype, saved.shape) + ", the model expects " +
                              describe(t.tensor.dtype(), t.piece->shape));
      read_range(t.name, t.piece->offset, t.tensor);
    } else {
      read(t.name, t.tensor);
    }
  }
}

}  // namespace conveyor
