#pragma once
// Distributed checkpoints: one safetensors shard per rank and a JSON manifest per step, laid
// out in a folder DIR as
//   DIR/latest           "step_<N>": the newest complete checkpoint, replaced atomically
//   DIR/step_<N>/        manifest.json and rank_<r>.safetensors for every rank r
//   DIR/step_<N>.tmp/    a save in progress, or one that failed: removed by the next save
//   DIR/step_<N>.removing/  an old checkpoint being removed (keep_last), or what is left of
//                           one whose removal failed: removed by the next saves, never loaded
// A save is complete once `latest` names it; a failed save leaves the previous one intact.
// Loading checks every file and every checksum before it returns anything, and then reads
// tensors by global name, so a rank of another stage layout finds its tensors wherever they
// were saved. docs/checkpoint-format.md describes the format.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/tensor.h"
#include "engine/train/checkpoint_error.h"
#include "engine/train/checkpoint_manifest.h"
#include "engine/train/checkpoint_shard.h"

namespace conveyor {

struct CheckpointWriterOptions {
  int keep_last = 0;  // after a commit, keep only the newest K checkpoints; 0 keeps them all
  // The run resumed from a checkpoint of this folder and continues its run: a step folder
  // newer than `latest` is that run's save which stopped before publishing it, and is
  // replaced. Any other run leaves every checkpoint folder as it is.
  bool continues_folder = false;
  // Refuse a shard whose f32 tensors hold a NaN or an infinity (write_shard_file): a
  // training run's weights or optimizer state that hold one have diverged, and publishing
  // them would put garbage where the last good checkpoint is, or remove it (keep_last).
  bool refuse_non_finite = false;
};

struct CommitResult {
  std::filesystem::path directory;  // DIR/step_<N>
  // Older checkpoints removed (keep_last), and step_<N>.removing folders that earlier
  // removals left.
  std::vector<std::filesystem::path> removed;
  std::vector<std::string> warnings;  // removals that failed; the new checkpoint is complete
};

// Why a CheckpointWriter of `step` into `dir` would be refused as `dir` stands now (its
// DIR/step_<N> exists and is not a checkpoint folder, or is one that `latest` names or that
// is older than it, or the run does not continue the folder's run; or `latest` names a later
// step, or is a folder or other file that a save cannot replace), or nullopt when it would save.
// Lets a run refuse at its start a save it could only fail at its end.
std::optional<std::string> save_refusal(const std::filesystem::path& dir, int64_t step,
                                        bool continues_folder = false);

// The first refusal of the saves a run from `first_step` to `last_step` makes (every
// `every`-th step, and the last): the first save's, and then any step folder already in
// `dir` that one of them would meet.
std::optional<std::string> run_save_refusal(const std::filesystem::path& dir, int64_t first_step,
                                            int64_t last_step, int64_t every,
                                            bool continues_folder);

// One save: construct it, let every rank call write_shard (from its own thread, at the same
// time), then call commit once. Saves into one DIR must not overlap in time.
class CheckpointWriter {
 public:
  // Creates DIR if needed, removes unfinished saves (step_*.tmp) and makes DIR/step_<N>.tmp/.
  // Throws CheckpointError when DIR/step_<N> exists already and is not newer than the step
  // DIR/latest names (a newer one is a save that was renamed into place but never published,
  // and is replaced), or when a folder cannot be made.
  CheckpointWriter(std::filesystem::path dir, int64_t step, int num_ranks,
                   CheckpointWriterOptions options = {});
  // Joins a save that another process prepared and will commit (the processes of one run,
  // on a file system they share): writes shards into its DIR/step_<N>.tmp, and never
  // prepares, commits or removes anything. Throws CheckpointError when the folder is not
  // there, which is what a --save-dir the processes do not share looks like.
  static std::unique_ptr<CheckpointWriter> join(std::filesystem::path dir, int64_t step,
                                                int num_ranks,
                                                CheckpointWriterOptions options = {});
  ~CheckpointWriter();  // without a commit, removes its .tmp folder (unless it joined)
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  static std::string shard_file_name(int rank);  // "rank_<r>.safetensors"
  const std::filesystem::path& temp_directory() const { return temp_; }

  // Writes and fsyncs rank's shard: `tensors` keyed by global names, on any device (copied to
  // the host one at a time). Thread-safe across ranks; once per rank.
  void write_shard(int rank, const std::vector<NamedTensor>& tensors);
  // The size and checksum of rank's shard once written here, or recorded by add_written.
  std::optional<ShardFileInfo> written(int rank) const;
  // Records the shard that another process wrote for `rank` (from its written()), so that
  // commit can list it.
  void add_written(int rank, ShardFileInfo info);

  // After every rank has written: writes and fsyncs manifest.json, renames the folder to
  // DIR/step_<N>, fsyncs DIR, replaces DIR/latest atomically, then removes checkpoints beyond
  // the newest keep_last (each renamed step_<N>.removing first) and what earlier removals
  // left. A removal that fails is a warning of the result, never an error: the next saves try
  // again. `state.step` must be this save's step.
  CommitResult commit(const TrainingState& state);

 private:
  struct Joined {
    bool value;
  };
  // What both kinds share: the checks of the arguments and the folders' names.
  CheckpointWriter(Joined joined, std::filesystem::path dir, int64_t step, int num_ranks,
                   CheckpointWriterOptions options);
  void check_rank(int rank, const char* call) const;
  // The removals after a commit, their failures as warnings of `result`.
  void prune(CommitResult& result) const;

  std::filesystem::path dir_, temp_, final_;
  int64_t step_;
  int num_ranks_;
  CheckpointWriterOptions options_;
  bool joined_ = false;
  bool owns_temp_ = false;  // made the .tmp folder: removes it unless committed
  mutable std::mutex mutex_;
  std::vector<std::optional<ShardFileInfo>> written_;
  std::vector<bool> started_;
  bool committed_ = false;
};

// A stored part of a tensor: elements [begin, end) of the flattened tensor, in one shard.
struct CheckpointPiece {
  int rank = 0;  // of the shard that holds it
  int64_t begin = 0, end = 0;
  uint64_t checksum = 0;  // XXH3-64 of its bytes
  size_t index = 0;       // in the shard's tensors()
};

// A tensor as a checkpoint holds it: whole in one shard, or in pieces (a sharded optimizer
// state) that tile its elements in order.
struct CheckpointTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;  // the global tensor's
  uint64_t bytes = 0;
  uint64_t checksum = 0;                // XXH3-64 of the bytes; 0 for a tensor in pieces
  int rank = 0;                         // of the shard that holds it, or its first piece
  std::vector<CheckpointPiece> pieces;  // by begin; one covering it all when stored whole
  bool pieced = false;                  // stored as pieces (perhaps one), not as a whole tensor
};

// What a model expects a checkpoint to hold.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

// A checkpoint whose files have been checked: all of them, or (opened with kLayoutOnly) their
// layout, with the bytes checked by verify() and every read. Reads are thread-safe (one rank
// per thread).
class Checkpoint {
 public:
  const std::filesystem::path& directory() const { return dir_; }
  const CheckpointManifest& manifest() const { return manifest_; }
  const TrainingState& state() const { return manifest_.state; }
  int64_t step() const { return manifest_.state.step; }
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }  // sorted by name
  const CheckpointTensor* find(std::string_view name) const;                 // null if absent
  // Throws std::out_of_range naming the shard count for a rank the checkpoint has no shard of.
  const ShardReader& shard(int rank) const;
  std::filesystem::path shard_path(int rank) const;

  // Throws CheckpointError unless the checkpoint is of the model with this fingerprint.
  void check_model(std::string_view fingerprint) const;
  // Throws CheckpointError unless the checkpoint holds exactly these tensors, with these dtypes
  // and shapes: names the first one missing, extra or different.
  void check_tensors(const std::vector<TensorSpec>& expected) const;
  // The first half of check_tensors: every expected tensor is there, with its dtype and
  // shape; others may be there too (a process that holds some of the ranks checks theirs).
  void check_holds(const std::vector<TensorSpec>& expected) const;

  // Reads tensor `name` into `dst` (any device), whose dtype and shape must be the saved ones.
  // The bytes are checked against the checksum again; on an error `dst` is left unchanged.
  void read(const std::string& name, const Tensor& dst) const;
  // Each tensor whole, or (with a piece) the range it names.
  void read(const std::vector<NamedTensor>& tensors) const;
  // Checks against their checksums every stored byte that read(tensors) would read, and
  // writes nothing: what a process that loads part of a checkpoint opened with kLayoutOnly
  // checks before it touches its model. Throws CheckpointError naming the file and tensor.
  void verify(const std::vector<NamedTensor>& tensors) const;
  // Reads elements [offset, offset + dst.numel()) of the flattened tensor `name` into `dst`
  // (any shape and device, the saved dtype), from whichever pieces hold them.
  void read_range(const std::string& name, int64_t offset, const Tensor& dst) const;
  std::vector<unsigned char> read_bytes(std::string_view name) const;
  // The bytes of elements [begin, end), each piece checked against its checksum again.
  std::vector<unsigned char> read_bytes(std::string_view name, int64_t begin, int64_t end) const;

 private:
  friend Checkpoint open_checkpoint(const std::filesystem::path& path, CheckpointCheck check);
  Checkpoint() = default;
  const CheckpointTensor& require(std::string_view name) const;

  std::filesystem::path dir_;
  CheckpointManifest manifest_;
  std::vector<std::unique_ptr<ShardReader>> shards_;
  std::vector<CheckpointTensor> tensors_;
};

// The checkpoint folder `path` names: DIR (through DIR/latest), DIR/latest, or DIR/step_<N>.
// Throws CheckpointError for anything else, including an unfinished .tmp save.
std::filesystem::path resolve_checkpoint_directory(const std::filesystem::path& path);

// Opens the checkpoint `path` names and checks all of it: the manifest, that its shards and
// only those are present, each shard's layout, metadata and checksums, the file sizes and
// checksums the manifest lists, and the step everywhere. Throws CheckpointError naming the
// file and the problem. With kLayoutOnly it reads the manifest and the shards' headers
// alone and leaves the checksums of the data (the tensors' and the files') out, for
// verify() of the tensors the caller will load.
Checkpoint open_checkpoint(const std::filesystem::path& path,
                           CheckpointCheck check = CheckpointCheck::kEveryByte);

}  // namespace conveyor
