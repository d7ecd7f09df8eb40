// Saving and resuming a Trainer: a run stopped after N steps and resumed (into the same or
// another stage layout and schedule, from a synchronous or a background save) continues bit
// for bit as the run of 2N steps does; a failed save leaves the previous checkpoint in place;
// a checkpoint of another model is refused naming the difference.
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"
#include "engine/train/checkpoint_model.h"
#include "engine/train/trainer_checkpoint.h"
#include "support/train_config.h"

namespace conveyor {
namespace {

using testing::TempDir;
using testing::tensor_bytes;

constexpr int64_t kHalf = 3;

// The small config with a learning-rate warm-up and decay, so that a resume must also land at
// the right point of the rate's schedule.
TrainConfig resume_config(int stages, schedule::ScheduleKind kind) {
  TrainConfig c = testing::small_train_config(stages, 1);
  c.steps = 2 * kHalf;
  c.optimizer.min_lr = 1e-3;
  c.optimizer.warmup_steps = 2;
  c.schedule = kind;
  return c;
}

// Every tensor a checkpoint would hold (weights and optimizer moments), by global name.
std::map<std::string, std::vector<unsigned char>> full_state(Trainer& trainer) {
  std::map<std::string, std::vector<unsigned char>> out;
  for (int r = 0; r < trainer.executor().num_ranks(); ++r)
    for (const NamedTensor& t : rank_checkpoint_tensors(trainer.executor(), r))
      out[t.name] = tensor_bytes(t.tensor);
  return out;
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<unsigned char>> state;
};

Run straight(const TrainConfig& config) {
  Trainer trainer(config);
  Run run;
  for (int64_t s = 0; s < config.steps; ++s) run.losses.push_back(trainer.step().loss);
  run.state = full_state(trainer);
  return run;
}

// kHalf steps under `first` saved into `dir`, then a fresh trainer under `second` resumed
// from `latest` for the rest.
Run stopped_and_resumed(const TrainConfig& first, const TrainConfig& second,
                        const std::filesystem::path& dir, bool async) {
  Run run;
  {
    Trainer trainer(first);
    TrainerCheckpointOptions options;
    options.directory = dir;
    options.every = 2;
    options.async = async;
    TrainerCheckpointer checkpointer(trainer, options);
    for (int64_t s = 0; s < kHalf; ++s) {
      run.losses.push_back(trainer.step().loss);
      checkpointer.after_step();
    }
    checkpointer.finish();
    EXPECT_EQ(checkpointer.last_saved_step(), kHalf);
  }
  Trainer trainer(second);
  const Checkpoint ckpt = resume_trainer(trainer, dir);
  EXPECT_EQ(ckpt.step(), kHalf);
  EXPECT_EQ(trainer.steps_done(), kHalf);
  for (int64_t s = kHalf; s < second.steps; ++s) run.losses.push_back(trainer.step().loss);
  run.state = full_state(trainer);
  return run;
}

void expect_identical(const Run& expected, const Run& got) {
  ASSERT_EQ(expected.losses.size(), got.losses.size());
  for (size_t i = 0; i < expected.losses.size(); ++i)
    EXPECT_EQ(expected.losses[i], got.losses[i]) << "step " << i + 1;
  ASSERT_EQ(expected.state.size(), got.state.size());
  for (const auto& [name, bytes] : expected.state) {
    ASSERT_TRUE(got.state.count(name)) << name;
    EXPECT_TRUE(bytes == got.state.at(name)) << name << " differs after the resume";
  }
}

TEST(TrainerResume, OneStageContinuesBitForBit) {
  TempDir dir;
  const TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  expect_identical(straight(c), stopped_and_resumed(c, c, dir.path(), /*async=*/false));
}

TEST(TrainerResume, FourStagesContinueBitForBit) {
  TempDir dir;
  const TrainConfig c = resume_config(4, schedule::ScheduleKind::k1F1B);
  expect_identical(straight(c), stopped_and_resumed(c, c, dir.path(), /*async=*/false));
}

TEST(TrainerResume, RepartitionedFourToTwoWithAnotherScheduleContinuesBitForBit) {
  TempDir dir;
  const TrainConfig four = resume_config(4, schedule::ScheduleKind::k1F1B);
  const TrainConfig two = resume_config(2, schedule::ScheduleKind::kZBH1);
  expect_identical(straight(four), stopped_and_resumed(four, two, dir.path(), /*async=*/false));
}

TEST(TrainerResume, BackgroundSaveContinuesBitForBit) {
  TempDir dir;
  const TrainConfig c = resume_config(4, schedule::ScheduleKind::k1F1B);
  expect_identical(straight(c), stopped_and_resumed(c, c, dir.path(), /*async=*/true));
}

// The manifest records the Markov source's token at its position, and the resume restores
// the source from it; a checkpoint without it (written before it was recorded) replays the
// source instead and continues bit for bit too. A token outside the vocab is refused.
TEST(TrainerResume, TheDataTokenRestoresTheSourceAndACheckpointWithoutOneReplays) {
  TempDir dir;
  const TrainConfig c = resume_config(2, schedule::ScheduleKind::k1F1B);
  const conveyor::Run want = straight(c);
  conveyor::Run run;
  std::optional<int32_t> token;
  {
    Trainer trainer(c);
    TrainerCheckpointer checkpointer(trainer, {dir.path()});
    for (int64_t s = 0; s < kHalf; ++s) run.losses.push_back(trainer.step().loss);
    trainer.save_now();
    token = trainer.source().current_token();
  }
  const std::filesystem::path folder = dir / ("step_" + std::to_string(kHalf));
  ASSERT_TRUE(token.has_value());
  EXPECT_EQ(open_checkpoint(folder).state().data.token, token);

  // An edited token no longer matches the manifest's checksum of the training state: the
  // resume is refused before it touches the trainer.
  const std::string pristine = testing::read_file(folder / "manifest.json");
  const int32_t other = (*token + 1) % static_cast<int32_t>(c.model.vocab);
  testing::edit_manifest_only(folder, [&](auto& m) { m["data"]["token"] = other; });
  {
    Trainer trainer(c);
    EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, dir.path()), "does not match its checksum");
    EXPECT_EQ(trainer.steps_done(), 0);
  }

  // A token written so (its checksum recomputed) is what the resumed source starts from: it
  // is not replayed.
  testing::write_file(folder / "manifest.json", pristine);
  testing::edit_manifest(folder, [&](auto& m) { m["data"]["token"] = other; });
  {
    Trainer trainer(c);
    resume_trainer(trainer, dir.path());
    EXPECT_EQ(trainer.source().current_token(), other);
    EXPECT_EQ(trainer.source().position(), static_cast<uint64_t>(kHalf * c.batch_tokens));
  }
  testing::edit_manifest(folder, [&](auto& m) { m["data"]["token"] = c.model.vocab; });
  {
    Trainer trainer(c);
    EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, dir.path()),
                            "manifest.data.token is " + std::to_string(c.model.vocab));
    EXPECT_EQ(trainer.steps_done(), 0);
  }

  testing::write_file(folder / "manifest.json", pristine);
  testing::edit_manifest(folder, [](auto& m) { m["data"].erase("token"); });
  Trainer trainer(c);
  const Checkpoint ckpt = resume_trainer(trainer, dir.path());
  EXPECT_FALSE(ckpt.state().data.token.has_value());
  EXPECT_EQ(trainer.source().current_token(), token);
  for (int64_t s = kHalf; s < c.steps; ++s) run.losses.push_back(trainer.step().loss);
  run.state = full_state(trainer);
  expect_identical(want, run);
}

// A run 2^40 steps into its data: a replay of the source would not end, the token restores it
// at once, and the resumed run goes on bit for bit as the one that saved.
TEST(TrainerResume, FarIntoTheDataResumesWithoutReplayingTheSource) {
  TempDir dir;
  TrainConfig c = resume_config(2, schedule::ScheduleKind::k1F1B);
  const int64_t far = int64_t{1} << 40;
  c.steps = far + 2 * kHalf;
  Trainer first(c);
  first.source().restore(static_cast<uint64_t>(far * c.batch_tokens), 5);
  first.resume_at(far);
  for (int r : first.executor().local_ranks()) first.executor().optimizer(r).set_steps_taken(far);
  TrainerCheckpointer checkpointer(first, {dir.path()});
  first.step();
  first.save_now();

  Trainer second(c);
  const Checkpoint ckpt = resume_trainer(second, dir.path());
  EXPECT_EQ(ckpt.state().data.position, static_cast<uint64_t>((far + 1) * c.batch_tokens));
  EXPECT_EQ(second.source().position(), first.source().position());
  EXPECT_EQ(second.source().current_token(), first.source().current_token());
  EXPECT_EQ(second.steps_done(), far + 1);
  for (int64_t s = 0; s < kHalf; ++s) EXPECT_EQ(first.step().loss, second.step().loss) << s;
  EXPECT_TRUE(full_state(first) == full_state(second));
}

// Trains one step of `c` and saves it into `dir`; returns the folder of step 1.
std::filesystem::path save_first_step(const TrainConfig& c, const std::filesystem::path& dir) {
  Trainer trainer(c);
  trainer.step();
  TrainerCheckpointer checkpointer(trainer, {dir});
  checkpointer.finish();
  return dir / "step_1";
}

TEST(TrainerResume, CheckpointOfAnotherModelIsRefusedNamingTheDifference) {
  TempDir dir;
  TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  save_first_step(c, dir.path());
  c.model.d_model = 16;
  c.model.hidden = 32;
  Trainer other(c);
  const auto before = full_state(other);
  try {
    resume_trainer(other, dir.path());
    FAIL() << "a checkpoint of d_model 32 resumed into d_model 16";
  } catch (const CheckpointOfAnotherModel& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("another model"), std::string::npos) << what;
    EXPECT_NE(what.find("d_model 32 in the checkpoint, 16 in this run"), std::string::npos) << what;
  }
  EXPECT_EQ(other.steps_done(), 0);
  EXPECT_TRUE(before == full_state(other));
}

// Strings of a hand-edited manifest that a resume refusal quotes (the data source, a field of
// the model description) are shown with their control characters escaped, so that the
// message stays one line.
TEST(TrainerResume, AHandEditedManifestsStringsAreShownEscaped) {
  TempDir dir;
  const TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  const std::filesystem::path folder = save_first_step(c, dir.path());
  const std::string pristine = testing::read_file(folder / "manifest.json");
  testing::edit_manifest(folder, [](auto& m) { m["data"]["source"] = "a\nline\x1b[2J"; });
  {
    Trainer trainer(c);
    EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, dir.path()),
                            "was trained on a\\nline\\x1b[2J but this run reads Markov chain");
  }
  testing::write_file(folder / "manifest.json", pristine);
  testing::edit_manifest(folder, [](auto& m) { m["model"]["x\ny"] = 1; });
  {
    Trainer trainer(c);
    EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, dir.path()),
                            "another model: x\\ny only in the checkpoint");
  }
}

// The batch size fixes where each step's data starts, so a trainer's resume needs the
// rng.batch_tokens its manifest records: a manifest without it (rng null, or an object of
// the caller's without the field) is refused, whatever this run's --batch-tokens, where the
// library alone loads it.
TEST(TrainerResume, AManifestWithoutRngBatchTokensIsRefused) {
  TempDir dir;
  const TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  const std::filesystem::path folder = save_first_step(c, dir.path());
  const std::string pristine = testing::read_file(folder / "manifest.json");
  for (const nlohmann::json& rng : {nlohmann::json(nullptr), nlohmann::json{{"seed", c.seed}}}) {
    SCOPED_TRACE(rng.dump());
    testing::write_file(folder / "manifest.json", pristine);
    testing::edit_manifest(folder, [&](auto& m) { m["rng"] = rng; });
    EXPECT_NO_THROW(open_checkpoint(folder));
    for (int64_t batch_tokens : {c.batch_tokens, 2 * c.batch_tokens}) {
      TrainConfig other = c;
      other.batch_tokens = batch_tokens;
      Trainer trainer(other);
      EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, dir.path()), "manifest.rng is " + rng.dump(),
                              "without batch_tokens a resume cannot check");
      EXPECT_EQ(trainer.steps_done(), 0);
    }
  }
}

// A checkpoint that records the digest of its data file's bytes (data.contents) is matched by
// them: the same bytes under another path resume, as the saved run would have gone on, and
// the changed path is said; a file edited in place at the same size is refused naming both
// digests. One without the digest (written before it was recorded) is matched by the
// description, the file's name and size, as before.
TEST(TrainerResume, ADataFileIsMatchedByTheDigestOfItsBytes) {
  TempDir dir;
  std::mt19937_64 rng(5);
  std::string text(4096, ' ');
  for (char& ch : text) ch = static_cast<char>('a' + rng() % 26);
  const std::filesystem::path data = dir / "d.txt";
  const std::filesystem::path copy = dir / "elsewhere" / "d2.txt";
  std::filesystem::create_directories(copy.parent_path());
  testing::write_file(data, text);
  testing::write_file(copy, text);
  TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  c.model.vocab = 256;
  c.data_path = data.string();
  const std::string digest = *FileSource(data.string()).contents_digest();
  const std::filesystem::path folder = save_first_step(c, dir / "ckpt");
  testing::edit_manifest(folder, [&](auto& m) { m["data"]["contents"] = digest; });
  auto resumed_on = [&](const std::filesystem::path& path) {
    TrainConfig other = c;
    other.data_path = path.string();
    auto trainer = std::make_unique<Trainer>(other);
    resume_trainer(*trainer, folder);
    return trainer;
  };
  const auto original = resumed_on(data);
  EXPECT_TRUE(resume_setting_changes(*original, open_checkpoint(folder).state()).empty());
  const auto moved = resumed_on(copy);
  EXPECT_EQ(moved->steps_done(), 1);
  const std::vector<std::string> notes =
      resume_setting_changes(*moved, open_checkpoint(folder).state());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("d2.txt"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("the same bytes (" + digest + ") under another path"), std::string::npos)
      << notes[0];
  EXPECT_EQ(original->step().loss, moved->step().loss);

  text[text.size() / 2] = text[text.size() / 2] == 'a' ? 'b' : 'a';
  testing::write_file(copy, text);
  const std::string edited = *FileSource(copy.string()).contents_digest();
  {
    TrainConfig other = c;
    other.data_path = copy.string();
    Trainer trainer(other);
    EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, folder), "whose bytes have digest " + digest,
                            "with digest " + edited,
                            "other data; resume with the data it was trained on");
    EXPECT_EQ(trainer.steps_done(), 0);
  }

  testing::edit_manifest(folder, [](auto& m) { m["data"].erase("contents"); });
  EXPECT_EQ(resumed_on(data)->steps_done(), 1);
  {
    TrainConfig other = c;
    other.data_path = copy.string();
    Trainer trainer(other);
    EXPECT_CHECKPOINT_ERROR(
        resume_trainer(trainer, folder), "was trained on bytes of", "but this run reads bytes of",
        "resume with the same data (TrainConfig::data_path) and seed (TrainConfig::seed)");
  }
}

// On a data file the seed only drew the initial weights, which the checkpoint's replace: a
// resume under another seed goes on bit for bit as under the saved one, and says the seed
// changes nothing.
TEST(TrainerResume, AnotherSeedOnADataFileIsSaidToChangeNothing) {
  TempDir dir;
  std::mt19937_64 rng(11);
  std::string text(4096, ' ');
  for (char& ch : text) ch = static_cast<char>(rng() % 256);
  const std::filesystem::path data = dir / "d.bin";
  testing::write_file(data, text);
  TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  c.model.vocab = 256;
  c.data_path = data.string();
  c.seed = 3;
  const std::filesystem::path folder = save_first_step(c, dir / "ckpt");
  const TrainingState saved = open_checkpoint(folder).state();
  Trainer same(c);
  resume_trainer(same, folder);
  EXPECT_TRUE(resume_setting_changes(same, saved).empty());
  TrainConfig other = c;
  other.seed = 4;
  Trainer reseeded(other);
  resume_trainer(reseeded, folder);
  const std::vector<std::string> notes = resume_setting_changes(reseeded, saved);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0],
            "resuming with TrainConfig::seed 4 where the checkpoint was saved with 3, to no "
            "effect: the seed draws the initial weights and the Markov chain's tokens, and this "
            "run takes its weights from the checkpoint and its tokens from " +
                reseeded.source().describe());
  EXPECT_EQ(same.step().loss, reseeded.step().loss);
}

// A schedule file fixes the micro-batch count, so a resume under one of another count says it
// came from the file, not as a setting the caller gave.
TEST(TrainerResume, MicrobatchesOfAScheduleFileAreSaidAsTheFiles) {
  TempDir dir;
  TrainConfig c = resume_config(2, schedule::ScheduleKind::k1F1B);
  c.microbatches = 2;
  const std::filesystem::path folder = save_first_step(c, dir / "ckpt");
  const std::filesystem::path file = dir / "f4.txt";
  schedule::save_schedule(file.string(), schedule::generate_1f1b(2, 4));
  TrainConfig from_file = c;
  from_file.microbatches = 4;
  from_file.schedule_file = file.string();
  Trainer trainer(from_file);
  resume_trainer(trainer, folder);
  const std::vector<std::string> notes =
      resume_setting_changes(trainer, open_checkpoint(folder).state());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].find("resuming with 4 micro-batches from schedule file '" + file.string() +
                          "' where the checkpoint was saved with 2 (the gradients are summed"),
            0u)
      << notes[0];
}

// A count the caller's plan chose is said as the plan's, given as its origin; without one the
// setting is named.
TEST(TrainerResume, MicrobatchesOfAnOriginAreSaidAsItsChoice) {
  TempDir dir;
  TrainConfig c = resume_config(2, schedule::ScheduleKind::k1F1B);
  c.microbatches = 2;
  const std::filesystem::path folder = save_first_step(c, dir / "ckpt");
  TrainConfig planned = c;
  planned.microbatches = 4;
  Trainer trainer(planned);
  resume_trainer(trainer, folder);
  const TrainingState saved = open_checkpoint(folder).state();
  const std::vector<std::string> notes = resume_setting_changes(trainer, saved, "from the plan");
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].find("resuming with 4 micro-batches from the plan where the checkpoint was "
                          "saved with 2 (the gradients are summed"),
            0u)
      << notes[0];
  const std::vector<std::string> named = resume_setting_changes(trainer, saved);
  ASSERT_EQ(named.size(), 1u);
  EXPECT_EQ(named[0].find("resuming with TrainConfig::microbatches 4 where the checkpoint was "
                          "saved with 2"),
            0u)
      << named[0];
}

// The manifest records the replica count, and a resume under another says it, the gradients
// being summed in another order; the same count says nothing. A checkpoint written before the
// count was recorded resumes under any count without a word.
TEST(TrainerResume, AnotherDataParallelCountIsSaid) {
  TempDir dir;
  const TrainConfig two = testing::small_train_config(1, 2);
  const std::filesystem::path folder = save_first_step(two, dir / "ckpt");
  EXPECT_EQ(open_checkpoint(folder).state().data_parallel, 2);
  TrainConfig one = two;
  one.data_parallel = 1;
  {
    Trainer trainer(one);
    resume_trainer(trainer, folder);
    const std::vector<std::string> notes =
        resume_setting_changes(trainer, open_checkpoint(folder).state());
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_EQ(notes[0],
              "resuming with TrainConfig::data_parallel 1 where the checkpoint was saved with 2 "
              "(the gradients are summed in another order, so the run departs from an "
              "uninterrupted one by rounding)");
  }
  {
    Trainer trainer(two);
    resume_trainer(trainer, folder);
    EXPECT_TRUE(resume_setting_changes(trainer, open_checkpoint(folder).state()).empty());
  }
  testing::edit_manifest(folder, [](auto& m) { m["schedule"].erase("data_parallel"); });
  Trainer trainer(one);
  const Checkpoint ckpt = resume_trainer(trainer, folder);
  EXPECT_FALSE(ckpt.state().data_parallel.has_value());
  EXPECT_TRUE(resume_setting_changes(trainer, ckpt.state()).empty());
  EXPECT_EQ(trainer.steps_done(), 1);
  trainer.step();
  EXPECT_EQ(trainer.steps_done(), 2);
}

// Saves into `dir` under `policy`, each warning appended to `warnings`.
TrainerCheckpointOptions collecting_warnings(const TempDir& dir, SaveErrorPolicy policy,
                                             std::vector<std::string>& warnings) {
  TrainerCheckpointOptions options;
  options.directory = dir.path();
  options.on_error = policy;
  options.warn = [&warnings](const std::string& w) { warnings.push_back(w); };
  return options;
}

// A save that cannot be made (its folder is taken by a file): `stop` throws naming it,
// `continue` reports it and trains on; `latest` still names the previous checkpoint.
TEST(TrainerResume, FailedSaveStopsOrContinuesAndKeepsThePreviousCheckpoint) {
  for (const SaveErrorPolicy policy : {SaveErrorPolicy::kStop, SaveErrorPolicy::kContinue}) {
    TempDir dir;
    Trainer trainer(resume_config(1, schedule::ScheduleKind::k1F1B));
    std::vector<std::string> warnings;
    TrainerCheckpointOptions options = collecting_warnings(dir, policy, warnings);
    options.every = 1;
    TrainerCheckpointer checkpointer(trainer, options);
    trainer.step();
    checkpointer.after_step();
    std::ofstream(dir / "step_2") << "in the way\n";
    trainer.step();
    if (policy == SaveErrorPolicy::kStop) {
      try {
        checkpointer.after_step();
        FAIL() << "a save into a taken folder did not fail";
      } catch (const CheckpointError& e) {
        EXPECT_NE(std::string(e.what()).find("step_2"), std::string::npos) << e.what();
      }
    } else {
      checkpointer.after_step();
      ASSERT_EQ(warnings.size(), 1u);
      EXPECT_NE(warnings[0].find("step_2"), std::string::npos) << warnings[0];
      trainer.step();  // training goes on, and so do the saves
      checkpointer.after_step();
      EXPECT_EQ(checkpointer.last_saved_step(), 3);
      continue;
    }
    EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);
    EXPECT_EQ(checkpointer.last_saved_step(), 1);
  }
}

// A background save that fails before its write begins (its folder is taken) has no
// background step: `conveyor train` says "saving step N in the background" only for one that
// has, and not after the warning that step N was not saved.
TEST(TrainerResume, AnAsyncSaveThatCannotStartHasNoBackgroundStep) {
  TempDir dir;
  Trainer trainer(resume_config(1, schedule::ScheduleKind::k1F1B));
  std::vector<std::string> warnings;
  TrainerCheckpointOptions options = collecting_warnings(dir, SaveErrorPolicy::kContinue, warnings);
  options.every = 1;
  options.async = true;
  TrainerCheckpointer checkpointer(trainer, options);
  trainer.step();
  checkpointer.after_step();
  EXPECT_EQ(checkpointer.background_step(), 1);
  std::ofstream(dir / "step_2") << "in the way\n";
  trainer.step();
  checkpointer.after_step();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step_2"), std::string::npos) << warnings[0];
  EXPECT_EQ(checkpointer.last_started_step(), 2);
  EXPECT_EQ(checkpointer.background_step(), -1);
  EXPECT_EQ(checkpointer.last_saved_step(), 1);  // waited for before step 2's save
  trainer.step();
  checkpointer.after_step();
  EXPECT_EQ(checkpointer.background_step(), 3);
  checkpointer.finish();
  EXPECT_EQ(checkpointer.last_saved_step(), 3);
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 3);
}

// A trainer of a description of the caller's does not use TrainConfig::model: an invalid one
// neither stops its saves nor its resumes, and its checkpoints do not describe it.
TEST(TrainerResume, ACustomModelSavesAndResumesWhateverTheUnusedConfigModel) {
  TempDir dir;
  TrainConfig c = resume_config(2, schedule::ScheduleKind::k1F1B);
  ModelDescription model = reference_model(c.model);
  model.name = "the caller's";
  c.model.d_model = 0;  // invalid, and not used
  Trainer first(model, c);
  first.step();
  {
    TrainerCheckpointer checkpointer(first, {dir.path()});
    checkpointer.finish();
  }
  const Checkpoint saved = open_checkpoint(dir.path());
  EXPECT_EQ(saved.state().model.at("name"), "the caller's");
  EXPECT_FALSE(saved.state().model.contains("config")) << saved.state().model.dump();
  Trainer second(model, c);
  resume_trainer(second, dir.path());
  EXPECT_EQ(second.steps_done(), 1);
  EXPECT_EQ(first.step().loss, second.step().loss);
}

// A description built as reference_model(config.model) is that config's model: its
// checkpoints describe the config as the config's own trainer does, and resume into it.
TEST(TrainerResume, TheReferenceModelGivenAsADescriptionResumesIntoTheConfigsTrainer) {
  TempDir dir;
  const TrainConfig c = resume_config(2, schedule::ScheduleKind::k1F1B);
  Trainer first(reference_model(c.model), c);
  first.step();
  {
    TrainerCheckpointer checkpointer(first, {dir.path()});
    checkpointer.finish();
  }
  EXPECT_TRUE(open_checkpoint(dir.path()).state().model.contains("config"));
  Trainer second(c);
  resume_trainer(second, dir.path());
  EXPECT_EQ(first.step().loss, second.step().loss);
}

// A trainer whose step or restore failed part-way holds some weights of one state and some of
// another: neither save() nor finish() publishes them over the last good checkpoint.
TEST(TrainerResume, AnUnusableTrainerIsNotSavedAndTheLastCheckpointStays) {
  for (const SaveErrorPolicy policy : {SaveErrorPolicy::kStop, SaveErrorPolicy::kContinue}) {
    TempDir dir;
    Trainer trainer(resume_config(1, schedule::ScheduleKind::k1F1B));
    std::vector<std::string> warnings;
    TrainerCheckpointOptions options = collecting_warnings(dir, policy, warnings);
    TrainerCheckpointer checkpointer(trainer, options);
    trainer.step();
    checkpointer.save();
    trainer.step();
    trainer.mark_unusable("restoring the weights failed part-way");
    const std::string refusal =
        "cannot save a checkpoint: the trainer is unusable (restoring the weights failed "
        "part-way)";
    for (int attempt = 0; attempt < 2; ++attempt) {
      const auto save = [&] {
        if (attempt == 0)
          checkpointer.save();
        else
          checkpointer.finish();
      };
      if (policy == SaveErrorPolicy::kStop) {
        try {
          save();
          ADD_FAILURE() << "an unusable trainer was saved";
        } catch (const std::logic_error& e) {
          EXPECT_EQ(std::string(e.what()), refusal);
        }
      } else {
        save();
        ASSERT_EQ(warnings.size(), static_cast<size_t>(attempt + 1));
        EXPECT_NE(warnings.back().find(refusal), std::string::npos) << warnings.back();
      }
    }
    EXPECT_EQ(checkpointer.last_saved_step(), 1);
    EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);
    EXPECT_FALSE(std::filesystem::exists(dir / "step_2"));
  }
}

// A resume into a trainer whose step failed would succeed and leave it refusing every step:
// it is refused itself, the trainer untouched, and a new trainer resumes from the same files.
TEST(TrainerResume, IntoAnUnusableTrainerIsRefused) {
  TempDir dir;
  const TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  Trainer first(c);
  {
    TrainerCheckpointOptions options;
    options.directory = dir.path();
    TrainerCheckpointer checkpointer(first, options);
    first.step();
    checkpointer.save();
  }
  Trainer broken(c);
  broken.mark_unusable("a step failed part-way");
  try {
    resume_trainer(broken, dir.path());
    ADD_FAILURE() << "resumed into an unusable trainer";
  } catch (const std::logic_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot resume into an unusable trainer (a step failed part-way); make a new "
              "Trainer and resume into that");
  }
  EXPECT_EQ(broken.steps_done(), 0);
  Trainer fresh(c);
  resume_trainer(fresh, dir.path());
  EXPECT_EQ(fresh.steps_done(), 1);
}

// A resume from a checkpoint of the save folder (by any spelling of its path) continues the
// folder's run, whose unpublished saves it may replace; a resume from elsewhere does not.
TEST(TrainerResume, OnlyAResumeFromItsOwnFolderContinuesTheFoldersRun) {
  TempDir dir, other;
  Trainer trainer(resume_config(2, schedule::ScheduleKind::k1F1B));
  TrainerCheckpointer checkpointer(trainer, {dir.path()});
  EXPECT_FALSE(checkpointer.continues_folder());
  checkpointer.resumed_from(other.path() / "step_2");
  EXPECT_FALSE(checkpointer.continues_folder());
  checkpointer.resumed_from(dir.path() / "." / "step_2");
  EXPECT_TRUE(checkpointer.continues_folder());
}

TEST(TrainerResume, SaveNowSavesTheCurrentStepOnce) {
  TempDir dir;
  Trainer trainer(resume_config(2, schedule::ScheduleKind::k1F1B));
  TrainerCheckpointer checkpointer(trainer, {dir.path()});
  trainer.step();
  trainer.step();
  trainer.save_now();
  trainer.save_now();  // the step is saved already: nothing to do
  EXPECT_EQ(checkpointer.last_saved_step(), 2);
  const Checkpoint ckpt = open_checkpoint(dir.path());
  EXPECT_EQ(ckpt.step(), 2);
  EXPECT_EQ(ckpt.state().optimizer_steps, 2);
  EXPECT_EQ(ckpt.state().data.position, 2u * 256u);
  EXPECT_EQ(ckpt.state().stages.size(), 2u);
}

// Another run saving into the folder would take this one's unfinished step for a crash's
// leftover and remove it; the folder is locked for the checkpointer's life.
TEST(TrainerResume, AFolderAnotherCheckpointerSavesIntoIsRefused) {
  TempDir dir;
  Trainer first(resume_config(1, schedule::ScheduleKind::k1F1B));
  Trainer second(resume_config(1, schedule::ScheduleKind::k1F1B));
  {
    TrainerCheckpointer saving(first, {dir.path()});
    try {
      TrainerCheckpointer other(second, {dir.path()});
      FAIL() << "a second checkpointer took the folder";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("is being saved into by another run (it holds the "
                                           "folder's lock)"),
                std::string::npos)
          << e.what();
    }
    first.step();
    saving.save();
  }
  // Released with the first.
  TrainerCheckpointer next(second, {dir.path()});
  second.step();
  second.step();  // step 1 is the first run's
  EXPECT_NO_THROW(next.save());
}

// The folder removed during the run is made again by the next save, which locks it again: a
// second run resuming from it, whose saves would remove the first one's unfinished steps, is
// refused as while the folder stood.
TEST(TrainerResume, AFolderRemovedDuringTheRunIsLockedAgainByTheSaveThatMakesIt) {
  TempDir dir;
  const std::filesystem::path folder = dir / "ckpt";
  Trainer first(resume_config(1, schedule::ScheduleKind::k1F1B));
  Trainer second(resume_config(1, schedule::ScheduleKind::k1F1B));
  TrainerCheckpointOptions options;
  options.directory = folder;
  options.every = 1;
  TrainerCheckpointer saving(first, options);
  first.step();
  saving.after_step();
  std::filesystem::remove_all(folder);
  first.step();
  saving.after_step();
  EXPECT_EQ(open_checkpoint(folder).step(), 2);
  EXPECT_CHECKPOINT_ERROR(TrainerCheckpointer(second, options),
                          "is being saved into by another run (it holds the folder's lock)");
  // Taken by another run before this one's next save: that save is refused, not made.
  std::filesystem::remove_all(folder);
  std::filesystem::create_directory(folder);
  {
    TrainerCheckpointer other(second, options);
    first.step();
    EXPECT_CHECKPOINT_ERROR(saving.after_step(), "is being saved into by another run");
  }
  EXPECT_FALSE(std::filesystem::exists(folder / "latest"));
}

TEST(TrainerResume, UnwritableFolderIsRefusedBeforeTheFirstStep) {
  TempDir dir;
  std::ofstream(dir / "file") << "x\n";
  Trainer trainer(resume_config(1, schedule::ScheduleKind::k1F1B));
  EXPECT_THROW(TrainerCheckpointer(trainer, {dir / "file" / "ckpt"}), CheckpointError);
}

TEST(TrainerResume, AParameterNamedLikeCheckpointStateIsRefusedBeforeTheFirstStep) {
  // The reference model with its head's parameters renamed: "optimizer.m.<x>" would be read
  // back as AdamW's moment of <x>, and "__metadata__" is the safetensors header's key.
  for (const std::string name : {"optimizer.m.embed.weight", "__metadata__"}) {
    TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
    ModelDescription model = reference_model(c.model);
    model.make_unit = [inner = model.make_unit, name, last = model.num_units - 1](int64_t index) {
      std::unique_ptr<Layer> unit = inner(index);
      if (index == last) unit->parameters().front()->name = name;
      return unit;
    };
    Trainer trainer(model, c);
    TempDir dir;
    try {
      TrainerCheckpointer checkpointer(trainer, {dir.path()});
      FAIL() << "a parameter named " << name << " was to be checkpointed";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("parameter '" + name +
                                           "' of unit 3 cannot be "
                                           "checkpointed under its name"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(resume_trainer(trainer, dir.path()), std::invalid_argument);
    EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  }
}

// A source of the caller's: the chain's tokens under a description of its own.
class DescribedSource : public TokenSource {
 public:
  DescribedSource(int64_t vocab, std::string text) : chain_(vocab, 1), text_(std::move(text)) {}
  int64_t vocab() const override { return chain_.vocab(); }
  void next(int32_t* inputs, int32_t* targets, int64_t n) override {
    chain_.next(inputs, targets, n);
  }
  uint64_t position() const override { return chain_.position(); }
  void seek(uint64_t position) override { chain_.seek(position); }
  std::string describe() const override { return text_; }

 private:
  MarkovSource chain_;
  std::string text_;
};

// The config's data fields make only the built-in sources: the refusal of a caller's source
// that describes itself otherwise named them, which that source does not read.
TEST(TrainerResume, ASourceOfTheCallersDescribedOtherwiseIsNamedAsSuch) {
  TempDir dir;
  const TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  {
    Trainer trainer(c, std::make_shared<DescribedSource>(c.model.vocab, "mine"));
    TrainerCheckpointer checkpointer(trainer, {dir.path()});
    trainer.step();
    checkpointer.finish();
  }
  Trainer trainer(c, std::make_shared<DescribedSource>(c.model.vocab, "another"));
  EXPECT_CHECKPOINT_ERROR(resume_trainer(trainer, dir.path()),
                          "was trained on mine but this run reads another; resume with the same "
                          "data: a TokenSource whose describe() is the checkpoint's");
  EXPECT_EQ(trainer.steps_done(), 0);
}

// The manifest and the shards' headers are JSON, which holds UTF-8 alone: such a name or
// description failed the first save, after the steps before it, with the JSON library's error.
TEST(TrainerResume, NamesAndDescriptionsThatAreNotUtf8AreRefusedBeforeTheFirstStep) {
  const TrainConfig c = resume_config(1, schedule::ScheduleKind::k1F1B);
  const auto refusal = [](Trainer& trainer) {
    TempDir dir;
    std::string message;
    try {
      TrainerCheckpointer checkpointer(trainer, {dir.path()});
      ADD_FAILURE() << "a checkpointer was made";
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    EXPECT_THROW(resume_trainer(trainer, dir.path()), std::invalid_argument);
    EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
    return message;
  };
  ModelDescription named = reference_model(c.model);
  named.name = "tiny \xfe";
  Trainer of_named(named, c);
  EXPECT_EQ(refusal(of_named),
            "ModelDescription::name 'tiny \\xfe' is not valid UTF-8, which a checkpoint's "
            "manifest (JSON) must hold; give the model a UTF-8 name");

  ModelDescription renamed = reference_model(c.model);
  renamed.make_unit = [inner = renamed.make_unit, last = renamed.num_units - 1](int64_t index) {
    std::unique_ptr<Layer> unit = inner(index);
    if (index == last) unit->parameters().front()->name = "head\xc3.weight";
    return unit;
  };
  Trainer of_renamed(renamed, c);
  EXPECT_EQ(refusal(of_renamed),
            "parameter 'head\\xc3.weight' of unit 3 cannot be checkpointed under its name: it is "
            "not valid UTF-8, which a shard's header (JSON) must hold; rename it");

  Trainer of_described(c, std::make_shared<DescribedSource>(c.model.vocab, "chain \xff"));
  EXPECT_EQ(refusal(of_described),
            "the data source's describe() 'chain \\xff' is not valid UTF-8, which a "
            "checkpoint's manifest (JSON) must hold; describe the source in UTF-8");
}

}  // namespace
}  // namespace conveyor
