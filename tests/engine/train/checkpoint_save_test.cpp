// Saving: the folder layout, concurrent shard writes from rank threads, the atomic commit
// through `latest`, keep-last-K, leftovers of failed saves, and write errors that name the
// file and leave the previous checkpoint intact.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <thread>

#include "engine/train/trainer_checkpoint.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

TEST(CheckpointSave, WritesTheDocumentedLayout) {
  TempDir dir;
  const fs::path folder = save_demo(dir.path(), 5);
  EXPECT_EQ(folder, dir / "step_5");
  EXPECT_EQ(read_file(dir / "latest"), "step_5\n");
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_5"}));
  EXPECT_EQ(folder_names(folder), (std::vector<std::string>{"manifest.json", "rank_0.safetensors",
                                                            "rank_1.safetensors"}));
  const auto manifest = nlohmann::json::parse(read_file(folder / "manifest.json"));
  EXPECT_EQ(manifest["format_version"], 1);
  EXPECT_EQ(manifest["step"], 5);
  ASSERT_EQ(manifest["shards"].size(), 2u);
  const std::string shard = read_file(folder / "rank_1.safetensors");
  EXPECT_EQ(manifest["shards"][1]["file"], "rank_1.safetensors");
  EXPECT_EQ(manifest["shards"][1]["bytes"], shard.size());
  EXPECT_EQ(manifest["shards"][1]["xxh3_64"],
            checkpoint_io::hex64(checkpoint_io::xxh3_64(shard.data(), shard.size())));
}

// Every tensor of `tensors[r]` is in rank r's shard and reads back with the same bytes.
void expect_loads_back(const Checkpoint& ckpt,
                       const std::vector<std::vector<NamedTensor>>& tensors) {
  for (size_t r = 0; r < tensors.size(); ++r)
    for (const NamedTensor& t : tensors[r]) {
      const CheckpointTensor* saved = ckpt.find(t.name);
      ASSERT_NE(saved, nullptr) << t.name;
      EXPECT_EQ(saved->rank, static_cast<int>(r));
      Tensor loaded = cpu_context().empty(t.tensor.shape(), t.tensor.dtype());
      ckpt.read(t.name, loaded);
      EXPECT_EQ(tensor_bytes(loaded), tensor_bytes(t.tensor)) << t.name;
    }
}

TEST(CheckpointSave, RanksWriteConcurrentlyAndEverythingLoadsBack) {
  TempDir dir;
  constexpr int kRanks = 4;
  std::vector<std::vector<NamedTensor>> tensors;
  for (int r = 0; r < kRanks; ++r) tensors.push_back(demo_tensors(r, 3));
  CheckpointWriter writer(dir.path(), 8, kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] { writer.write_shard(r, tensors[r]); });
  for (auto& t : threads) t.join();
  writer.commit(demo_state(8, kRanks));

  const Checkpoint ckpt = open_checkpoint(dir.path());
  EXPECT_EQ(ckpt.step(), 8);
  EXPECT_EQ(ckpt.tensors().size(), kRanks * tensors[0].size());
  expect_loads_back(ckpt, tensors);
}

// What the processes of one run do: rank 0's process prepares and commits, the others join
// the folder it made and hand it their shards' sizes and checksums.
TEST(CheckpointSave, ShardsOfJoinedWritersCommitAsOneCheckpoint) {
  TempDir dir;
  constexpr int kRanks = 3;
  std::vector<std::vector<NamedTensor>> tensors;
  for (int r = 0; r < kRanks; ++r) tensors.push_back(demo_tensors(r, 5));
  CheckpointWriter coordinator(dir.path(), 6, kRanks);
  coordinator.write_shard(0, tensors[0]);
  for (int r = 1; r < kRanks; ++r) {
    std::unique_ptr<CheckpointWriter> joined = CheckpointWriter::join(dir.path(), 6, kRanks);
    EXPECT_EQ(joined->temp_directory(), coordinator.temp_directory());
    joined->write_shard(r, tensors[r]);
    EXPECT_THROW(joined->commit(demo_state(6, kRanks)), std::logic_error);
    const std::optional<ShardFileInfo> info = joined->written(r);
    ASSERT_TRUE(info.has_value());
    EXPECT_FALSE(coordinator.written(r).has_value());
    coordinator.add_written(r, *info);
    EXPECT_THROW(coordinator.add_written(r, *info), std::logic_error);
  }  // a joined writer leaves the folder to the one that commits
  ASSERT_TRUE(fs::is_directory(coordinator.temp_directory()));
  coordinator.commit(demo_state(6, kRanks));
  expect_loads_back(open_checkpoint(dir.path()), tensors);
}

TEST(CheckpointSave, AJoinedShardWithAWrongChecksumFailsTheLoad) {
  TempDir dir;
  CheckpointWriter coordinator(dir.path(), 2, 2);
  coordinator.write_shard(0, demo_tensors(0, 1));
  auto joined = CheckpointWriter::join(dir.path(), 2, 2);
  joined->write_shard(1, demo_tensors(1, 1));
  ShardFileInfo info = *joined->written(1);
  info.checksum ^= 1;  // a size or checksum garbled on the way to rank 0
  coordinator.add_written(1, info);
  coordinator.commit(demo_state(2, 2));
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir.path()), "rank_1.safetensors");
}

TEST(CheckpointSave, JoiningAFolderThatIsNotThereSaysTheFolderMustBeShared) {
  TempDir dir;
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter::join(dir.path(), 3, 2), (dir / "step_3.tmp").string(),
                          "every process must see the same TrainerCheckpointOptions::directory");
}

TEST(CheckpointSave, TrainingStateRoundTripsExactly) {
  TempDir dir;
  save_demo(dir.path(), 12, 3);
  const TrainingState want = demo_state(12, 3);
  const Checkpoint ckpt = open_checkpoint(dir.path());
  const TrainingState& got = ckpt.state();
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.model, want.model);
  EXPECT_EQ(got.model_fingerprint, want.model_fingerprint);
  EXPECT_EQ(got.stages, want.stages);
  EXPECT_EQ(got.schedule, want.schedule);
  EXPECT_EQ(got.microbatches, want.microbatches);
  EXPECT_EQ(got.optimizer.kind, want.optimizer.kind);
  EXPECT_EQ(got.optimizer.lr, want.optimizer.lr);  // bitwise: 0.1 / 3 survives JSON
  EXPECT_EQ(got.optimizer.beta2, want.optimizer.beta2);
  EXPECT_EQ(got.optimizer.warmup_steps, want.optimizer.warmup_steps);
  EXPECT_EQ(got.optimizer.clip_norm, want.optimizer.clip_norm);
  EXPECT_EQ(got.optimizer_steps, want.optimizer_steps);
  EXPECT_EQ(got.lr_schedule.step, want.lr_schedule.step);
  EXPECT_EQ(got.lr_schedule.total_steps, want.lr_schedule.total_steps);
  EXPECT_EQ(got.data.source, want.data.source);
  EXPECT_EQ(got.data.position, want.data.position);  // above 2^63
  EXPECT_EQ(got.data.token, want.data.token);
  EXPECT_EQ(got.rng, want.rng);
}

TEST(CheckpointSave, KeepsTheNewestK) {
  TempDir dir;
  for (int step = 1; step <= 3; ++step) save_demo(dir.path(), step, 2, {/*keep_last=*/2});
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_2", "step_3"}));
  CheckpointWriter writer(dir.path(), 10, 1, {/*keep_last=*/2});
  writer.write_shard(0, demo_tensors(0));
  const CommitResult result = writer.commit(demo_state(10, 1));
  EXPECT_EQ(result.removed, (std::vector<fs::path>{dir / "step_2"}));
  EXPECT_TRUE(result.warnings.empty());
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_10", "step_3"}));
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 10);
}

// A training run whose weights or optimizer state hold a NaN or an infinity has diverged:
// its save is refused naming the tensor, and the checkpoint before it stays `latest` (with
// keep_last 1 it would have been removed for the garbage).
TEST(CheckpointSave, RefusesNonFiniteValuesWhenAskedAndKeepsTheLastCheckpoint) {
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    TempDir dir;
    CheckpointWriterOptions options;
    options.keep_last = 1;
    options.refuse_non_finite = true;
    save_demo(dir.path(), 1, 1, options);  // finite values pass
    std::vector<NamedTensor> tensors = demo_tensors(0, 2);
    float* v = static_cast<float*>(tensors[3].tensor.raw());  // optimizer.v...
    v[5] = bad;
    {
      CheckpointWriter writer(dir.path(), 2, 1, options);
      try {
        writer.write_shard(0, tensors);
        ADD_FAILURE() << "a shard holding " << bad << " was written";
      } catch (const CheckpointError& e) {
        EXPECT_EQ(std::string(e.what()),
                  std::string("cannot save step 2: tensor 'optimizer.v.blocks.0.fc1.weight' of "
                              "rank 0 holds ") +
                      (std::isnan(bad) ? "nan" : "-inf") +
                      " at element 5: the training diverged (lower the learning rate); the "
                      "checkpoints saved before stay as they are");
      }
    }
    EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_1"}));
    EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);
    // Not asked, the same values are saved as they are (a writer of any tensors' bytes).
    CheckpointWriter plain(dir.path(), 3, 1);
    plain.write_shard(0, tensors);
    EXPECT_EQ(plain.commit(demo_state(3, 1)).directory, dir / "step_3");
  }
}

TEST(CheckpointSave, KeepLastZeroKeepsEverything) {
  TempDir dir;
  for (int step = 1; step <= 3; ++step) save_demo(dir.path(), step);
  EXPECT_EQ(folder_names(dir.path()),
            (std::vector<std::string>{"latest", "step_1", "step_2", "step_3"}));
}

TEST(CheckpointSave, LeftoverTmpIsIgnoredByTheLoaderAndRemovedByTheNextSave) {
  TempDir dir;
  save_demo(dir.path(), 1);
  {
    CheckpointWriter abandoned(dir.path(), 2, 2);
    abandoned.write_shard(0, demo_tensors(0));
    // A crash: the process dies here, so no destructor removes the folder.
    fs::copy(abandoned.temp_directory(), dir / "step_7.tmp");
  }
  ASSERT_TRUE(fs::exists(dir / "step_7.tmp"));
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir / "step_7.tmp"), "step_7.tmp", "unfinished save");
  save_demo(dir.path(), 3);
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_1", "step_3"}));
}

TEST(CheckpointSave, AnUncommittedSaveRemovesItsFolderAndChangesNothing) {
  TempDir dir;
  save_demo(dir.path(), 1);
  {
    CheckpointWriter writer(dir.path(), 2, 2);
    writer.write_shard(1, demo_tensors(1));
    EXPECT_CHECKPOINT_ERROR(writer.commit(demo_state(2, 2)), "rank 0 has not written its shard");
  }
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_1"}));
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);
}

TEST(CheckpointSave, RefusesToOverwriteASavedStep) {
  TempDir dir;
  save_demo(dir.path(), 4);
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir.path(), 4, 2), "step_4", "exists already");
}

TEST(CheckpointSave, RefusesToOverwriteAStepOlderThanTheOneLatestNames) {
  TempDir dir;
  save_demo(dir.path(), 4);
  save_demo(dir.path(), 6);
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir.path(), 4, 2), "step_4", "exists already");
  EXPECT_EQ(read_file(dir / "latest"), "step_6\n");
}

TEST(CheckpointSave, RefusesAStepBehindTheOneLatestNamesEvenWhenItsFolderIsGone) {
  // The older steps removed (as --keep does): a save of one of them would move `latest` back,
  // and step_6 would then read as an unpublished leftover that a save of step 6 replaces.
  TempDir dir;
  save_demo(dir.path(), 2);
  save_demo(dir.path(), 6);
  fs::remove_all(dir / "step_2");
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir.path(), 2, 2), "cannot save step 2",
                          "names step 6, a later checkpoint");
  ASSERT_TRUE(save_refusal(dir.path(), 4).has_value());
  EXPECT_FALSE(save_refusal(dir.path(), 7).has_value());
  EXPECT_EQ(read_file(dir / "latest"), "step_6\n");
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_6"}));
}

TEST(CheckpointSave, RefusesAFolderInPlaceOfLatestBeforeWritingAShard) {
  // The commit's rename onto `latest` would fail only after every shard was written, leaving
  // the step folder renamed into place but never published.
  TempDir dir;
  save_demo(dir.path(), 2);
  fs::remove(dir / "latest");
  fs::create_directory(dir / "latest");
  const std::string expected = "'" + (dir / "latest").string() +
                               "' is a folder, where a save writes the file naming the newest "
                               "checkpoint; remove it or save into another folder";
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir.path(), 4, 2), "cannot save step 4: ", expected);
  ASSERT_TRUE(save_refusal(dir.path(), 4).has_value());
  EXPECT_NE(save_refusal(dir.path(), 4)->find(expected), std::string::npos);
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_2"}));
}

TEST(CheckpointSave, ReplacesAStepThatWasRenamedIntoPlaceButNeverPublished) {
  TempDir dir;
  save_demo(dir.path(), 2);
  save_demo(dir.path(), 4);
  // A crash between the rename of step_4 and the update of `latest`.
  write_file(dir / "latest", "step_2\n");
  ASSERT_EQ(open_checkpoint(dir.path()).step(), 2);
  // Only the run that resumed from the folder redoes that step; any other leaves it.
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir.path(), 4, 2), "step_4",
                          "newer than the step 'latest' names, and this run does not continue");
  EXPECT_TRUE(fs::exists(dir / "step_4" / "manifest.json"));
  EXPECT_FALSE(save_refusal(dir.path(), 4, /*continues_folder=*/true).has_value());
  {
    CheckpointWriter writer(dir.path(), 4, 2, {.continues_folder = true});
    // The old folder is out of the way, and `latest` still names a loadable checkpoint.
    EXPECT_FALSE(fs::exists(dir / "step_4"));
    EXPECT_EQ(open_checkpoint(dir.path()).step(), 2);
    writer.write_shard(0, demo_tensors(0));
    writer.write_shard(1, demo_tensors(1));
    writer.commit(demo_state(4, 2));
  }
  EXPECT_EQ(read_file(dir / "latest"), "step_4\n");
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 4);
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_2", "step_4"}));
}

TEST(CheckpointSave, RejectsAStateTheLoaderWouldReject) {
  TempDir dir;
  save_demo(dir.path(), 1);
  CheckpointWriter writer(dir.path(), 2, 2);
  writer.write_shard(0, demo_tensors(0));
  writer.write_shard(1, demo_tensors(1));
  TrainingState state = demo_state(2, 2);
  state.stages[1].rank = 5;
  EXPECT_THROW(writer.commit(state), std::invalid_argument);
  state = demo_state(3, 2);
  EXPECT_THROW(writer.commit(state), std::invalid_argument);  // another step
  EXPECT_EQ(read_file(dir / "latest"), "step_1\n");
}

TEST(CheckpointSave, MisuseIsAnInvalidArgument) {
  TempDir dir;
  EXPECT_THROW(CheckpointWriter(dir.path(), 1, 0), std::invalid_argument);
  EXPECT_THROW(CheckpointWriter(dir.path(), -1, 1), std::invalid_argument);
  CheckpointWriter writer(dir.path(), 1, 2);
  EXPECT_THROW(writer.write_shard(2, demo_tensors(0)), std::invalid_argument);
  writer.write_shard(0, demo_tensors(0));
  EXPECT_THROW(writer.write_shard(0, demo_tensors(0)), std::logic_error);
  EXPECT_THROW(writer.write_shard(1, {{"x", Tensor()}}), std::invalid_argument);
  writer.write_shard(1, demo_tensors(1));  // a failed rank may try again
  writer.commit(demo_state(1, 2));
}

// A name holding a line break is shown escaped, so the message stays one line.
TEST(CheckpointSave, AFolderNamedWithALineBreakIsNamedOnOneLine) {
  TempDir dir;
  write_file(dir / "a\nfile", "not a folder");
  const std::string message =
      checkpoint_error_of([&] { CheckpointWriter(dir / "a\nfile" / "ckpt", 1, 1); });
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_NE(message.find("a\\nfile/ckpt':"), std::string::npos) << message;
  EXPECT_NE(message.find("a\\nfile' is a file, not a folder"), std::string::npos) << message;
}

TEST(CheckpointSave, AFolderThatCannotBeCreatedIsNamed) {
  TempDir dir;
  write_file(dir / "a_file", "not a folder");
  // The file in the way is named, not only the system's "Not a directory".
  const std::string in_the_way = "'" + (dir / "a_file").string() + "' is a file, not a folder";
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir / "a_file" / "ckpt", 1, 1), "a_file/ckpt",
                          "cannot create checkpoint folder", in_the_way);
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir / "a_file", 1, 1), "a_file",
                          "cannot create checkpoint folder", in_the_way);
  // Something else than a regular file is named for what it is.
  ASSERT_EQ(::mkfifo((dir / "a_pipe").c_str(), 0600), 0);
  EXPECT_CHECKPOINT_ERROR(
      CheckpointWriter(dir / "a_pipe", 1, 1), "a_pipe", "cannot create checkpoint folder",
      "'" + (dir / "a_pipe").string() + "' is a FIFO (named pipe), not a folder");
  // A link to nothing is named with its target, not as a file that "exists".
  fs::create_symlink("gone/ckpt", dir / "a_link");
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir / "a_link", 1, 1),
                          "cannot create checkpoint folder '" + (dir / "a_link").string() + "': '" +
                              (dir / "a_link").string() +
                              "' is a symbolic link to 'gone/ckpt', which does not exist");
  EXPECT_CHECKPOINT_ERROR(CheckpointWriter(dir / "a_link" / "sub", 1, 1),
                          "': '" + (dir / "a_link").string() +
                              "' is a symbolic link to 'gone/ckpt', which does not exist");
}

TEST(CheckpointSave, AnEmptyFolderPathIsSaidToBeEmpty) {
  EXPECT_EQ(checkpoint_error_of([] { CheckpointWriter("", 1, 1); }),
            "no checkpoint folder was given: its path is empty");
}

TEST(CheckpointSave, AShardWriteErrorNamesTheFileAndKeepsThePreviousCheckpoint) {
  TempDir dir;
  save_demo(dir.path(), 1);
  CheckpointWriter writer(dir.path(), 2, 2);
  writer.write_shard(0, demo_tensors(0));
  fs::remove_all(writer.temp_directory());  // the folder is gone: the shard cannot be created
  EXPECT_CHECKPOINT_ERROR(writer.write_shard(1, demo_tensors(1)), "step_2.tmp/rank_1.safetensors",
                          "No such file or directory");
  const Checkpoint ckpt = open_checkpoint(dir.path());
  EXPECT_EQ(ckpt.step(), 1);
  EXPECT_EQ(ckpt.tensors().size(), 2 * demo_tensors(0).size());
}

// A commit that cannot write the manifest or `latest` (a full disk, or here a folder in the
// file's place) throws naming the file and leaves `latest` naming the previous checkpoint.
// The step is then an unfinished save, removed with the writer: renamed into place but not
// published, it held the space the next save needed on a full disk.
TEST(CheckpointSave, ACommitFailingAtTheManifestOrLatestKeepsThePreviousCheckpoint) {
  TempDir dir;
  save_demo(dir.path(), 1);
  {
    CheckpointWriter writer(dir.path(), 2, 2);
    writer.write_shard(0, demo_tensors(0));
    writer.write_shard(1, demo_tensors(1));
    fs::create_directory(writer.temp_directory() / "manifest.json");
    EXPECT_CHECKPOINT_ERROR(writer.commit(demo_state(2, 2)), "cannot create '",
                            "step_2.tmp/manifest.json': Is a directory");
  }
  EXPECT_EQ(read_file(dir / "latest"), "step_1\n");
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_1"}));
  {
    CheckpointWriter writer(dir.path(), 2, 2, {.keep_last = 1});
    writer.write_shard(0, demo_tensors(0));
    writer.write_shard(1, demo_tensors(1));
    fs::create_directory(dir / "latest.tmp");
    EXPECT_CHECKPOINT_ERROR(writer.commit(demo_state(2, 2)), "cannot create '",
                            "latest.tmp': Is a directory");
    EXPECT_EQ(folder_names(dir.path()),
              (std::vector<std::string>{"latest", "step_1", "step_2.tmp"}));
  }
  EXPECT_EQ(read_file(dir / "latest"), "step_1\n");
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);  // not pruned by keep_last either
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_1"}));
  save_demo(dir.path(), 2);
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 2);
}

// In a child process: saves `tensors` under a file size limit of `limit` bytes (a disk that
// fills up mid-write) and exits 0 after printing the CheckpointError, 1 without one.
[[noreturn]] void save_under_file_size_limit(const fs::path& dir,
                                             const std::vector<NamedTensor>& tensors,
                                             rlim_t limit) {
  ::signal(SIGXFSZ, SIG_IGN);  // the write then fails with EFBIG instead of killing us
  const rlimit r{limit, limit};
  ::setrlimit(RLIMIT_FSIZE, &r);
  try {
    CheckpointWriter writer(dir, 2, 1);
    writer.write_shard(0, tensors);
  } catch (const CheckpointError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(0);
  }
  std::exit(1);
}

TEST(CheckpointSave, AFullDiskMidWriteNamesTheFileAndKeepsThePreviousCheckpoint) {
  TempDir dir;
  save_demo(dir.path(), 1);
  const std::vector<NamedTensor> big = {{"big", random_tensor(DType::kF32, {64, 1024}, 9)}};
  // 100000 bytes: the header and part of the 256 KiB tensor get written, then the disk is full.
  EXPECT_EXIT(save_under_file_size_limit(dir.path(), big, 100000), ::testing::ExitedWithCode(0),
              "cannot write .*step_2.tmp/rank_0.safetensors': File too large");
  const Checkpoint ckpt = open_checkpoint(dir.path());
  EXPECT_EQ(ckpt.step(), 1);
  EXPECT_FALSE(fs::exists(dir / "step_2"));
  EXPECT_FALSE(fs::exists(dir / "step_2.tmp"));
}

// In a child process: checks `dir` as a run that saves into it does, unable to write a byte (a
// full disk), and exits 0 after printing the CheckpointError, 1 without one.
[[noreturn]] void check_folder_unable_to_write(const fs::path& dir) {
  ::signal(SIGXFSZ, SIG_IGN);
  const rlimit none{0, RLIM_INFINITY};
  ::setrlimit(RLIMIT_FSIZE, &none);
  try {
    check_checkpoint_directory(dir);
  } catch (const CheckpointError& e) {
    // Lifted again: the test reads the message from a file.
    const rlimit any{RLIM_INFINITY, RLIM_INFINITY};
    ::setrlimit(RLIMIT_FSIZE, &any);
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(0);
  }
  std::exit(1);
}

TEST(CheckpointSave, AFolderThatTakesNoByteIsRefusedBeforeTheRunWithTheReason) {
  TempDir dir;
  EXPECT_EXIT(check_folder_unable_to_write(dir.path()), ::testing::ExitedWithCode(0),
              "cannot write into checkpoint folder '.*': File too large; choose a writable "
              "folder \\(TrainerCheckpointOptions::directory\\)");
  EXPECT_TRUE(folder_names(dir.path()).empty());  // the probe is removed
}

}  // namespace
}  // namespace conveyor
