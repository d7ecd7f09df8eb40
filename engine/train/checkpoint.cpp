#include "engine/train/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <system_error>
#include <unordered_map>

#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_layout.h"

namespace conveyor {
namespace fs = std::filesystem;

namespace {

using checkpoint_io::in_quotes;
using checkpoint_io::shown_path;
using checkpoint_layout::kLatestName;
using checkpoint_layout::kManifestName;
using checkpoint_layout::read_latest_name;
using checkpoint_layout::step_of_folder;
using checkpoint_layout::step_of_removal;

constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

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
  if (!fs::is_directory(status)) {
    struct stat st {};
    const std::string kind = ::stat(p.c_str(), &st) == 0 ? file_kind(st.st_mode) : "a special file";
    throw NotACheckpointError(shown_path(p) + " is " + kind +
                              ", neither a folder nor a regular file, so neither a checkpoint "
                              "folder nor a 'latest' file; give DIR, DIR/latest or DIR/step_<N>");
  }
  const std::string name = p.filename().string();
  if (name.ends_with(".tmp"))
    throw NotACheckpointError(shown_path(p) +
                              " is an unfinished save (it was never committed); open its parent "
                              "folder to load the newest complete checkpoint");
  if (step_of_removal(name))
    throw NotACheckpointError(shown_path(p) +
                              " is an old checkpoint whose removal did not finish (to keep only "
                              "the newest checkpoints), so some of its files may be gone; open "
                              "its parent folder to load the newest complete checkpoint");
  if (fs::exists(p / kManifestName, ec)) return p;
  if (fs::exists(p / kLatestName, ec)) return resolve_checkpoint_directory(p / kLatestName);
  // DIR/latest of a save folder is a file; a folder by that name holding nothing a checkpoint
  // would is in its way.
  if (name == kLatestName)
    throw NotACheckpointError(shown_path(p) +
                              " is a folder, where a file naming the newest checkpoint of " +
                              shown_path(p.has_parent_path() ? p.parent_path() : fs::path(".")) +
                              " is expected; remove or rename the folder, or give one of the "
                              "step_<N> folders");
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
  for (const ShardEntry& e : m.shards) {
    // Only a name that is not there is missing; one that cannot be looked at (a symbolic link
    // loop, a folder this process may not search) says why. A link to a file is followed.
    const fs::path shard = ckpt.dir_ / e.file;
    const fs::file_status status = fs::status(shard, ec);
    if (ec && ec != std::errc::no_such_file_or_directory)
      throw CheckpointError(shown_path(shard) + " is listed in " + manifest_file +
                            " but cannot be opened: " + ec.message());
    if (!fs::exists(status))
      throw CheckpointError(shown_path(shard) + " is listed in " + manifest_file + " but missing");
  }

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

const ShardReader& Checkpoint::shard(int rank) const {
  if (rank < 0 || static_cast<size_t>(rank) >= shards_.size())
    throw std::out_of_range("checkpoint " + checkpoint_io::shown_path(dir_) + " has " +
                            std::to_string(shards_.size()) + " shard(s), none of rank " +
                            std::to_string(rank));
  return *shards_[rank];
}

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
  throw CheckpointOfAnotherModel(
      shown_path(dir_ / kManifestName) + " is a checkpoint of another model: its fingerprint is " +
      in_quotes(manifest_.state.model_fingerprint) + ", this model's is " + in_quotes(fingerprint) +
      " (the checkpoint's model: " + model + ")");
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
  const int64_t numel = shape_numel(t.shape), n = dst.numel();
  // Compared without offset + n, which overflows for an offset near INT64_MAX.
  const bool inside = offset >= 0 && n <= numel && offset <= numel - n;
  if (dst.dtype() != t.dtype || !inside) {
    // Past INT64_MAX the end is said as it is, in unsigned arithmetic (offset >= 0 there).
    const std::string end =
        offset >= 0 ? std::to_string(static_cast<uint64_t>(offset) + static_cast<uint64_t>(n))
                    : std::to_string(offset + n);
    throw CheckpointError(shown_path(shard_path(t.rank)) + ": tensor " + in_quotes(name) + " is " +
                          describe(t.dtype, t.shape) + ", the model expects elements [" +
                          std::to_string(offset) + ", " + end + ") of it as " +
                          dtype_name(dst.dtype()));
  }
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
