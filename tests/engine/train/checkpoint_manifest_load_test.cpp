// Loading, the manifest: malformed or unknown, every field checked as it is read, the
// limits a run takes, and the checksums and fingerprint that catch an edit no field check
// sees.
#include <gtest/gtest.h>

#include <limits>

#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

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

TEST_F(CheckpointLoad, ManifestWithANulByte) {
  const std::string text = read_file(manifest());
  write_file(manifest(), text + std::string("\0{\"step\": 7}", 13));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(),
                          "a NUL byte at byte " + std::to_string(text.size()) + " of its JSON");
}

TEST_F(CheckpointLoad, UnknownManifestVersion) {
  edit_manifest(folder_, [](auto& m) { m["format_version"] = 2; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(), "unknown format version 2",
                          "reads version 1");
}

// A version of the wrong type or none is said as such, not as a version this build lacks.
TEST_F(CheckpointLoad, ManifestVersionThatIsNotAnInteger) {
  edit_manifest(folder_, [](auto& m) { m["format_version"] = "1"; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(),
                          "manifest.format_version is \"1\", expected the integer 1");
  edit_manifest(folder_, [](auto& m) { m.erase("format_version"); });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), manifest().string(),
                          "manifest has no field 'format_version'");
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
      {"/optimizer/kind", "li\non", "kind must be adamw or sgd, got 'li\\non'"},
      {"/optimizer/lr", nullptr, "manifest.optimizer.lr is null, expected a finite number"},
      {"/data/position", -5, "manifest.data.position is -5"},
      {"/data/token", -1, "manifest.data.token is -1, expected an integer >= 0"},
      {"/data/token", "13", "manifest.data.token is \"13\""},
      {"/data/token", int64_t{1} << 31, "manifest.data.token is 2147483648, which is too large"},
      {"/data/extra", 1, "manifest.data has an unknown field 'extra'"},
      {"/data/contents", "xxh3_64:12",
       "manifest.data.contents is \"xxh3_64:12\", expected \"xxh3_64:\" and 16 lowercase hex "
       "digits"},
      {"/data/contents", "xxh3_64:0123456789ABCDEF", "manifest.data.contents is"},
      {"/data/contents", "0123456789abcdef", "manifest.data.contents is"},
      {"/data/contents", 7, "manifest.data.contents is 7"},
      // The demo's token is 13: one a model of 13 tokens does not have.
      {"/model/vocab", 13,
       "manifest.data.token is 13, expected a token id below manifest.model.vocab 13"},
      {"/shards/1/rank", 0, "manifest.shards[1].rank is 0, expected 1"},
      {"/shards/1/file", "../rank_1.safetensors", "not a plain file name"},
      {"/shards/1/file", "rank_0.safetensors", "which another shard also names"},
      {"/shards/0/xxh3_64", "12", "manifest.shards[0].xxh3_64 is \"12\", expected 16 hex digits"},
      {"/shards/0/bytes", 1.5, "manifest.shards[0].bytes is 1.5"},
      {"/shards", nlohmann::json::array(), "manifest.shards is empty"},
      {"/stages/1/rank", 2,
       "manifest.stages[1] runs on rank 2, expected a rank below 2: the 2 shards make 2 pipeline "
       "ranks"},
      // Two replicas of the demo's 2 shards have one pipeline rank each.
      {"/replicas", 2,
       "manifest.stages[1] runs on rank 1, expected a rank below 1: the 2 shards make 1 pipeline "
       "rank in each of 2 replicas"},
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
       "range of TrainConfig::microbatches)"},
      {"/schedule/microbatches", uint64_t{1} << 63, "manifest.schedule.microbatches is "},
      {"/replicas", 2048,
       "manifest.replicas is 2048, expected a number of replicas from 2 to 1024"},
      {"/schedule/data_parallel", 0,
       "manifest.schedule.data_parallel is 0, expected an integer in [1, 1024] (the range of "
       "TrainConfig::data_parallel)"},
      {"/schedule/data_parallel", -1, "manifest.schedule.data_parallel is -1, expected an integer"},
      {"/schedule/data_parallel", "2",
       "manifest.schedule.data_parallel is \"2\", expected an integer"},
      {"/schedule/data_parallel", 1025,
       "manifest.schedule.data_parallel is 1025, expected an integer in [1, 1024]"},
      {"/schedule/data_parallel", 1.5, "manifest.schedule.data_parallel is 1.5"},
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
                          "expected at most 1024 (the range of TrainConfig::stages)");
  write_file(manifest(), pristine);
  edit_manifest(folder_, [](auto& m) {
    const nlohmann::json stage = m["stages"][0];
    m["stages"] = nlohmann::json::array();
    for (int s = 0; s <= 128; ++s) m["stages"].push_back(stage);
  });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "manifest.stages has 129 stages on 2 pipeline rank(s), expected at most "
                          "64 per rank (the range of TrainConfig::chunks)");
}

// The data token is optional: a checkpoint written before it was recorded loads without one.
TEST_F(CheckpointLoad, AManifestWithoutTheDataTokenLoads) {
  EXPECT_EQ(open_checkpoint(folder_).state().data.token, std::optional<int32_t>(13));
  edit_manifest(folder_, [](auto& m) { m["data"].erase("token"); });
  EXPECT_FALSE(open_checkpoint(folder_).state().data.token.has_value());
}

// The digest of the data's bytes is optional too, read as written, and one of the fields
// state_xxh3_64 covers; a model without a vocab (or 0, a model that does not say) leaves the
// token unchecked here.
TEST_F(CheckpointLoad, TheDataContentsDigestIsOptional) {
  EXPECT_FALSE(open_checkpoint(folder_).state().data.contents.has_value());
  const std::string digest = "xxh3_64:0123456789abcdef";
  edit_manifest(folder_, [&](auto& m) {
    m["data"]["contents"] = digest;
    m["model"]["vocab"] = 0;
  });
  EXPECT_EQ(open_checkpoint(folder_).state().data.contents, digest);
  edit_manifest_only(folder_, [](auto& m) { m["data"]["contents"] = "xxh3_64:0123456789abcdee"; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_), "does not match its checksum");
  edit_manifest(folder_, [&](auto& m) {
    m["data"].erase("contents");
    m["model"]["vocab"] = 14;
  });
  EXPECT_FALSE(open_checkpoint(folder_).state().data.contents.has_value());
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
  // One holding a line break is shown escaped, on the error's one line.
  write_file(manifest(), pristine);
  edit_manifest_only(folder_, [](auto& m) { m["model_fingerprint"] = "xxh3_64:\n\x1b[2J"; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder_),
                          "manifest.model_fingerprint (xxh3_64:\\n\\x1b[2J; the description's is");
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

}  // namespace
}  // namespace conveyor
