// Loading: the paths that name a checkpoint, every check of the shards against the manifest
// (checkpoint_manifest_load_test.cpp checks the manifest itself), the model and tensor
// checks, and reads that verify again.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

TEST_F(CheckpointLoad, OpensThroughTheFolderItsLatestOrTheStepFolder) {
  save_demo(dir_.path(), 9);
  EXPECT_EQ(open_checkpoint(dir_.path()).step(), 9);
  EXPECT_EQ(open_checkpoint(dir_ / "latest").step(), 9);
  EXPECT_EQ(open_checkpoint(dir_.path().string() + "/").step(), 9);
  EXPECT_EQ(open_checkpoint(folder_).step(), 6);
  EXPECT_EQ(open_checkpoint(dir_ / "step_9").directory(), dir_ / "step_9");
}

TEST_F(CheckpointLoad, NothingThere) {
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_ / "nope"), "nope", "does not exist");
  fs::create_directory(dir_ / "empty");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_ / "empty"), "empty", "holds no checkpoint");
  // A folder where the file `latest` belongs is said as such, whichever of the two is given.
  fs::create_directories(dir_ / "saves" / "latest");
  for (const fs::path& given : {dir_ / "saves", dir_ / "saves" / "latest"})
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(given),
                            "saves/latest' is a folder, where a file "
                            "naming the newest checkpoint of '" +
                                (dir_ / "saves").string() + "' is expected");
}

// A folder name may hold a line break; every message names it escaped, on one line.
TEST_F(CheckpointLoad, AFolderNamedWithALineBreakIsNamedOnOneLine) {
  const fs::path odd = dir_ / "two\nlines";
  const auto one_line = [](const std::string& message) {
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_NE(message.find("two\\nlines"), std::string::npos) << message;
  };
  one_line(checkpoint_error_of([&] { open_checkpoint(odd); }));
  fs::create_directory(odd);
  one_line(checkpoint_error_of([&] { open_checkpoint(odd); }));
  save_demo(odd, 3);
  one_line(checkpoint_error_of([&] { open_checkpoint(odd / "step_3" / "manifest.json"); }));
  fs::remove(odd / "step_3" / "rank_1.safetensors");
  one_line(checkpoint_error_of([&] { open_checkpoint(odd); }));
  one_line(*save_refusal(odd, 3));
}

// Paths that name no checkpoint throw NotACheckpointError (a tool's bad input); a checkpoint
// folder whose own files fail a check throws a CheckpointError of the other kind.
TEST_F(CheckpointLoad, NamingNoCheckpointIsToldApartFromADamagedOne) {
  save_demo(dir_.path(), 9);
  fs::create_directory(dir_ / "empty");
  fs::create_directory(dir_ / "step_10.tmp");
  write_file(dir_ / "notes.txt", "not a checkpoint\n");
  for (const fs::path& path :
       {dir_ / "nope", dir_ / "empty", dir_ / "notes.txt", dir_ / "step_10.tmp",
        dir_ / "step_9" / "manifest.json", fs::path("/dev/null")})
    EXPECT_THROW(open_checkpoint(path), NotACheckpointError) << path;
  write_file(dir_ / "latest", "step_77\n");
  try {
    open_checkpoint(dir_.path());
    ADD_FAILURE() << "a 'latest' naming a missing folder was opened";
  } catch (const NotACheckpointError& e) {
    ADD_FAILURE() << "a damaged checkpoint folder said to be none: " << e.what();
  } catch (const CheckpointError&) {
  }
}

TEST_F(CheckpointLoad, LatestNamingAMissingFolder) {
  write_file(dir_ / "latest", "step_77\n");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_.path()), "latest' names step_77", "does not exist");
}

TEST_F(CheckpointLoad, LatestNamingSomethingElse) {
  for (const char* text : {"../../etc", "step_6/../step_6", "", "step_x"}) {
    write_file(dir_ / "latest", text);
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_.path()), "latest",
                            "should name a checkpoint folder step_<N>");
  }
}

// A file of the checkpoint given for the checkpoint: the folder is named, not the file's text.
TEST_F(CheckpointLoad, AFileOfTheCheckpointNamesItsFolder) {
  save_demo(dir_.path(), 9);
  const fs::path step = dir_ / "step_9";
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(step / "manifest.json"),
                          "is a file of the checkpoint folder '" + step.string() + "'",
                          "give the folder itself");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(step / "rank_0.safetensors"),
                          "is a file of the checkpoint folder '" + step.string() + "'");
  write_file(dir_ / "notes.txt", "not a checkpoint\n");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_ / "notes.txt"),
                          "is a file, neither a checkpoint folder nor a 'latest' file",
                          "give DIR, DIR/latest or DIR/step_<N>");
  // A copy of `latest` under another name still opens what it names.
  write_file(dir_ / "latest.kept", "step_9\n");
  EXPECT_EQ(open_checkpoint(dir_ / "latest.kept").step(), 9);
}

// Opening a FIFO for reading blocks until a writer comes: a FIFO in place of a shard or of
// the manifest must be refused at once, naming it.
TEST_F(CheckpointLoad, AFifoInPlaceOfAFileIsRefusedNotWaitedOn) {
  for (const fs::path& file : {shard(1), manifest()}) {
    SCOPED_TRACE(file.string());
    const fs::path kept = dir_ / "kept";
    fs::rename(file, kept);
    ASSERT_EQ(::mkfifo(file.c_str(), 0644), 0);
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), file.string(),
                            "is a FIFO (named pipe), not a regular file");
    fs::remove(file);
    fs::rename(kept, file);
  }
  fs::create_directory(dir_ / "folder.safetensors");
  EXPECT_THROW(checkpoint_io::File::open_for_reading(dir_ / "folder.safetensors"), CheckpointError);
  EXPECT_NO_THROW(open_checkpoint(folder_));
}

TEST_F(CheckpointLoad, AShardListedButMissing) {
  fs::remove(shard(1));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_.path()), shard(1).string(),
                          "is listed in '" + manifest().string() + "' but missing");
}

// A shard may be a symbolic link to its file; one that loops is said as such, not as missing.
TEST_F(CheckpointLoad, AShardThatIsASymbolicLink) {
  const fs::path kept = dir_ / "kept.safetensors";
  fs::rename(shard(1), kept);
  fs::create_symlink(kept, shard(1));
  EXPECT_NO_THROW(open_checkpoint(folder_, CheckpointCheck::kEveryByte));
  fs::remove(shard(1));
  fs::create_symlink(shard(1).filename(), shard(1));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(1).string(),
                          "is listed in '" + manifest().string() + "' but cannot be opened",
                          "symbolic links");
}

TEST_F(CheckpointLoad, AShardPresentButNotListed) {
  fs::copy_file(shard(1), folder_ / "rank_2.safetensors");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir_.path()), "rank_2.safetensors",
                          "present but not listed");
}

TEST_F(CheckpointLoad, ShardAndManifestStepsDisagree) {
  TempDir other;
  save_demo(other.path(), 7);
  fs::copy_file(other / "step_7" / "rank_1.safetensors", shard(1),
                fs::copy_options::overwrite_existing);
  match_manifest_to_shards(folder_);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(1).string(), "holds step 7",
                          "is of step 6");
}

TEST_F(CheckpointLoad, FolderAndManifestStepsDisagree) {
  edit_manifest(folder_, [](auto& m) { m["step"] = 5; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), "is of step 5", "named for step 6");
}

TEST_F(CheckpointLoad, ShardsSwapped) {
  fs::rename(shard(0), folder_ / "swap");
  fs::rename(shard(1), shard(0));
  fs::rename(folder_ / "swap", shard(1));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(0).string(), "shard of rank 1",
                          "lists it for rank 0");
}

TEST_F(CheckpointLoad, ShardSizeDiffersFromTheManifest) {
  edit_manifest(folder_, [](auto& m) { m["shards"][0]["bytes"] = 12; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(0).string(), "but", "says 12");
}

TEST_F(CheckpointLoad, ShardChecksumDiffersFromTheManifest) {
  // An edit the shard's own checks cannot see (the same header with its keys in another
  // order, padded to the same length) is caught by the manifest's checksum of the file.
  const auto [header, data] = split_safetensors(read_file(shard(0)));
  std::string reordered = nlohmann::json::parse(header).dump();  // keys sorted
  ASSERT_NE(reordered, header.substr(0, reordered.size()));
  reordered.resize(header.size(), ' ');
  write_file(shard(0), raw_safetensors(reordered, data));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(0).string(), "XXH3-64",
                          "changed after it was saved");
}

TEST_F(CheckpointLoad, ATensorInTwoShards) {
  edit_shard_header(shard(1), [](auto& h) {
    auto entry = h["blocks.1.scale"];
    h.erase("blocks.1.scale");
    h["blocks.0.scale"] = entry;
    h["__metadata__"]["xxh3_64:blocks.0.scale"] = h["__metadata__"]["xxh3_64:blocks.1.scale"];
    h["__metadata__"].erase("xxh3_64:blocks.1.scale");
  });
  match_manifest_to_shards(folder_);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "rank_1.safetensors' holds tensor 'blocks.0.scale'",
                          "rank_0.safetensors' holds too");
}

TEST_F(CheckpointLoad, ABadShardIsNamedEvenWhenTheManifestAgrees) {
  std::string file = read_file(shard(1));
  write_file(shard(1), file.substr(0, file.size() - 3));
  match_manifest_to_shards(folder_);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(1).string(), "truncated");
}

TEST_F(CheckpointLoad, AnotherModel) {
  const Checkpoint ckpt = open_checkpoint(folder_);
  ckpt.check_model(model_fingerprint(testing::demo_state(2, 2).model));
  EXPECT_CHECKPOINT_ERROR(ckpt.check_model("xxh3_64:fedcba9876543210"), manifest().string(),
                          "another model", "fedcba9876543210", "\"preset\":\"demo\"");
  EXPECT_THROW(ckpt.check_model("xxh3_64:fedcba9876543210"), CheckpointOfAnotherModel);
}

TEST_F(CheckpointLoad, TensorsMissingExtraOrMisshapen) {
  const Checkpoint ckpt = open_checkpoint(folder_);
  std::vector<TensorSpec> specs;
  for (int r = 0; r < 2; ++r)
    for (const NamedTensor& t : demo_tensors(r))
      specs.push_back({t.name, t.tensor.dtype(), t.tensor.shape()});
  ckpt.check_tensors(specs);

  auto missing = specs;
  missing.push_back({"blocks.2.fc1.weight", DType::kF32, {6, 4}});
  EXPECT_CHECKPOINT_ERROR(ckpt.check_tensors(missing), "no tensor 'blocks.2.fc1.weight'",
                          "f32[6, 4]", "which the model needs");
  auto extra = specs;
  extra.erase(extra.begin() + 1);
  EXPECT_CHECKPOINT_ERROR(ckpt.check_tensors(extra),
                          "rank_0.safetensors' holds tensor 'blocks.0.fc1.bias'", "does not have");
  auto shape = specs;
  shape[0].shape = {4, 6};
  EXPECT_CHECKPOINT_ERROR(ckpt.check_tensors(shape), "tensor 'blocks.0.fc1.weight' is f32[6, 4]",
                          "expects f32[4, 6]");
  auto dtype = specs;
  dtype[0].dtype = DType::kBF16;
  EXPECT_CHECKPOINT_ERROR(ckpt.check_tensors(dtype), "expects bf16[6, 4]");
}

TEST_F(CheckpointLoad, ReadChecksTheDestinationAndLeavesItAloneOnError) {
  const Checkpoint ckpt = open_checkpoint(folder_);
  Tensor wrong_shape = random_tensor(DType::kF32, {4, 6}, 3);
  const auto before = tensor_bytes(wrong_shape);
  EXPECT_CHECKPOINT_ERROR(ckpt.read("blocks.0.fc1.weight", wrong_shape), "is f32[6, 4]",
                          "expects f32[4, 6]");
  Tensor wrong_dtype = random_tensor(DType::kI32, {6, 4}, 3);
  EXPECT_CHECKPOINT_ERROR(ckpt.read("blocks.0.fc1.weight", wrong_dtype), "expects i32[6, 4]");
  EXPECT_CHECKPOINT_ERROR(ckpt.read("blocks.9.fc1.weight", wrong_shape), "no tensor 'blocks.9");
  EXPECT_EQ(tensor_bytes(wrong_shape), before);
}

TEST_F(CheckpointLoad, AFileChangedAfterOpeningIsCaughtOnRead) {
  const Checkpoint ckpt = open_checkpoint(folder_);
  std::string file = read_file(shard(0));
  file[file.size() - 1] ^= 1;  // the last byte of blocks.0.scale
  write_file(shard(0), file);
  Tensor dst = random_tensor(DType::kF32, {}, 4);
  const auto before = tensor_bytes(dst);
  EXPECT_CHECKPOINT_ERROR(ckpt.read("blocks.0.scale", dst), shard(0).string(),
                          "checksum mismatch in tensor 'blocks.0.scale'", "changed after");
  EXPECT_EQ(tensor_bytes(dst), before);
}

TEST_F(CheckpointLoad, LayoutOnlyLeavesTheBytesToVerify) {
  std::string file = read_file(shard(0));
  file[file.size() - 1] ^= 1;  // the last byte of blocks.0.scale
  write_file(shard(0), file);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), shard(0).string(),
                          "checksum mismatch in tensor 'blocks.0.scale'");

  const Checkpoint ckpt = open_checkpoint(folder_, CheckpointCheck::kLayoutOnly);
  EXPECT_FALSE(ckpt.shard(0).file_checksum().has_value());
  ckpt.verify(demo_tensors(1));  // the other shard's tensors are sound
  ckpt.verify({demo_tensors(0)[0]});
  EXPECT_CHECKPOINT_ERROR(ckpt.verify(demo_tensors(0)), shard(0).string(),
                          "checksum mismatch in tensor 'blocks.0.scale'", "corrupt");
  Tensor dst = random_tensor(DType::kF32, {}, 4);
  EXPECT_CHECKPOINT_ERROR(ckpt.read("blocks.0.scale", dst), "checksum mismatch");
  EXPECT_CHECKPOINT_ERROR(ckpt.verify({{"blocks.7.scale", dst}}), "no tensor 'blocks.7.scale'");
}

TEST_F(CheckpointLoad, LayoutOnlyStillChecksTheLayout) {
  std::string file = read_file(shard(1));
  write_file(shard(1), file.substr(0, file.size() - 3));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_, CheckpointCheck::kLayoutOnly),
                          shard(1).string());
  match_manifest_to_shards(folder_);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_, CheckpointCheck::kLayoutOnly), shard(1).string(),
                          "truncated");
  write_file(shard(1), file);
  match_manifest_to_shards(folder_);
  edit_manifest(folder_, [](auto& m) { m["step"] = 7; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_, CheckpointCheck::kLayoutOnly), "step");
}

TEST(PiecedLayoutOnly, VerifyReadsOnlyThePiecesARangeOverlaps) {
  TempDir dir;
  const PiecedDemo saved;
  const fs::path folder = saved.save(dir.path());
  // Corrupt the last byte of rank 1's shard: its piece [10, 17) of optimizer.m.w.
  const fs::path middle = folder / "rank_1.safetensors";
  std::string file = read_file(middle);
  file[file.size() - 1] ^= 1;
  write_file(middle, file);
  const Checkpoint ckpt = open_checkpoint(folder, CheckpointCheck::kLayoutOnly);
  auto range = [](int64_t offset, int64_t count) {
    return NamedTensor{"optimizer.m.w", cpu_context().empty({count}, DType::kF32),
                       TensorPiece{{6, 4}, offset}};
  };
  ckpt.verify({range(0, 10), range(17, 7), {"w", Tensor{}}});
  EXPECT_CHECKPOINT_ERROR(ckpt.verify({range(8, 3)}), middle.string(),
                          "checksum mismatch in tensor 'optimizer.m.w'");
  EXPECT_CHECKPOINT_ERROR(ckpt.verify({{"optimizer.m.w", Tensor{}}}), middle.string());
}

}  // namespace
}  // namespace conveyor
