#pragma once
// One checkpoint shard: the tensors of one rank, keyed by global names, in the safetensors
// layout, with this metadata (all values are strings, as safetensors requires):
//   "format": "conveyor", "format_version": "1", "step": "<N>", "rank": "<r>",
//   "xxh3_64:<tensor name>": "<16 hex digits>"   one per tensor: XXH3-64 of its bytes
//   "piece:<tensor name>": "{\"shape\":[8,4],\"elements\":[0,16]}"   only for a stored piece:
//       elements [0, 16) of the flattened global tensor of that shape (stored 1-D, [16])
// docs/checkpoint-format.md describes the whole checkpoint.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/tensor.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/safetensors.h"

namespace conveyor {

inline constexpr int kCheckpointFormatVersion = 1;

// Where a stored piece lies in its global tensor: elements [offset, offset + numel) of the
// flattened tensor of `shape` (a sharded optimizer state keeps such a range per rank).
struct TensorPiece {
  Shape shape;
  int64_t offset = 0;
};

// A tensor and the global name it is saved under (e.g. "blocks.3.fc1.weight"); with `piece`,
// the tensor (1-D) is that range of the global tensor, the other pieces saved elsewhere.
struct NamedTensor {
  std::string name;
  Tensor tensor;
  std::optional<TensorPiece> piece = std::nullopt;
};

// Size and XXH3-64 of a whole shard file.
struct ShardFileInfo {
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

// Writes `tensors` (on any device; a device tensor is copied to the host one at a time) as the
// shard of `rank` at `step` to `path`, then fsyncs it. The tensors must not change meanwhile
// (their checksums are taken before the data is written; a change throws). I/O errors throw a
// CheckpointError naming the file; bad names throw std::invalid_argument. With
// `refuse_non_finite`, an f32 tensor holding a NaN or an infinity throws a CheckpointError
// naming it, before the file is made.
ShardFileInfo write_shard_file(const std::filesystem::path& path, int64_t step, int rank,
                               const std::vector<NamedTensor>& tensors,
                               bool refuse_non_finite = false);

// The range of a global tensor that a stored piece holds, from its "piece:" metadata.
struct PieceRange {
  Shape shape;                 // of the global tensor
  int64_t begin = 0, end = 0;  // elements of the flattened global tensor
};

struct ShardTensor : SafetensorsEntry {
  uint64_t checksum = 0;            // XXH3-64 of the bytes, from the metadata
  std::optional<PieceRange> piece;  // absent: the whole tensor, of `shape`
};

// How much of a checkpoint's files opening it checks.
enum class CheckpointCheck {
  kEveryByte,   // the layout, the metadata and every byte against its checksum
  kLayoutOnly,  // the layout and the metadata, from the headers alone; the bytes are checked
                // by verify() and by every read
};

// An open shard whose layout and metadata have been checked, and with kEveryByte every
// checksum too (of each tensor, and of the whole file for the manifest to compare). Reads are
// thread-safe.
class ShardReader {
 public:
  // Throws CheckpointError.
  explicit ShardReader(const std::filesystem::path& path,
                       CheckpointCheck check = CheckpointCheck::kEveryByte);

  const std::filesystem::path& path() const { return file_.path(); }
  int64_t step() const { return step_; }
  int rank() const { return rank_; }
  uint64_t file_bytes() const { return file_bytes_; }
  // XXH3-64 of the whole file; only when opened with kEveryByte (which reads all of it).
  std::optional<uint64_t> file_checksum() const { return file_checksum_; }
  const std::vector<ShardTensor>& tensors() const { return tensors_; }  // in data order

  // Reads the bytes of `tensor` (one of tensors()) into `dst` and checks them again, so that
  // a file changed since it was opened is caught rather than loaded.
  void read(const ShardTensor& tensor, void* dst) const;
  // Checks the bytes of `tensor` against its checksum, reading them a chunk at a time.
  void verify(const ShardTensor& tensor) const;

 private:
  void verify_data(uint64_t data_start);
  // XXH3-64 of bytes [begin, end) of the file, also fed to `also` when given.
  uint64_t hash_bytes(uint64_t begin, uint64_t end, std::vector<unsigned char>& buffer,
                      checkpoint_io::Xxh3Stream* also) const;
  void check_tensor_hash(const ShardTensor& tensor, uint64_t actual) const;

  checkpoint_io::File file_;
  int64_t step_ = 0;
  int rank_ = 0;
  uint64_t file_bytes_ = 0;
  std::optional<uint64_t> file_checksum_;
  uint64_t data_start_ = 0;
  std::vector<ShardTensor> tensors_;
};

}  // namespace conveyor
