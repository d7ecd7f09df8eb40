#pragma once
// The safetensors layout (the file format of the Hugging Face `safetensors` library), used by
// every checkpoint shard so that any tool of that ecosystem opens it:
//   8 bytes   N, the length of the header, unsigned little-endian
//   N bytes   JSON header, optionally padded with spaces:
//             {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//              "__metadata__": {"<key>": "<value>", ...}}
//   the rest  the tensors' bytes (row-major, little-endian); offsets are relative to the start
//             of this data section, and the ranges cover it exactly: no gap, no overlap.
// The reader accepts nothing else. It checks every rule and every size for overflow, caps the
// header at kMaxSafetensorsHeaderBytes (the limit of the safetensors library), and reports
// what is wrong as a CheckpointError naming the file.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/tensor.h"
#include "engine/train/checkpoint_io.h"

namespace conveyor {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// "F32", "BF16", "I32": the safetensors names of Conveyor's dtypes, and back.
const char* safetensors_dtype_name(DType dtype);
std::optional<DType> parse_safetensors_dtype(std::string_view name);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // byte range [begin, end) of the data section
  uint64_t end = 0;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data section: 8 + N
};

// The bytes that precede the data (length, JSON, spaces up to a multiple of 8 bytes) for
// `tensors` stored one after another in the given order; sets their begin and end. Throws
// std::invalid_argument for an empty, reserved, repeated or non-UTF-8 name.
std::string encode_safetensors_header(std::vector<SafetensorsEntry>& tensors,
                                      const std::map<std::string, std::string>& metadata);

// The header length N from the first 8 bytes of `file`, a file of `file_bytes` bytes: checked
// against the cap and the file's size.
uint64_t decode_safetensors_header_length(const unsigned char (&prefix)[8], uint64_t file_bytes,
                                          const std::string& file);
// Called with the metadata as soon as the JSON has parsed, before the tensors are checked, so
// that a format version can be rejected before rules of another version are applied.
using MetadataCheck = std::function<void(const std::map<std::string, std::string>&)>;

// The tensors and metadata of `json`, the N header bytes of `file`, a file of `file_bytes`
// bytes, checked against every rule above.
SafetensorsHeader decode_safetensors_header(std::string_view json, uint64_t file_bytes,
                                            const std::string& file,
                                            const MetadataCheck& check_metadata = {});
// Both, from an open file.
SafetensorsHeader read_safetensors_header(const checkpoint_io::File& file,
                                          const MetadataCheck& check_metadata = {});

}  // namespace conveyor
