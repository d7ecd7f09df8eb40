#include "engine/train/safetensors.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <stdexcept>

#include "engine/train/checkpoint_error.h"

namespace conveyor {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this build writes host memory as it is");

using checkpoint_io::in_quotes;
using nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";

std::string dims_to_string(const std::vector<uint64_t>& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// A JSON value for an error message, cut to a readable length.
std::string excerpt(const json& value) {
  std::string text = value.dump();
  return text.size() <= 80 ? text : text.substr(0, 80) + "...";
}

SafetensorsEntry decode_entry(const std::string& name, const json& value, const std::string& file) {
  const std::string what = file + ": tensor " + in_quotes(name);
  if (name.empty()) throw CheckpointError(file + ": a tensor has an empty name");
  if (!value.is_object())
    throw CheckpointError(what + " is " + excerpt(value) +
                          ", expected an object with dtype, shape and data_offsets");
  for (const auto& [field, _] : value.items())
    if (field != "dtype" && field != "shape" && field != "data_offsets")
      throw CheckpointError(what + " has an unknown field " + in_quotes(field) +
                            " (expected dtype, shape and data_offsets)");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!value.contains(field)) throw CheckpointError(what + " has no " + field);

  SafetensorsEntry entry;
  entry.name = name;
  const json& dtype = value["dtype"];
  const auto parsed = dtype.is_string()
                          ? parse_safetensors_dtype(dtype.get_ref<const std::string&>())
                          : std::nullopt;
  if (!parsed)
    throw CheckpointError(what + " has dtype " + excerpt(dtype) +
                          "; checkpoints hold only F32, BF16 and I32");
  entry.dtype = *parsed;

  const json& shape = value["shape"];
  if (!shape.is_array())
    throw CheckpointError(what + " has shape " + excerpt(shape) +
                          ", expected a list of non-negative integers");
  std::vector<uint64_t> dims;
  for (const json& d : shape) {
    if (!d.is_number_unsigned())
      throw CheckpointError(what + " has shape " + excerpt(shape) +
                            ", expected a list of non-negative integers");
    dims.push_back(d.get<uint64_t>());
  }
  // Element count and bytes in 64 bits, rejecting any overflow (a shape such as [2^40, 2^40]
  // must not wrap around to a small, plausible size).
  uint64_t numel = 1;
  for (uint64_t d : dims)
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(numel, d, &numel))
      throw CheckpointError(what + " has shape " + dims_to_string(dims) +
                            ", whose element count overflows 64 bits");
  uint64_t bytes = 0;
  if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(entry.dtype)), &bytes))
    throw CheckpointError(what + " has shape " + dims_to_string(dims) +
                          ", whose size in bytes overflows 64 bits");
  for (uint64_t d : dims) entry.shape.push_back(static_cast<int64_t>(d));

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    throw CheckpointError(what + " has data_offsets " + excerpt(offsets) +
                          ", expected [begin, end] with non-negative integers");
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.end < entry.begin)
    throw CheckpointError(what + " has data_offsets [" + std::to_string(entry.begin) + ", " +
                          std::to_string(entry.end) + "], which end before they begin");
  if (entry.end - entry.begin != bytes)
    throw CheckpointError(what + " is " + safetensors_dtype_name(entry.dtype) +
                          dims_to_string(dims) + " (" + std::to_string(bytes) +
                          " bytes) but its data_offsets [" + std::to_string(entry.begin) + ", " +
                          std::to_string(entry.end) + "] hold " +
                          std::to_string(entry.end - entry.begin) + " bytes");
  return entry;
}

std::string range(const SafetensorsEntry& e) {
  return "[" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ")";
}

// The ranges, sorted, must tile [0, data_bytes) exactly.
void check_layout(std::vector<SafetensorsEntry>& tensors, uint64_t data_bytes,
                  const std::string& file) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t position = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& t : tensors) {
    if (t.begin < position)
      throw CheckpointError(file + ": tensor " + in_quotes(t.name) + " at bytes " + range(t) +
                            " overlaps tensor " + in_quotes(previous->name) + " at bytes " +
                            range(*previous) + " of the data section");
    if (t.begin > position)
      throw CheckpointError(file + ": bytes [" + std::to_string(position) + ", " +
                            std::to_string(t.begin) + ") of the data section, before tensor " +
                            in_quotes(t.name) +
                            ", belong to no tensor (the ranges must leave no gap)");
    if (t.end > data_bytes)
      throw CheckpointError(file + ": tensor " + in_quotes(t.name) + " at bytes " + range(t) +
                            " runs past the end of the data section, which has " +
                            std::to_string(data_bytes) + " bytes: the file is truncated");
    position = t.end;
    previous = &t;
  }
  if (position != data_bytes)
    throw CheckpointError(file + ": the last " + std::to_string(data_bytes - position) +
                          " bytes of the file belong to no tensor (the data section has " +
                          std::to_string(data_bytes) + " bytes, the tensors end at byte " +
                          std::to_string(position) + ")");
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kI32})
    if (name == safetensors_dtype_name(d)) return d;
  return std::nullopt;
}

std::string encode_safetensors_header(std::vector<SafetensorsEntry>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (SafetensorsEntry& t : tensors) {
    if (t.name.empty()) throw std::invalid_argument("safetensors: a tensor has an empty name");
    if (t.name == kMetadataKey || header.contains(t.name))
      throw std::invalid_argument("safetensors: tensor name " + in_quotes(t.name) +
                                  (t.name == kMetadataKey ? " is reserved" : " appears twice"));
    const uint64_t bytes =
        static_cast<uint64_t>(shape_numel(t.shape)) * static_cast<uint64_t>(dtype_size(t.dtype));
    t.begin = offset;
    t.end = offset + bytes;
    offset = t.end;
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {t.begin, t.end}}};
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    throw std::invalid_argument(std::string("safetensors: a tensor name or metadata entry is not "
                                            "valid UTF-8 (") +
                                e.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t{text.size()} >> (8 * i) & 0xff);
  return out + text;
}

uint64_t decode_safetensors_header_length(const unsigned char (&prefix)[8], uint64_t file_bytes,
                                          const std::string& file) {
  if (file_bytes < 8)
    throw CheckpointError(file + ": the file has " + std::to_string(file_bytes) +
                          " bytes, fewer than the 8 of a safetensors header length: truncated");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | prefix[i];
  if (n > kMaxSafetensorsHeaderBytes)
    throw CheckpointError(file + ": header length " + std::to_string(n) + " exceeds the limit of " +
                          std::to_string(kMaxSafetensorsHeaderBytes) +
                          " bytes: the file is corrupt or not a safetensors file");
  if (n > file_bytes - 8)
    throw CheckpointError(file + ": header length " + std::to_string(n) +
                          " runs past the end of the file (" + std::to_string(file_bytes) +
                          " bytes): the file is truncated or not a safetensors file");
  if (n < 2)
    throw CheckpointError(file + ": header length " + std::to_string(n) +
                          " is too short for a JSON header: not a safetensors file");
  return n;
}

SafetensorsHeader decode_safetensors_header(std::string_view text, uint64_t file_bytes,
                                            const std::string& file,
                                            const MetadataCheck& check_metadata) {
  if (text.empty() || text.front() != '{')
    throw CheckpointError(file + ": the header does not begin with '{': not a safetensors file");
  const uint64_t data_start = 8 + text.size();
  if (data_start > file_bytes)
    throw CheckpointError(file + ": the header runs past the end of the file: truncated");
  const json header = checkpoint_io::parse_json_strictly(text, file, /*max_depth=*/8);
  if (!header.is_object())
    throw CheckpointError(file + ": the header is not a JSON object: not a safetensors file");

  SafetensorsHeader out;
  out.data_start = data_start;
  if (const auto it = header.find(kMetadataKey); it != header.end()) {
    if (!it->is_object())
      throw CheckpointError(file + ": __metadata__ is " + excerpt(*it) +
                            ", expected an object of strings");
    for (const auto& [k, v] : it->items()) {
      if (!v.is_string())
        throw CheckpointError(file + ": __metadata__ entry " + in_quotes(k) + " is " + excerpt(v) +
                              ", expected a string");
      out.metadata.emplace(k, v.get<std::string>());
    }
  }
  // The metadata says which format this is, so it speaks before the tensors are judged.
  if (check_metadata) check_metadata(out.metadata);
  for (const auto& [key, value] : header.items())
    if (key != kMetadataKey) out.tensors.push_back(decode_entry(key, value, file));
  check_layout(out.tensors, file_bytes - data_start, file);
  return out;
}

SafetensorsHeader read_safetensors_header(const checkpoint_io::File& file,
                                          const MetadataCheck& check_metadata) {
  const std::string name = checkpoint_io::shown_path(file.path());
  const uint64_t size = file.size();
  unsigned char prefix[8] = {};
  if (size >= 8) file.read_exactly_at(prefix, sizeof prefix, 0);
  const uint64_t n = decode_safetensors_header_length(prefix, size, name);
  std::string text(n, '\0');
  file.read_exactly_at(text.data(), text.size(), 8);
  return decode_safetensors_header(text, size, name, check_metadata);
}

}  // namespace conveyor
