#include "engine/train/checkpoint_shard.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_map>

#include "engine/train/checkpoint_error.h"

namespace conveyor {
namespace {

using checkpoint_io::in_quotes;

constexpr const char* kChecksumPrefix = "xxh3_64:";
constexpr const char* kPiecePrefix = "piece:";

std::string piece_metadata(const TensorPiece& piece, int64_t numel) {
  return nlohmann::json{{"shape", piece.shape}, {"elements", {piece.offset, piece.offset + numel}}}
      .dump();
}

// The "piece:" metadata of `tensor`, checked against its stored entry: a shape of
// non-negative sizes, a non-empty element range inside it, stored as a 1-D tensor of that
// range's length.
PieceRange parse_piece(const std::string& text, const SafetensorsEntry& tensor,
                       const std::string& file) {
  const std::string where = file + ": the piece metadata of tensor " + in_quotes(tensor.name);
  nlohmann::json value;
  try {
    value = checkpoint_io::parse_json_strictly(text, file);
  } catch (const CheckpointError&) {
    throw CheckpointError(where + " is " + in_quotes(text) +
                          ", expected {\"shape\": [sizes], \"elements\": [begin, end]}");
  }
  const bool well_formed = value.is_object() && value.size() == 2 && value.contains("shape") &&
                           value["shape"].is_array() && value.contains("elements") &&
                           value["elements"].is_array() && value["elements"].size() == 2;
  if (!well_formed)
    throw CheckpointError(where + " is " + in_quotes(text) +
                          ", expected {\"shape\": [sizes], \"elements\": [begin, end]}");
  PieceRange piece;
  int64_t numel = 1;
  for (const nlohmann::json& d : value["shape"]) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 40))
      throw CheckpointError(where + " has the size " + d.dump() +
                            " in its shape, expected a non-negative integer below 2^40");
    piece.shape.push_back(d.get<int64_t>());
    if (numel != 0 && piece.shape.back() > std::numeric_limits<int64_t>::max() / numel)
      throw CheckpointError(where + ": the shape " + value["shape"].dump() +
                            " has more elements than fit in 64 bits");
    numel *= piece.shape.back();
  }
  const nlohmann::json& elements = value["elements"];
  if (!elements[0].is_number_unsigned() || !elements[1].is_number_unsigned() ||
      elements[1].get<uint64_t>() > static_cast<uint64_t>(numel) ||
      elements[0].get<uint64_t>() >= elements[1].get<uint64_t>())
    throw CheckpointError(where + " holds elements " + elements.dump() + ", expected [begin, end)" +
                          " with begin < end <= " + std::to_string(numel) +
                          " (the elements of a tensor of shape " + shape_to_string(piece.shape) +
                          ")");
  piece.begin = elements[0].get<int64_t>();
  piece.end = elements[1].get<int64_t>();
  if (tensor.shape != Shape{piece.end - piece.begin})
    throw CheckpointError(where + " says it holds " + std::to_string(piece.end - piece.begin) +
                          " elements, but the tensor is stored with shape " +
                          shape_to_string(tensor.shape) + ", expected [" +
                          std::to_string(piece.end - piece.begin) + "]");
  return piece;
}
constexpr size_t kReadChunk = size_t{4} << 20;

// The bytes of a tensor on the host: its own memory on the CPU, a copy of a device tensor.
class HostBytes {
 public:
  explicit HostBytes(const Tensor& t) {
    if (t.device().is_cpu()) {
      data_ = t.raw();
    } else {
      staging_.resize(t.nbytes());
      copy_to_host(staging_.data(), t, t.nbytes());
      data_ = staging_.data();
    }
    size_ = t.nbytes();
  }
  const void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::vector<unsigned char> staging_;
  const void* data_ = nullptr;
  size_t size_ = 0;
};

// A non-negative decimal integer written by this format: digits only, no sign, no spaces.
template <class Int>
bool parse_decimal(const std::string& text, Int& value) {
  if (text.empty() || text.size() > 19) return false;
  for (char c : text)
    if (c < '0' || c > '9') return false;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() && end == text.data() + text.size();
}

// Throws a CheckpointError naming the first element of `bytes` (f32 values) that is a NaN
// or an infinity.
void refuse_a_non_finite_value(const HostBytes& bytes, const std::string& name, int64_t step,
                               int rank) {
  const float* values = static_cast<const float*>(bytes.data());
  const size_t count = bytes.size() / sizeof(float);
  for (size_t i = 0; i < count; ++i) {
    if (std::isfinite(values[i])) continue;
    const float v = values[i];
    throw CheckpointError("cannot save step " + std::to_string(step) + ": tensor " +
                          in_quotes(name) + " of rank " + std::to_string(rank) + " holds " +
                          (std::isnan(v) ? "nan"
                           : v > 0       ? "inf"
                                         : "-inf") +
                          " at element " + std::to_string(i) +
                          ": the training diverged (lower the learning rate); the checkpoints "
                          "saved before stay as they are");
  }
}

}  // namespace

ShardFileInfo write_shard_file(const std::filesystem::path& path, int64_t step, int rank,
                               const std::vector<NamedTensor>& tensors, bool refuse_non_finite) {
  std::vector<SafetensorsEntry> entries;
  std::vector<uint64_t> checksums;
  std::map<std::string, std::string> metadata = {
      {"format", "conveyor"},
      {"format_version", std::to_string(kCheckpointFormatVersion)},
      {"step", std::to_string(step)},
      {"rank", std::to_string(rank)}};
  for (const NamedTensor& t : tensors) {
    if (!t.tensor.defined())
      throw std::invalid_argument("checkpoint: tensor " + in_quotes(t.name) + " of rank " +
                                  std::to_string(rank) + " is undefined (has no storage)");
    entries.push_back({t.name, t.tensor.dtype(), t.tensor.shape()});
    const HostBytes bytes(t.tensor);
    if (refuse_non_finite && t.tensor.dtype() == DType::kF32)
      refuse_a_non_finite_value(bytes, t.name, step, rank);
    checksums.push_back(checkpoint_io::xxh3_64(bytes.data(), bytes.size()));
    metadata[kChecksumPrefix + t.name] = checkpoint_io::hex64(checksums.back());
    if (t.piece) {
      if (t.tensor.shape().size() != 1 || t.piece->offset < 0 ||
          t.piece->offset + t.tensor.numel() > shape_numel(t.piece->shape) || t.tensor.numel() == 0)
        throw std::invalid_argument("checkpoint: piece " + in_quotes(t.name) + " of rank " +
                                    std::to_string(rank) + " of shape " +
                                    shape_to_string(t.tensor.shape()) + " at element " +
                                    std::to_string(t.piece->offset) +
                                    " is not a non-empty 1-D range of a tensor of shape " +
                                    shape_to_string(t.piece->shape));
      metadata[kPiecePrefix + t.name] = piece_metadata(*t.piece, t.tensor.numel());
    }
  }
  const std::string header = encode_safetensors_header(entries, metadata);
  uint64_t file_bytes = header.size();
  for (const NamedTensor& t : tensors) file_bytes += t.tensor.nbytes();

  checkpoint_io::File file = checkpoint_io::File::create(path, file_bytes);
  checkpoint_io::Xxh3Stream file_hash;
  file.write_all(header.data(), header.size());
  file_hash.update(header.data(), header.size());
  uint64_t total = header.size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const HostBytes bytes(tensors[i].tensor);
    if (checkpoint_io::xxh3_64(bytes.data(), bytes.size()) != checksums[i])
      throw CheckpointError("tensor " + in_quotes(tensors[i].name) + " changed while " +
                            checkpoint_io::shown_path(path) +
                            " was being written; tensors must not be updated during a save");
    file.write_all(bytes.data(), bytes.size());
    file_hash.update(bytes.data(), bytes.size());
    total += bytes.size();
    if (i == 0) checkpoint_io::pause_for_crash_test("shard");
  }
  file.sync();
  file.close();
  return {total, file_hash.digest()};
}

ShardReader::ShardReader(const std::filesystem::path& path, CheckpointCheck check)
    : file_(checkpoint_io::File::open_for_reading(path)) {
  const std::string name = checkpoint_io::shown_path(path);
  auto check_metadata = [&](const std::map<std::string, std::string>& metadata) {
    auto entry = [&](const char* key) -> const std::string& {
      const auto it = metadata.find(key);
      if (it == metadata.end())
        throw CheckpointError(name + ": the metadata has no " + in_quotes(key) +
                              " entry: not a Conveyor checkpoint shard");
      return it->second;
    };
    if (entry("format") != "conveyor")
      throw CheckpointError(name + ": the metadata names format " + in_quotes(entry("format")) +
                            ", expected 'conveyor': not a Conveyor checkpoint shard");
    const std::string& version = entry("format_version");
    if (version != std::to_string(kCheckpointFormatVersion))
      throw CheckpointError(name + ": unknown format version " + in_quotes(version) +
                            " (this build reads version " +
                            std::to_string(kCheckpointFormatVersion) + ")");
    if (!parse_decimal(entry("step"), step_))
      throw CheckpointError(name + ": the metadata's step " + in_quotes(entry("step")) +
                            " is not a non-negative integer");
    if (!parse_decimal(entry("rank"), rank_))
      throw CheckpointError(name + ": the metadata's rank " + in_quotes(entry("rank")) +
                            " is not a non-negative integer");
  };
  SafetensorsHeader header = read_safetensors_header(file_, check_metadata);
  file_bytes_ = file_.size();
  data_start_ = header.data_start;

  std::unordered_map<std::string, size_t> index;
  for (SafetensorsEntry& e : header.tensors) {
    index.emplace(e.name, tensors_.size());
    tensors_.push_back({std::move(e), 0, std::nullopt});
  }
  std::vector<bool> has_checksum(tensors_.size(), false);
  for (const auto& [key, value] : header.metadata) {
    if (key == "format" || key == "format_version" || key == "step" || key == "rank") continue;
    if (key.starts_with(kPiecePrefix)) {
      const std::string tensor = key.substr(std::char_traits<char>::length(kPiecePrefix));
      const auto it = index.find(tensor);
      if (it == index.end())
        throw CheckpointError(name + ": the metadata has a piece entry for tensor " +
                              in_quotes(tensor) + ", which the file does not hold");
      tensors_[it->second].piece = parse_piece(value, tensors_[it->second], name);
      continue;
    }
    if (!key.starts_with(kChecksumPrefix))
      throw CheckpointError(
          name + ": unknown metadata entry " + in_quotes(key) + " (format version " +
          std::to_string(kCheckpointFormatVersion) +
          " has format, format_version, step, rank, xxh3_64:<tensor> and piece:<tensor>)");
    const std::string tensor = key.substr(std::char_traits<char>::length(kChecksumPrefix));
    const auto it = index.find(tensor);
    if (it == index.end())
      throw CheckpointError(name + ": the metadata has a checksum for tensor " + in_quotes(tensor) +
                            ", which the file does not hold");
    const auto checksum = checkpoint_io::parse_hex64(value);
    if (!checksum)
      throw CheckpointError(name + ": the checksum of tensor " + in_quotes(tensor) + " is " +
                            in_quotes(value) + ", expected 16 hex digits");
    tensors_[it->second].checksum = *checksum;
    has_checksum[it->second] = true;
  }
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (!has_checksum[i])
      throw CheckpointError(name + ": tensor " + in_quotes(tensors_[i].name) +
                            " has no checksum in the metadata (no entry " +
                            in_quotes(kChecksumPrefix + tensors_[i].name) + ")");
  if (check == CheckpointCheck::kEveryByte) verify_data(header.data_start);
}

void ShardReader::verify_data(uint64_t data_start) {
  // The tensors tile the data section in order, so hashing them one after another reads the
  // whole file once, front to back.
  std::vector<unsigned char> buffer(
      static_cast<size_t>(std::min<uint64_t>(kReadChunk, std::max<uint64_t>(data_start, 1))));
  checkpoint_io::Xxh3Stream file_hash;
  hash_bytes(0, data_start, buffer, &file_hash);
  for (const ShardTensor& t : tensors_)
    check_tensor_hash(t, hash_bytes(data_start + t.begin, data_start + t.end, buffer, &file_hash));
  file_checksum_ = file_hash.digest();
}

uint64_t ShardReader::hash_bytes(uint64_t begin, uint64_t end, std::vector<unsigned char>& buffer,
                                 checkpoint_io::Xxh3Stream* also) const {
  checkpoint_io::Xxh3Stream hash;
  for (uint64_t pos = begin; pos < end;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(end - pos, kReadChunk));
    if (buffer.size() < n) buffer.resize(n);
    file_.read_exactly_at(buffer.data(), n, pos);
    hash.update(buffer.data(), n);
    if (also) also->update(buffer.data(), n);
    pos += n;
  }
  return hash.digest();
}

void ShardReader::check_tensor_hash(const ShardTensor& tensor, uint64_t actual) const {
  if (actual != tensor.checksum)
    throw CheckpointError(checkpoint_io::shown_path(path()) + ": checksum mismatch in tensor " +
                          in_quotes(tensor.name) + ": its bytes hash to " +
                          checkpoint_io::hex64(actual) + ", the metadata says " +
                          checkpoint_io::hex64(tensor.checksum) + ": the data is corrupt");
}

void ShardReader::verify(const ShardTensor& tensor) const {
  std::vector<unsigned char> buffer;
  check_tensor_hash(
      tensor, hash_bytes(data_start_ + tensor.begin, data_start_ + tensor.end, buffer, nullptr));
}

void ShardReader::read(const ShardTensor& tensor, void* dst) const {
  file_.read_exactly_at(dst, static_cast<size_t>(tensor.bytes()), data_start_ + tensor.begin);
  const uint64_t actual = checkpoint_io::xxh3_64(dst, static_cast<size_t>(tensor.bytes()));
  if (actual != tensor.checksum)
    throw CheckpointError(checkpoint_io::shown_path(path()) + ": checksum mismatch in tensor " +
                          in_quotes(tensor.name) + " (hashes to " + checkpoint_io::hex64(actual) +
                          ", the metadata says " + checkpoint_io::hex64(tensor.checksum) +
                          "): the file changed after it was verified");
}

}  // namespace conveyor
