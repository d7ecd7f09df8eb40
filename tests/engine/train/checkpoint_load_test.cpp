// Loading: the paths that name a checkpoint, every check of the manifest and of the shards
// against it, the model and tensor checks, reads that verify again, and re-partitioning:
// a checkpoint of one stage layout loads into another and training goes on bitwise.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <limits>
#include <thread>

#include "engine/schedule/generators.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"
#include "support/executor_fixture.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

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

TEST_F(CheckpointLoad, MalformedManifest) {
  std::string text = read_file(manifest());
  write_file(manifest(), text.substr(0, text.size() / 2));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(), "malformed JSON");
}

TEST_F(CheckpointLoad, ManifestWithADuplicateKey) {
  std::string text = read_file(manifest());
  text.insert(text.find("\"step\""), "\"step\": 7, ");
  write_file(manifest(), text);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(), "'step' appears twice");
}

TEST_F(CheckpointLoad, UnknownManifestVersion) {
  edit_manifest(folder_, [](auto& m) { m["format_version"] = 2; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(), "unknown format version 2",
                          "reads version 1");
}

TEST_F(CheckpointLoad, NotAManifest) {
  write_file(manifest(), R"({"hello": "world"})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), "not a Conveyor checkpoint manifest");
}

TEST_F(CheckpointLoad, ManifestFieldsAreChecked) {
  struct Case {
    const char* pointer;
    nlohmann::json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"/step", -1, "manifest.step is -1, expected an integer >= 0"},
      {"/step", "6", "manifest.step is \"6\""},
      {"/model", "tiny", "manifest.model is \"tiny\", expected an object"},
      {"/model_fingerprint", "", "model_fingerprint is empty"},
      {"/schedule/microbatches", 0, "manifest.schedule.microbatches is 0"},
      {"/optimizer/kind", "lion", "kind must be adamw or sgd"},
      {"/optimizer/lr", nullptr, "manifest.optimizer.lr is null, expected a finite number"},
      {"/data/position", -5, "manifest.data.position is -5"},
      {"/data/token", -1, "manifest.data.token is -1, expected an integer >= 0"},
      {"/data/token", "13", "manifest.data.token is \"13\""},
      {"/data/token", int64_t{1} << 31, "manifest.data.token is 2147483648, which is too large"},
      {"/data/extra", 1, "manifest.data has an unknown field 'extra'"},
      {"/shards/1/rank", 0, "manifest.shards[1].rank is 0, expected 1"},
      {"/shards/1/file", "../rank_1.safetensors", "not a plain file name"},
      {"/shards/1/file", "rank_0.safetensors", "which another shard also names"},
      {"/shards/0/xxh3_64", "12", "manifest.shards[0].xxh3_64 is \"12\", expected 16 hex digits"},
      {"/shards/0/bytes", 1.5, "manifest.shards[0].bytes is 1.5"},
      {"/shards", nlohmann::json::array(), "manifest.shards is empty"},
      {"/stages/1/rank", 2, "runs on rank 2, but there are 2 shards"},
      {"/stages/1/units", {2, 2}, "stages[1] holds units [2, 2)"},
      {"/stages/1/stage", 3, "stages[1] is stage 3, expected stage 1"},
      {"/stages/1/rank", 0, "place no stage on rank 1"},
      {"/extra", 1, "unknown field 'extra'"},
      // The demo is of step 6 over 2 units, its schedule spanning 200 steps.
      {"/optimizer/steps_taken", 1000000000000000,
       "manifest.optimizer.steps_taken is 1000000000000000, expected at most the checkpoint's step "
       "6"},
      {"/lr_schedule/step", 99,
       "manifest.lr_schedule.step is 99, expected at most the checkpoint's step 6"},
      {"/lr_schedule/total_steps", 5,
       "manifest.lr_schedule.step is 6, expected at most lr_schedule.total_steps 5"},
      {"/model/num_units", 4, "manifest.stages end at unit 2 but manifest.model.num_units is 4"},
      {"/model/num_units", 0, "manifest.model.num_units is 0, expected an integer >= 1"},
      {"/rng/batch_tokens", 0, "manifest.rng.batch_tokens is 0, expected an integer >= 1"},
      // Counts past the range of train's flags, which no run writes: a manifest re-sealed
      // with fresh checksums must not pass them.
      {"/schedule/microbatches", int64_t{1} << 40,
       "manifest.schedule.microbatches is 1099511627776, expected an integer in [1, 65536] (the "
       "range of train's --microbatches)"},
      {"/schedule/microbatches", uint64_t{1} << 63, "manifest.schedule.microbatches is "},
      {"/replicas", 2048,
       "manifest.replicas is 2048, expected a number of replicas from 2 to 1024"},
  };
  const std::string pristine = read_file(manifest());
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.pointer) + " = " + c.value.dump());
    write_file(manifest(), pristine);
    edit_manifest(folder_, [&](auto& m) { m[nlohmann::json::json_pointer(c.pointer)] = c.value; });
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(), c.message);
  }
  write_file(manifest(), pristine);
  edit_manifest(folder_, [](auto& m) { m.erase("rng"); });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), "manifest has no field 'rng'");
}

// Pipeline ranks and stages past train's --stages and --chunks are refused as the fields are
// read, before any of the shards they would name is looked for.
TEST_F(CheckpointLoad, MoreRanksOrStagesThanARunTakesAreRefused) {
  const std::string pristine = read_file(manifest());
  edit_manifest(folder_, [](auto& m) {
    nlohmann::json shard = m["shards"][0];
    m["shards"] = nlohmann::json::array();
    for (int r = 0; r <= 1024; ++r) {
      shard["rank"] = r;
      shard["file"] = "rank_" + std::to_string(r) + ".safetensors";
      m["shards"].push_back(shard);
    }
  });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "manifest.shards lists 1025 shards, 1025 pipeline ranks per replica, "
                          "expected at most 1024 (the range of train's --stages)");
  write_file(manifest(), pristine);
  edit_manifest(folder_, [](auto& m) {
    const nlohmann::json stage = m["stages"][0];
    m["stages"] = nlohmann::json::array();
    for (int s = 0; s <= 128; ++s) m["stages"].push_back(stage);
  });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "manifest.stages has 129 stages on 2 pipeline rank(s), expected at most "
                          "64 per rank (the range of train's --chunks)");
}

// The data token is optional: a checkpoint written before it was recorded loads without one.
TEST_F(CheckpointLoad, AManifestWithoutTheDataTokenLoads) {
  EXPECT_EQ(open_checkpoint(folder_).state().data.token, std::optional<int32_t>(13));
  edit_manifest(folder_, [](auto& m) { m["data"].erase("token"); });
  EXPECT_FALSE(open_checkpoint(folder_).state().data.token.has_value());
}

// The shards carry their own checksums; state_xxh3_64 covers what a resume takes from the
// manifest alone, so an edited token, counter or setting is refused rather than loaded. The
// checks of single fields come first and name the field; a manifest written before the
// checksum was recorded loads without it.
TEST_F(CheckpointLoad, AnEditedTrainingStateIsRefusedByItsChecksum) {
  const std::string pristine = read_file(manifest());
  const nlohmann::json saved = nlohmann::json::parse(pristine);
  ASSERT_TRUE(saved.contains("state_xxh3_64"));
  EXPECT_EQ(saved["state_xxh3_64"], state_checksum_of(saved));
  EXPECT_EQ(open_checkpoint(folder_).manifest().state_checksum,
            checkpoint_io::parse_hex64(saved["state_xxh3_64"].get<std::string>()));

  const std::vector<std::pair<const char*, nlohmann::json>> edits = {
      {"/data/token", 14},    {"/data/source", "other tokens"}, {"/rng/seed", 8},
      {"/optimizer/lr", 0.5}, {"/optimizer/steps_taken", 5},    {"/lr_schedule/total_steps", 300},
  };
  for (const auto& [pointer, value] : edits) {
    SCOPED_TRACE(std::string(pointer) + " = " + value.dump());
    write_file(manifest(), pristine);
    edit_manifest_only(folder_, [&](auto& m) { m[nlohmann::json::json_pointer(pointer)] = value; });
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(),
                            "the training state (step, optimizer, lr_schedule, data, rng) does not "
                            "match its checksum manifest.state_xxh3_64",
                            "the file was edited or corrupted");
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_, CheckpointCheck::kLayoutOnly),
                            "does not match its checksum");
  }

  // Another layout of the same values is no edit.
  write_file(manifest(), saved.dump(4));
  EXPECT_NO_THROW(open_checkpoint(folder_));

  write_file(manifest(), pristine);
  edit_manifest_only(folder_, [](auto& m) { m["state_xxh3_64"] = "12"; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "manifest.state_xxh3_64 is \"12\", expected 16 hex digits");

  write_file(manifest(), pristine);
  edit_manifest_only(folder_, [](auto& m) {
    m.erase("state_xxh3_64");
    m.erase("manifest_xxh3_64");
    m["data"]["token"] = 14;
  });
  const Checkpoint old = open_checkpoint(folder_);
  EXPECT_FALSE(old.manifest().state_checksum.has_value());
  EXPECT_EQ(old.state().data.token, std::optional<int32_t>(14));
}

// The model description is covered by its fingerprint: a resume compares fingerprints, and
// a description that no longer matches its own fingerprint (a flipped d_model) was edited or
// corrupted, which verify must say rather than pass.
TEST_F(CheckpointLoad, AnEditedModelDescriptionIsRefusedByItsFingerprint) {
  const std::string pristine = read_file(manifest());
  const std::vector<std::pair<const char*, nlohmann::json>> edits = {
      {"/model/d_model", 6},
      {"/model/preset", "demo2"},
      {"/model_fingerprint", "xxh3_64:fedcba9876543210"},
  };
  for (const auto& [pointer, value] : edits) {
    SCOPED_TRACE(std::string(pointer) + " = " + value.dump());
    write_file(manifest(), pristine);
    edit_manifest_only(folder_, [&](auto& m) { m[nlohmann::json::json_pointer(pointer)] = value; });
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(),
                            "the model description does not match its fingerprint "
                            "manifest.model_fingerprint",
                            "the file was edited or corrupted");
  }
  // A fingerprint corrupted out of its form is no less an edit.
  write_file(manifest(), pristine);
  edit_manifest_only(folder_, [](auto& m) { m["model_fingerprint"] = "xxh3]64:0123"; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), "does not match its fingerprint");
  // Another layout of the same description is no edit.
  write_file(manifest(), nlohmann::json::parse(pristine).dump(4));
  EXPECT_NO_THROW(open_checkpoint(folder_));
}

// manifest_xxh3_64 covers every other field, those no check of their own covers (the
// schedule's) included; a manifest without it (written before it was recorded) loads
// unchecked, and another layout of the same values is no edit.
TEST_F(CheckpointLoad, AnEditedManifestIsRefusedByItsChecksum) {
  const std::string pristine = read_file(manifest());
  const nlohmann::json saved = nlohmann::json::parse(pristine);
  ASSERT_TRUE(saved.contains("manifest_xxh3_64"));
  EXPECT_EQ(saved["manifest_xxh3_64"], manifest_checksum_of(saved));
  for (const auto& [pointer, value] : std::vector<std::pair<const char*, nlohmann::json>>{
           {"/schedule/microbatches", 6}, {"/schedule/name", "3f1b"}}) {
    SCOPED_TRACE(std::string(pointer) + " = " + value.dump());
    write_file(manifest(), pristine);
    edit_manifest_only(folder_, [&](auto& m) { m[nlohmann::json::json_pointer(pointer)] = value; });
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(),
                            "the manifest does not match its checksum manifest.manifest_xxh3_64",
                            "the file was edited or corrupted");
  }
  write_file(manifest(), saved.dump(4));
  EXPECT_NO_THROW(open_checkpoint(folder_));
  write_file(manifest(), pristine);
  edit_manifest_only(folder_, [](auto& m) {
    m.erase("manifest_xxh3_64");
    m["schedule"]["name"] = "3f1b";
  });
  EXPECT_EQ(open_checkpoint(folder_).state().schedule, "3f1b");
  write_file(manifest(), pristine);
  edit_manifest_only(folder_, [](auto& m) { m["manifest_xxh3_64"] = 7; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "manifest.manifest_xxh3_64 is 7, expected 16 hex digits");
}

// What the trainer writes: rng.batch_tokens, the tokens each step draws, ties the data
// position and the other counters to the step.
TEST_F(CheckpointLoad, ATrainersCountersAgreeWithItsStep) {
  const std::string pristine = read_file(manifest());
  auto trainer_like = [](nlohmann::json& m) {
    m["rng"] = {{"seed", 1}, {"batch_tokens", 512}};
    m["data"]["position"] = 6 * 512;
  };
  edit_manifest(folder_, trainer_like);
  EXPECT_EQ(open_checkpoint(folder_).state().data.position, 6u * 512u);
  struct Case {
    const char* pointer;
    nlohmann::json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"/data/position", std::numeric_limits<uint64_t>::max(),
       "manifest.data.position is 18446744073709551615, expected step x rng.batch_tokens = 6 x "
       "512 = 3072"},
      {"/data/position", 3071, "manifest.data.position is 3071"},
      {"/rng/batch_tokens", std::numeric_limits<uint64_t>::max(),
       "manifest.rng.batch_tokens is 18446744073709551615, expected an integer >= 1"},
      {"/rng/batch_tokens", std::numeric_limits<uint64_t>::max() / 4, "(which overflows)"},
      {"/optimizer/steps_taken", 5,
       "manifest.optimizer.steps_taken is 5, expected the checkpoint's step 6"},
      {"/lr_schedule/step", 5, "manifest.lr_schedule.step is 5, expected the checkpoint's step 6"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.pointer) + " = " + c.value.dump());
    write_file(manifest(), pristine);
    edit_manifest(folder_, [&](auto& m) {
      trainer_like(m);
      m[nlohmann::json::json_pointer(c.pointer)] = c.value;
    });
    EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(), c.message);
  }
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

// Training state of a whole pipeline, saved from one stage layout and loaded into others.
class CheckpointRepartition : public ::testing::Test {
 protected:
  static constexpr int kMicrobatches = 4;
  static constexpr int kTokens = 5;

  static void train_step(PipelineExecutor& ex, int step) {
    ex.run_step(make_microbatches(kMicrobatches, kTokens, step), 1.0f / (kMicrobatches * kTokens),
                step, 1e-2);
  }
  static fs::path save(PipelineExecutor& ex, const fs::path& dir, int64_t step,
                       const std::vector<StageRange>& ranges) {
    CheckpointWriter writer(dir, step, ex.num_ranks());
    std::vector<std::thread> threads;
    for (int r = 0; r < ex.num_ranks(); ++r)
      threads.emplace_back([&, r] { writer.write_shard(r, rank_checkpoint_tensors(ex, r)); });
    for (auto& t : threads) t.join();
    TrainingState state;
    state.step = step;
    state.model = describe_model(test_model());
    state.model_fingerprint = model_fingerprint(state.model);
    state.stages = stage_placements(ex.schedule(), ranges);
    state.schedule = ex.schedule().name;
    state.microbatches = kMicrobatches;
    state.optimizer = ex.optimizer(0).config();
    state.optimizer_steps = ex.optimizer(0).steps_taken();
    return writer.commit(state).directory;
  }
  static std::vector<StageRange> ranges_of(int stages) {
    const ModelDescription model = reference_model(test_model());
    return stage_ranges(model, partition_blocks(model, stages, PartitionSpec::uniform()));
  }
  static std::vector<std::vector<unsigned char>> all_state(PipelineExecutor& ex) {
    std::vector<std::pair<std::string, std::vector<unsigned char>>> named;
    for (int r = 0; r < ex.num_ranks(); ++r)
      for (const NamedTensor& t : rank_checkpoint_tensors(ex, r))
        named.emplace_back(t.name, tensor_bytes(t.tensor));
    std::sort(named.begin(), named.end());
    std::vector<std::vector<unsigned char>> out;
    for (auto& [_, bytes] : named) out.push_back(std::move(bytes));
    return out;
  }
  TempDir dir_;
};

TEST_F(CheckpointRepartition, TwoStagesResumeAsOneAndAsThreeBitwise) {
  auto two = make_executor(schedule::generate_1f1b(2, kMicrobatches));
  train_step(*two, 1);
  train_step(*two, 2);
  const fs::path folder = save(*two, dir_.path(), 2, ranges_of(2));

  const Checkpoint ckpt = open_checkpoint(dir_.path());
  EXPECT_EQ(ckpt.state().stages.size(), 2u);
  for (int stages : {1, 3}) {
    SCOPED_TRACE(std::to_string(stages) + " stages");
    auto other = make_executor(schedule::generate_1f1b(stages, kMicrobatches));
    ckpt.check_model(model_fingerprint(describe_model(test_model())));
    ckpt.check_tensors(checkpoint_tensor_specs(*other));
    for (int r = 0; r < other->num_ranks(); ++r) load_rank_checkpoint(ckpt, *other, r);
    EXPECT_EQ(all_state(*other), all_state(*two));
    EXPECT_EQ(other->optimizer(0).steps_taken(), 2);
  }
  // Training goes on from the checkpoint exactly as without it.
  auto resumed = make_executor(schedule::generate_1f1b(3, kMicrobatches));
  for (int r = 0; r < resumed->num_ranks(); ++r) load_rank_checkpoint(ckpt, *resumed, r);
  train_step(*two, 3);
  train_step(*resumed, 3);
  EXPECT_EQ(all_state(*resumed), all_state(*two));
}

TEST_F(CheckpointRepartition, SgdStateHasItsOwnNames) {
  OptimizerConfig sgd = test_optimizer();
  sgd.kind = "sgd";
  auto ex = make_executor(schedule::generate_1f1b(1, kMicrobatches), {Device::cpu()},
                          PartitionSpec::uniform(), sgd);
  const auto tensors = rank_checkpoint_tensors(*ex, 0);
  const auto params = ex->rank_parameters(0);
  ASSERT_EQ(tensors.size(), 2 * params.size());
  EXPECT_EQ(tensors[0].name, params[0]->name);
  EXPECT_EQ(tensors[params.size()].name, "optimizer.momentum." + params[0]->name);
  auto adamw = make_executor(schedule::generate_1f1b(1, kMicrobatches));
  EXPECT_EQ(rank_checkpoint_tensors(*adamw, 0).size(), 3 * params.size());
  EXPECT_EQ(rank_checkpoint_tensors(*adamw, 0)[params.size() + 1].name,
            "optimizer.v." + params[0]->name);
}

TEST(CheckpointModel, FingerprintsTellModelsApart) {
  const ModelConfig a = test_model();
  ModelConfig b = a;
  b.hidden += 1;
  EXPECT_EQ(model_fingerprint(describe_model(a)), model_fingerprint(describe_model(test_model())));
  EXPECT_NE(model_fingerprint(describe_model(a)), model_fingerprint(describe_model(b)));
  EXPECT_EQ(model_fingerprint(describe_model(a)).rfind("xxh3_64:", 0), 0u);
}

}  // namespace
}  // namespace conveyor
