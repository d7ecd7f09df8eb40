// read_input_file: the checks every reader of a user-given file makes (data, schedule and plan
// files), each refusal one sentence that names the file as its reader does.
#include "engine/schedule/input_file.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <string>

namespace conveyor {
namespace {

namespace fs = std::filesystem;

// What `body` says, run in a forked child (a read that must not touch this process: one done
// as another user, or one whose memory is measured); `usage` receives the child's resource use.
std::string said_in_child(const std::function<std::string()>& body, struct rusage* usage) {
  int pipe_ends[2];
  if (::pipe(pipe_ends) != 0) return "cannot make a pipe";
  const pid_t child = ::fork();
  if (child < 0) return "cannot fork";
  if (child == 0) {
    ::close(pipe_ends[0]);
    const std::string said = body();
    [[maybe_unused]] const ssize_t n = ::write(pipe_ends[1], said.data(), said.size());
    ::_exit(0);
  }
  ::close(pipe_ends[1]);
  std::string said;
  char buffer[512];
  for (ssize_t n; (n = ::read(pipe_ends[0], buffer, sizeof buffer)) > 0;) said.append(buffer, n);
  ::close(pipe_ends[0]);
  int status = 0;
  ::wait4(child, &status, 0, usage);
  return said;
}

// A fresh folder, removed with what it holds.
class InputFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "conveyor_input_file.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  static InputFileRules rules(const std::string& path, uint64_t max_bytes = 1 << 20) {
    return {"test file '" + path + "'", "a file of test bytes", max_bytes, "are read here"};
  }
  // The sentence read_input_file refuses `path` with.
  static std::string refusal(const std::string& path, uint64_t max_bytes = 1 << 20) {
    try {
      read_input_file(path, rules(path, max_bytes));
    } catch (const InputFileError& e) {
      return e.what();
    }
    ADD_FAILURE() << path << " was read";
    return "";
  }

  fs::path dir_;
};

TEST_F(InputFile, ReadsEveryByteOfARegularFile) {
  std::mt19937 rng(20240611);
  std::string bytes(300000, '\0');  // more than one read's buffer, every byte value
  for (char& c : bytes) c = static_cast<char>(rng());
  const std::string path = write("data.bin", bytes);
  EXPECT_EQ(read_input_file(path, rules(path)), bytes);
  EXPECT_EQ(read_input_file(write("empty", ""), rules(path)), "");
}

TEST_F(InputFile, AMissingFileIsSaidSo) {
  const std::string path = (dir_ / "absent.txt").string();
  EXPECT_EQ(refusal(path), "cannot read test file '" + path + "': no such file");
}

// The system says "No such file or directory" or "Not a directory" of each; the message says
// what is there instead.
TEST_F(InputFile, APathUnderAFileNamesTheFile) {
  const std::string plain = write("plain", "x");
  for (const std::string& under_a_file : {plain + "/absent.txt", plain + "/"})
    EXPECT_EQ(refusal(under_a_file), "cannot read test file '" + under_a_file + "': '" + plain +
                                         "' is a file, not a folder");
}

TEST_F(InputFile, ALinkToNothingNamesWhereItLeads) {
  const std::string link = (dir_ / "link").string();
  fs::create_symlink("gone/file.txt", link);
  const std::string why =
      "'" + link + "' is a symbolic link to 'gone/file.txt', which does not exist";
  EXPECT_EQ(refusal(link), "cannot read test file '" + link + "': " + why);
  EXPECT_EQ(refusal(link + "/x"), "cannot read test file '" + link + "/x': " + why);
  // Through a chain of links, to where the last one leads.
  const std::string first = (dir_ / "first").string();
  fs::create_symlink("link", first);
  EXPECT_EQ(refusal(first), "cannot read test file '" + first + "': '" + first +
                                "' is a symbolic link to '" + (dir_ / "gone/file.txt").string() +
                                "', which does not exist");
  // A link to a file that is there reads that file.
  fs::create_symlink("plain", dir_ / "good");
  write("plain", "x");
  EXPECT_EQ(read_input_file((dir_ / "good").string(), rules(link)), "x");
}

TEST_F(InputFile, ADirectoryIsRefusedWithWhatToGive) {
  EXPECT_EQ(refusal(dir_.string()),
            "test file '" + dir_.string() + "' is a directory; give a file of test bytes");
}

TEST_F(InputFile, AFifoIsRefusedAtOnceWithoutWaitingForAWriter) {
  const std::string path = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  // Run apart so that a hang fails the test instead of stopping it.
  auto result = std::async(std::launch::async, [&] { return refusal(path); });
  ASSERT_EQ(result.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "reading a FIFO waited for a writer";
  EXPECT_EQ(result.get(), "test file '" + path +
                              "' is a FIFO (named pipe), not a regular file; give a file "
                              "of test bytes (at most 1 MiB)");
}

TEST_F(InputFile, ADeviceIsRefusedNotReadWithoutEnd) {
  EXPECT_EQ(refusal("/dev/zero"),
            "test file '/dev/zero' is a character device, not a regular file; give a file "
            "of test bytes (at most 1 MiB)");
}

TEST_F(InputFile, AFileAboveTheLimitIsRefusedBeforeItIsRead) {
  const std::string path = write("big.bin", std::string(1001, 'a'));
  EXPECT_EQ(refusal(path, 1000),
            "test file '" + path + "' has 1001 bytes; at most 1000 bytes are read here");
  EXPECT_EQ(read_input_file(path, rules(path, 1001)).size(), 1001u);
  const std::string mib = write("mib.bin", std::string((1 << 20) + 1, 'b'));
  EXPECT_EQ(refusal(mib), "test file '" + mib + "' has 1048577 bytes; at most 1 MiB are read here");
}

// Files of /proc report a size of 0 and hold more: read to their end, within the limit.
TEST_F(InputFile, AFileWhoseSizeIsNotReportedIsReadWithinTheLimit) {
  const std::string path = "/proc/self/status";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || st.st_size != 0)
    GTEST_SKIP() << path << " is not a zero-size file of /proc here";
  const std::string text = read_input_file(path, rules(path));
  EXPECT_NE(text.find("Name:"), std::string::npos) << text;
  EXPECT_NE(refusal(path, 16).find("' has more than 16 bytes; at most 16 bytes are read here"),
            std::string::npos);
}

// /proc/self/pagemap reports 0 bytes and holds many GiB: it is refused without the first 512 MiB
// read into memory, which the child that tries it would then have held.
TEST_F(InputFile, AFileWhoseSizeIsNotReportedIsRefusedBeforeTheLimitIsRead) {
  const std::string path = "/proc/self/pagemap";
  if (::access(path.c_str(), R_OK) != 0) GTEST_SKIP() << path << " cannot be read here";
  constexpr uint64_t kLimit = uint64_t{512} << 20;
  struct rusage usage {};
  const std::string said = said_in_child(
      [&] {
        try {
          read_input_file(path, rules(path, kLimit));
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
        return std::string("read");
      },
      &usage);
  EXPECT_EQ(said, "test file '" + path +
                      "' has more than 536870912 bytes; at most 512 MiB are read here");
  EXPECT_LT(usage.ru_maxrss, 256 << 10) << "KiB resident at most in the child";
}

TEST_F(InputFile, AnUnreadableFileGivesTheSystemsReason) {
  const std::string path = write("secret.txt", "x");
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  if (::geteuid() != 0) {
    EXPECT_EQ(refusal(path), "cannot read test file '" + path + "': Permission denied");
    return;
  }
  // Root reads a file of mode 000 all the same: the read is tried by a child process that has
  // become the unprivileged user `nobody` (65534), in a folder it may look into.
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  const std::string said = said_in_child(
      [&] {
        if (::setgid(65534) != 0 || ::setuid(65534) != 0)
          return std::string("cannot become nobody");
        try {
          read_input_file(path, rules(path));
        } catch (const InputFileError& e) {
          return std::string(e.what());
        }
        return std::string("read");
      },
      nullptr);
  if (said == "cannot become nobody") GTEST_SKIP() << "this root may not change its user id";
  EXPECT_EQ(said, "cannot read test file '" + path + "': Permission denied");
}

}  // namespace
}  // namespace conveyor
