// Thousands of randomly corrupted shards, manifests and `latest` files (bit flips, byte
// overwrites, truncations, header and number edits, appended bytes), from fixed seeds: each
// load ends in a CheckpointError naming a file of the checkpoint, or, when the corruption
// happened to be harmless, in a checkpoint whose every tensor is the one saved.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <random>

#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

constexpr int kIterations = 6000;
constexpr auto kTimeBudget = std::chrono::seconds(10);  // sanitizer builds run fewer

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  size_t below(size_t n) {
    return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_);
  }
  bool coin() { return below(2) == 0; }

  // One random corruption of `bytes`, whose JSON text (if any) is bytes[json_begin, json_end).
  std::string mutate(std::string bytes, size_t json_begin, size_t json_end) {
    switch (below(8)) {
      case 0:  // bit flips anywhere
        for (size_t k = 1 + below(8); k > 0 && !bytes.empty(); --k)
          bytes[below(bytes.size())] ^= static_cast<char>(1 << below(8));
        break;
      case 1:  // bytes overwritten with random values
        for (size_t k = 1 + below(4); k > 0 && !bytes.empty(); --k)
          bytes[below(bytes.size())] = static_cast<char>(below(256));
        break;
      case 2:  // truncation
        bytes.resize(below(bytes.size()));
        break;
      case 3:  // random bytes appended
        for (size_t k = 1 + below(16); k > 0; --k) bytes.push_back(static_cast<char>(below(256)));
        break;
      case 4: {  // a JSON character replaced by another that JSON gives meaning to
        static const std::string kSyntax = "{}[],:\"0123456789-.eE \\nul";
        if (json_end > json_begin)
          bytes[json_begin + below(json_end - json_begin)] = kSyntax[below(kSyntax.size())];
        break;
      }
      case 5: {  // a stretch of the JSON deleted or repeated
        if (json_end <= json_begin) break;
        const size_t at = json_begin + below(json_end - json_begin);
        const size_t n = 1 + below(std::min<size_t>(40, json_end - at));
        if (coin())
          bytes.erase(at, n);
        else
          bytes.insert(at, bytes.substr(at, n));
        break;
      }
      case 6: {  // a number of the JSON replaced by an interesting one
        static const char* kNumbers[] = {"0",
                                         "1",
                                         "-1",
                                         "7",
                                         "4294967296",
                                         "9223372036854775807",
                                         "9223372036854775808",
                                         "18446744073709551615",
                                         "18446744073709551616",
                                         "1e308",
                                         "2.5",
                                         "1099511627776"};
        std::vector<size_t> starts;
        for (size_t i = json_begin; i < json_end; ++i)
          if (std::isdigit(static_cast<unsigned char>(bytes[i])) &&
              (i == json_begin || !std::isdigit(static_cast<unsigned char>(bytes[i - 1]))))
            starts.push_back(i);
        if (starts.empty()) break;
        const size_t at = starts[below(starts.size())];
        size_t end = at;
        while (end < json_end && std::isdigit(static_cast<unsigned char>(bytes[end]))) ++end;
        bytes.replace(at, end - at, kNumbers[below(std::size(kNumbers))]);
        break;
      }
      case 7: {  // the safetensors length prefix changed
        if (bytes.size() < 8) break;
        uint64_t n = 0;
        for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[i]);
        const uint64_t choices[] = {
            n + 1,        n - 1,           n + 8, n / 2, 0, ~uint64_t{0}, uint64_t{1} << 40,
            bytes.size(), bytes.size() - 8};
        n = choices[below(std::size(choices))];
        for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i) & 0xff);
        break;
      }
    }
    return bytes;
  }

 private:
  std::mt19937_64 rng_;
};

size_t header_end(const std::string& shard) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(shard[i]);
  return 8 + n;
}

// Corrupts copies of the checkpoint of `step` in `pristine_dir` (its `num_shards` shards, the
// manifest or `latest`) for up to `iterations` rounds or `budget`: each load must end in a
// CheckpointError naming a file of the checkpoint, or hold every tensor as saved. Every other
// round opens the checkpoint as the processes of a run do (the layout alone, then verify()
// of the tensors, then the reads).
void fuzz_checkpoint(const fs::path& pristine_dir, int64_t step, int num_shards, int iterations,
                     std::chrono::seconds budget, uint64_t seed_base) {
  const fs::path pristine = pristine_dir / ("step_" + std::to_string(step));
  std::vector<std::string> names;
  for (int r = 0; r < num_shards; ++r)
    names.push_back("rank_" + std::to_string(r) + ".safetensors");
  names.push_back("manifest.json");
  const size_t manifest = names.size() - 1;
  std::vector<std::string> files;
  for (const auto& n : names) files.push_back(read_file(pristine / n));
  const std::string latest = read_file(pristine_dir / "latest");
  std::map<std::string, std::vector<unsigned char>> saved;
  {
    const Checkpoint ckpt = open_checkpoint(pristine);
    for (const CheckpointTensor& t : ckpt.tensors()) saved[t.name] = ckpt.read_bytes(t.name);
  }

  // Rewriting small files thousands of times is slow on a disk file system (ext4 flushes a
  // file truncated and rewritten), so the corrupted copies live in memory where possible.
  std::error_code ec;
  TempDir work(fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                   ? fs::path("/dev/shm")
                   : fs::temp_directory_path());
  const fs::path folder = work / ("step_" + std::to_string(step));
  fs::create_directory(folder);
  const auto start = std::chrono::steady_clock::now();
  int done = 0, errors = 0, loads = 0;
  for (; done < iterations; ++done) {
    if (std::chrono::steady_clock::now() - start > budget) break;
    Mutator mutator(seed_base + static_cast<uint64_t>(done));
    const size_t target = mutator.below(7);  // shards are the most likely targets
    for (size_t f = 0; f < files.size(); ++f) write_file(folder / names[f], files[f]);
    write_file(work / "latest", latest);
    std::string what;
    if (target < 4) {
      const size_t f = target % static_cast<size_t>(num_shards);
      write_file(folder / names[f], mutator.mutate(files[f], 8, header_end(files[f])));
      // Half the time the manifest vouches for the corrupted shard, so that the shard's own
      // checks must catch it.
      if (target >= 2) match_manifest_to_shards(folder);
      what = names[f] + (target >= 2 ? " (manifest matched)" : "");
    } else if (target < 6) {
      write_file(folder / names[manifest],
                 mutator.mutate(files[manifest], 0, files[manifest].size()));
      what = names[manifest];
    } else {
      write_file(work / "latest", mutator.mutate(latest, 0, latest.size()));
      what = "latest";
    }
    const bool layout_only = done % 2 == 1;
    SCOPED_TRACE("iteration " + std::to_string(done) + ", corrupted " + what +
                 (layout_only ? ", opened layout only" : ""));
    try {
      const Checkpoint ckpt = open_checkpoint(
          work.path(), layout_only ? CheckpointCheck::kLayoutOnly : CheckpointCheck::kEveryByte);
      if (layout_only) {
        std::vector<NamedTensor> every;
        for (const CheckpointTensor& t : ckpt.tensors()) every.push_back({t.name, Tensor{}});
        ckpt.verify(every);
      }
      ++loads;
      ASSERT_EQ(ckpt.tensors().size(), saved.size());
      for (const CheckpointTensor& t : ckpt.tensors()) {
        ASSERT_TRUE(saved.count(t.name)) << t.name;
        const auto bytes = ckpt.read_bytes(t.name);
        if (!t.pieced)
          EXPECT_EQ(checkpoint_io::xxh3_64(bytes.data(), bytes.size()), t.checksum) << t.name;
        EXPECT_EQ(bytes, saved[t.name]) << t.name;
      }
    } catch (const CheckpointError& e) {
      ++errors;
      const std::string message = e.what();
      EXPECT_NE(message.find(work.path().string()), std::string::npos)
          << "the error names no file of the checkpoint: " << message;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a CheckpointError: " << e.what();
    }
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("fuzz: %d corrupted checkpoints, %d rejected, %d harmless loads\n", done, errors,
              loads);
  EXPECT_GE(done, std::min(iterations, 500)) << "too few iterations ran within the time budget";
  EXPECT_GT(errors, done / 2);
}

TEST(CheckpointFuzz, CorruptedFilesNeverCrashNorLoadSilently) {
  TempDir pristine_dir;
  save_demo(pristine_dir.path(), 3);
  fuzz_checkpoint(pristine_dir.path(), 3, 2, kIterations, kTimeBudget, 0x5eed0000);
}

// A tensor in pieces over three shards: bad ranges and piece metadata never load silently.
TEST(CheckpointFuzz, CorruptedPiecesNeverCrashNorLoadSilently) {
  TempDir pristine_dir;
  save_pieced_demo(pristine_dir.path(), 4);
  fuzz_checkpoint(pristine_dir.path(), 4, 3, 1500, std::chrono::seconds(4), 0x91ece000);
}

}  // namespace
}  // namespace conveyor
