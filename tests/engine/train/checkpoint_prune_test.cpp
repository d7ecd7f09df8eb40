// Removing the checkpoints beyond the newest keep_last: a removal that fails halfway leaves a
// folder no load takes for a checkpoint and no later save fails on, later saves remove it once
// they can, and a training run says once that it cannot.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "engine/train/trainer_checkpoint.h"
#include "support/train_config.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// A file `folder`/extra/notes.txt that cannot be removed until release(), wherever `folder`
// is renamed to: immutable (chattr +i) for root, whom permission bits do not stop, and for
// anyone else in a subfolder without write permission. Or, for root only, `folder` itself
// immutable, which cannot even be renamed. Held through open descriptors, which follow the
// renames.
class Unremovable {
 public:
  enum Where { kAFileInside, kTheFolder };
  explicit Unremovable(const fs::path& folder, Where where = kAFileInside) {
    if (where == kTheFolder) {
      if (::geteuid() == 0) set_immutable(folder);
      return;
    }
    fs::create_directory(folder / "extra");
    std::ofstream(folder / "extra" / "notes.txt") << "a file the removal stops at\n";
    if (::geteuid() != 0) {
      fd_ = ::open((folder / "extra").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      held_ = fd_ >= 0 && ::fchmod(fd_, 0500) == 0;
      return;
    }
    set_immutable(folder / "extra" / "notes.txt");
  }
  ~Unremovable() {
    release();
    if (fd_ >= 0) ::close(fd_);
  }
  Unremovable(const Unremovable&) = delete;
  Unremovable& operator=(const Unremovable&) = delete;
  // False where the file system or the process's capabilities allow no such file.
  bool held() const { return held_; }
  void release() {
    if (!held_) return;
    held_ = false;
    if (::geteuid() != 0) {
      ::fchmod(fd_, 0755);
      return;
    }
    int flags = 0;
    if (::ioctl(fd_, FS_IOC_GETFLAGS, &flags) == 0) {
      flags &= ~FS_IMMUTABLE_FL;
      ::ioctl(fd_, FS_IOC_SETFLAGS, &flags);
    }
  }

 private:
  void set_immutable(const fs::path& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    int flags = 0;
    held_ = fd_ >= 0 && ::ioctl(fd_, FS_IOC_GETFLAGS, &flags) == 0 &&
            (flags |= FS_IMMUTABLE_FL, ::ioctl(fd_, FS_IOC_SETFLAGS, &flags) == 0);
  }
  int fd_ = -1;
  bool held_ = false;
};

CommitResult save_demo_keeping(const fs::path& dir, int64_t step, int keep_last) {
  CheckpointWriter writer(dir, step, 2, {keep_last});
  for (int r = 0; r < 2; ++r) writer.write_shard(r, demo_tensors(r, step));
  return writer.commit(demo_state(step, 2));
}

std::string removal_warning(const fs::path& dir, const std::string& step_folder,
                            const std::string& reason) {
  return "cannot remove old checkpoint '" + (dir / step_folder).string() + "': " + reason +
         "; what is left of it is named " + step_folder +
         ".removing, which no load takes for a checkpoint and the next saves try again to "
         "remove";
}

std::string unremovable_reason() {
  return ::geteuid() == 0 ? "Operation not permitted" : "Permission denied";
}

TEST(CheckpointPrune, AFailedRemovalLeavesNoFolderThatReadsAsACheckpoint) {
  TempDir dir;
  save_demo_keeping(dir.path(), 1, 1);
  Unremovable stuck(dir / "step_1");
  if (!stuck.held()) GTEST_SKIP() << "no file here can be made impossible to remove";
  const CommitResult result = save_demo_keeping(dir.path(), 2, 1);
  EXPECT_EQ(
      result.warnings,
      (std::vector<std::string>{removal_warning(dir.path(), "step_1", unremovable_reason())}));
  EXPECT_TRUE(result.removed.empty());
  EXPECT_EQ(folder_names(dir.path()),
            (std::vector<std::string>{"latest", "step_1.removing", "step_2"}));
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 2);
  EXPECT_THROW(open_checkpoint(dir / "step_1.removing"), NotACheckpointError);
  EXPECT_FALSE(save_refusal(dir.path(), 3).has_value());
}

// One that cannot be renamed is not touched: it stays a whole checkpoint under its name.
TEST(CheckpointPrune, AnOldCheckpointThatCannotBeRenamedStaysWhole) {
  TempDir dir;
  save_demo_keeping(dir.path(), 1, 1);
  Unremovable stuck(dir / "step_1", Unremovable::kTheFolder);
  if (!stuck.held()) GTEST_SKIP() << "only root can make a folder that cannot be renamed";
  const CommitResult result = save_demo_keeping(dir.path(), 2, 1);
  EXPECT_EQ(result.warnings,
            std::vector<std::string>{"cannot remove old checkpoint '" + (dir / "step_1").string() +
                                     "', which stays whole: " + unremovable_reason()});
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_1", "step_2"}));
  EXPECT_EQ(open_checkpoint(dir / "step_1", CheckpointCheck::kEveryByte).step(), 1);
}

// Named by hand, such a folder is refused even when all of its files are still there.
TEST(CheckpointPrune, TheLoaderRefusesAFolderBeingRemoved) {
  TempDir dir;
  save_demo(dir.path(), 1);
  fs::rename(dir / "step_1", dir / "step_1.removing");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(dir / "step_1.removing"), "step_1.removing'",
                          "is an old checkpoint whose removal did not finish");
  EXPECT_THROW(open_checkpoint(dir / "step_1.removing"), NotACheckpointError);
}

// Unlike an unfinished save that cannot be removed, the leftover never makes a save fail;
// each save tries again, in the same words while it fails, and removes it once it can.
TEST(CheckpointPrune, LaterSavesRemoveWhatAFailedRemovalLeft) {
  TempDir dir;
  save_demo_keeping(dir.path(), 1, 1);
  Unremovable stuck(dir / "step_1");
  if (!stuck.held()) GTEST_SKIP() << "no file here can be made impossible to remove";
  const std::string warning = removal_warning(dir.path(), "step_1", unremovable_reason());
  EXPECT_EQ(save_demo_keeping(dir.path(), 2, 1).warnings, std::vector<std::string>{warning});
  const CommitResult third = save_demo_keeping(dir.path(), 3, 1);
  EXPECT_EQ(third.warnings, std::vector<std::string>{warning});
  EXPECT_EQ(third.removed, std::vector<fs::path>{dir / "step_2"});
  EXPECT_EQ(folder_names(dir.path()),
            (std::vector<std::string>{"latest", "step_1.removing", "step_3"}));
  stuck.release();
  // Also without keep_last: the leftover is of no use to anyone.
  const CommitResult fourth = save_demo_keeping(dir.path(), 4, 0);
  EXPECT_TRUE(fourth.warnings.empty());
  EXPECT_EQ(fourth.removed, std::vector<fs::path>{dir / "step_1.removing"});
  EXPECT_EQ(folder_names(dir.path()), (std::vector<std::string>{"latest", "step_3", "step_4"}));
}

// A run that saves after every step says once that an old checkpoint cannot be removed, not
// at every save.
TEST(CheckpointPrune, ARunSaysOnceThatAnOldCheckpointCannotBeRemoved) {
  TempDir dir;
  Trainer trainer(testing::small_train_config(1, 1));
  std::vector<std::string> warnings;
  TrainerCheckpointOptions options;
  options.directory = dir.path();
  options.every = 1;
  options.keep_last = 1;
  options.warn = [&warnings](const std::string& w) { warnings.push_back(w); };
  TrainerCheckpointer checkpointer(trainer, options);
  trainer.step();
  checkpointer.after_step();
  Unremovable stuck(dir / "step_1");
  if (!stuck.held()) GTEST_SKIP() << "no file here can be made impossible to remove";
  for (int i = 0; i < 3; ++i) {
    trainer.step();
    checkpointer.after_step();
  }
  EXPECT_EQ(checkpointer.last_saved_step(), 4);
  EXPECT_EQ(
      warnings,
      (std::vector<std::string>{removal_warning(dir.path(), "step_1", unremovable_reason())}));
  EXPECT_EQ(folder_names(dir.path()),
            (std::vector<std::string>{"latest", "step_1.removing", "step_4"}));
}

}  // namespace
}  // namespace conveyor
