#pragma once
// What the checkpoint tests share: a temporary folder, seeded random tensors of every dtype,
// a small two-rank checkpoint with a complete training state, and raw file surgery (replace
// a shard's header, make the manifest agree with an edited shard) to build bad inputs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_io.h"
#include "support/test_util.h"

namespace conveyor::testing {

namespace fs = std::filesystem;

// A fresh folder, removed with everything in it at the end of the test; under `base`, the
// system's temporary folder by default.
class TempDir {
 public:
  explicit TempDir(const fs::path& base = fs::temp_directory_path()) {
    static std::atomic<int> counter{0};
    path_ =
        base / ("conveyor_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

inline DeviceContext& cpu_context() {
  static DeviceContext ctx(Device::cpu());
  return ctx;
}

// A CPU tensor of random values (never zeros) drawn from `seed`.
inline Tensor random_tensor(DType dtype, const Shape& shape, uint64_t seed) {
  Tensor t = cpu_context().empty(shape, dtype);
  const auto n = static_cast<size_t>(t.numel());
  if (dtype == DType::kI32) {
    const auto v = random_ints(n, seed, -1000000, 1000000);
    copy_from_host(t, v.data(), t.nbytes());
  } else if (dtype == DType::kBF16) {
    const auto f = random_floats(n, seed);
    std::vector<uint16_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = float_to_bf16(f[i]);
    copy_from_host(t, v.data(), t.nbytes());
  } else {
    const auto v = random_floats(n, seed);
    copy_from_host(t, v.data(), t.nbytes());
  }
  return t;
}

inline std::vector<unsigned char> tensor_bytes(const Tensor& t) {
  std::vector<unsigned char> out(t.nbytes());
  copy_to_host(out.data(), t, out.size());
  return out;
}

// The tensors of rank `rank` of the demo checkpoint: parameters and optimizer state of two
// blocks, a bf16 and an i32 tensor, a scalar and an empty tensor.
inline std::vector<NamedTensor> demo_tensors(int rank, uint64_t seed = 1) {
  const std::string b = "blocks." + std::to_string(rank);
  uint64_t s = seed * 100 + static_cast<uint64_t>(rank) * 10;
  return {{b + ".fc1.weight", random_tensor(DType::kF32, {6, 4}, s++)},
          {b + ".fc1.bias", random_tensor(DType::kF32, {6}, s++)},
          {"optimizer.m." + b + ".fc1.weight", random_tensor(DType::kF32, {6, 4}, s++)},
          {"optimizer.v." + b + ".fc1.weight", random_tensor(DType::kF32, {6, 4}, s++)},
          {b + ".gain.bf16", random_tensor(DType::kBF16, {3, 5}, s++)},
          {b + ".counts", random_tensor(DType::kI32, {7}, s++)},
          {b + ".scale", random_tensor(DType::kF32, {}, s++)},
          {b + ".empty", random_tensor(DType::kF32, {0, 3}, s++)}};
}

inline TrainingState demo_state(int64_t step, int num_ranks) {
  TrainingState s;
  s.step = step;
  s.model = {{"preset", "demo"}, {"d_model", 4}, {"n_layers", num_ranks}};
  s.model_fingerprint = model_fingerprint(s.model);
  for (int r = 0; r < num_ranks; ++r) s.stages.push_back({r, r, r, r + 1});
  s.schedule = "1f1b";
  s.microbatches = 4;
  s.optimizer.kind = "adamw";
  s.optimizer.lr = 0.1 / 3;  // not a short decimal: doubles must survive exactly
  s.optimizer_steps = step;
  s.lr_schedule = {step, 200};
  s.data = {"Markov chain (vocab 19)", (uint64_t{1} << 63) + 12345, 13};
  s.rng = {{"philox", {{"seed", 17}, {"counter", "18446744073709551615"}}}};
  return s;
}

// Saves the demo checkpoint of `step` into `dir` and returns its folder.
inline fs::path save_demo(const fs::path& dir, int64_t step, int num_ranks = 2,
                          CheckpointWriterOptions options = {}) {
  CheckpointWriter writer(dir, step, num_ranks, options);
  for (int r = 0; r < num_ranks; ++r) writer.write_shard(r, demo_tensors(r, step));
  return writer.commit(demo_state(step, num_ranks)).directory;
}

// A checkpoint of three shards holding a weight "w" [6, 4] whole (rank 0) and its moment
// "optimizer.m.w" in pieces: elements [0, 10) on rank 0, [10, 17) on rank 1, [17, 24) on 2.
struct PiecedDemo {
  Tensor weight = random_tensor(DType::kF32, {6, 4}, 11);
  Tensor moment = random_tensor(DType::kF32, {6, 4}, 12);
  std::vector<int64_t> cuts = {0, 10, 17, 24};

  Tensor piece(int i) const {
    const auto all = to_vector_f32(moment);
    const std::vector<float> part(all.begin() + cuts[i], all.begin() + cuts[i + 1]);
    Tensor t = cpu_context().empty({cuts[i + 1] - cuts[i]}, DType::kF32);
    copy_from_host(t, part.data(), t.nbytes());
    return t;
  }

  // Saves it as step `step` into `dir` and returns its folder.
  fs::path save(const fs::path& dir, int64_t step = 5) const {
    CheckpointWriter writer(dir, step, 3);
    for (int r = 0; r < 3; ++r) {
      std::vector<NamedTensor> tensors;
      if (r == 0) tensors.push_back({"w", weight});
      tensors.push_back({"optimizer.m.w", piece(r), TensorPiece{{6, 4}, cuts[r]}});
      writer.write_shard(r, tensors);
    }
    TrainingState state = demo_state(step, 1);
    state.replicas = 3;
    return writer.commit(state).directory;
  }
};

inline fs::path save_pieced_demo(const fs::path& dir, int64_t step) {
  return PiecedDemo{}.save(dir, step);
}

// The names in a folder, sorted.
inline std::vector<std::string> folder_names(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

inline std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file made of a header length, `header` and `data`, exactly as given.
inline std::string raw_safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i) & 0xff);
  return out + header + data;
}

// The header JSON text and the data of a safetensors file.
inline std::pair<std::string, std::string> split_safetensors(const std::string& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(file[i]);
  return {file.substr(8, n), file.substr(8 + n)};
}

// Replaces the header of the shard at `path` by `edit(header)` and keeps its data.
template <class Edit>
void edit_shard_header(const fs::path& path, Edit edit) {
  auto [header, data] = split_safetensors(read_file(path));
  nlohmann::json json = nlohmann::json::parse(header);
  edit(json);
  write_file(path, raw_safetensors(json.dump(), data));
}

// XXH3-64 of the compact JSON of a manifest without its manifest_xxh3_64, as
// docs/checkpoint-format.md spells it out: the reference for manifest.manifest_xxh3_64.
inline std::string manifest_checksum_of(nlohmann::json m) {
  m.erase("manifest_xxh3_64");
  const std::string text = m.dump();
  return checkpoint_io::hex64(checkpoint_io::xxh3_64(text.data(), text.size()));
}

// Makes manifest.json of `folder` list the present sizes and checksums of its shards (and
// agree with its own checksum), so a test of a bad shard meets the shard's own checks rather
// than the manifest's.
inline void match_manifest_to_shards(const fs::path& folder) {
  nlohmann::json m = nlohmann::json::parse(read_file(folder / "manifest.json"));
  for (auto& shard : m["shards"]) {
    const std::string bytes = read_file(folder / shard["file"].get<std::string>());
    shard["bytes"] = bytes.size();
    shard["xxh3_64"] = checkpoint_io::hex64(checkpoint_io::xxh3_64(bytes.data(), bytes.size()));
  }
  if (m.contains("manifest_xxh3_64")) m["manifest_xxh3_64"] = manifest_checksum_of(m);
  write_file(folder / "manifest.json", m.dump(2));
}

// XXH3-64 of the compact JSON of a manifest's training-state fields, as
// docs/checkpoint-format.md spells it out: the reference for manifest.state_xxh3_64.
inline std::string state_checksum_of(const nlohmann::json& m) {
  nlohmann::json sections = nlohmann::json::object();
  for (const char* key : {"step", "optimizer", "lr_schedule", "data", "rng"})
    if (m.contains(key)) sections[key] = m[key];
  const std::string text = sections.dump();
  return checkpoint_io::hex64(checkpoint_io::xxh3_64(text.data(), text.size()));
}

// Edits manifest.json of `folder` as JSON, as a writer of those values would have written it:
// its state_xxh3_64 and manifest_xxh3_64, when it has them, and its model_fingerprint are
// recomputed, so that the checks of the edited fields are what a test sees. edit_manifest_only
// leaves it as it was: an edit or a corruption.
template <class Edit>
void edit_manifest_only(const fs::path& folder, Edit edit) {
  nlohmann::json m = nlohmann::json::parse(read_file(folder / "manifest.json"));
  edit(m);
  write_file(folder / "manifest.json", m.dump(2));
}
template <class Edit>
void edit_manifest(const fs::path& folder, Edit edit) {
  edit_manifest_only(folder, [&](nlohmann::json& m) {
    const nlohmann::json fingerprint = m.value("model_fingerprint", nlohmann::json());
    edit(m);
    if (m.contains("state_xxh3_64")) m["state_xxh3_64"] = state_checksum_of(m);
    // Unless the edit is of the fingerprint itself.
    if (m.contains("model") && m.value("model_fingerprint", nlohmann::json()) == fingerprint)
      m["model_fingerprint"] = model_fingerprint(m["model"]);
    if (m.contains("manifest_xxh3_64")) m["manifest_xxh3_64"] = manifest_checksum_of(m);
  });
}

// The message of the CheckpointError `f` throws, or a failure when it throws none (or
// another exception).
template <class F>
std::string checkpoint_error_of(F f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a CheckpointError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected a CheckpointError, got none";
  return "";
}

// A saved two-rank demo checkpoint of step 6, for the loading tests to damage.
class CheckpointLoad : public ::testing::Test {
 protected:
  void SetUp() override { folder_ = save_demo(dir_.path(), 6); }
  fs::path manifest() const { return folder_ / "manifest.json"; }
  fs::path shard(int rank) const {
    return folder_ / ("rank_" + std::to_string(rank) + ".safetensors");
  }
  TempDir dir_;
  fs::path folder_;
};

}  // namespace conveyor::testing

// The CheckpointError of `statement` mentions every one of the given substrings.
#define EXPECT_CHECKPOINT_ERROR(statement, ...)                                                \
  do {                                                                                         \
    const std::string message_ = ::conveyor::testing::checkpoint_error_of([&] { statement; }); \
    for (const std::string& part_ : std::initializer_list<std::string>{__VA_ARGS__})           \
      EXPECT_NE(message_.find(part_), std::string::npos)                                       \
          << "the error does not mention \"" << part_ << "\": " << message_;                   \
  } while (0)
