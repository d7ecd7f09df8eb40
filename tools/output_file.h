#pragma once
// Output files of the command line, opened and checked before any work starts and written
// with every write checked, so a full disk or a bad path fails loudly instead of "wrote ...".
#include <filesystem>
#include <string>
#include <string_view>

namespace conveyor::cli {

// Throws UsageError when `path` (a file or a folder), or the folder a path not made yet would
// be made in, is on one of the kernel's own file systems (/proc, /sys, debugfs, cgroup, ...):
// their files store nothing written to them and their folders take no new files, and a write
// there fails late with a misleading reason (EIO, EINVAL, ENOENT). A device or a FIFO is left
// alone: it is written in place, wherever it is. `shown` names the path for the message
// ("--out file '/proc/version'").
void refuse_kernel_file_system(const std::string& path, const std::string& shown);

// `path` as the file system resolves it (links followed, `.` and `..` gone), also for a file
// not made yet, so that two spellings of one name compare equal; "ck/" and "ck" alike.
std::filesystem::path resolved_path(const std::string& path);
// Whether `a` and `b` name one file: the same inode when both exist, else the same resolved
// path. What two output flags, or an output and an input, must not share.
bool same_file(const std::string& a, const std::string& b);
// Whether `path` is a device or a FIFO (/dev/null for both): written in place, it holds no
// contents a write would destroy, so outputs may share it and it may be an input's too.
bool written_in_place(const std::string& path);

class OutputFile {
 public:
  OutputFile() = default;
  // Opens `path` for writing (created) on behalf of `flag` (named in errors). A regular
  // file's old contents are cut off by the first write or the close, not here: a command
  // refused or interrupted before it writes anything leaves the file as it was, and one it
  // made is removed again (also when a signal ends the process, tools/interrupt.h).
  // With `lock`, takes an advisory lock (flock) on a regular file first, so a second run
  // writing the same file is refused instead of interleaving lines. Throws UsageError.
  // `named_as`, when given, is the file a failed write or close names: the one the user gave,
  // for a temporary written in its place.
  OutputFile(const std::string& path, const std::string& flag, bool lock,
             const std::string& named_as = {});
  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&& other) noexcept;
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  const std::string& path() const { return path_; }
  // Writes all of `text` straight to the file (unbuffered: a line is on disk when this
  // returns). Throws std::runtime_error naming the file and the system's reason; a regular
  // file is first cut back to where the text began, so that it holds none of a failed text.
  void write(std::string_view text);
  // Closes the file, reporting a failed close as write() does.
  void close();

 private:
  // The first write's or the close's: cuts off the old contents, and the file is kept.
  void begin_contents();
  // Closes a file neither written nor closed, removing it when it was made here.
  void discard();

  std::string path_, flag_, named_as_;
  int fd_ = -1;
  bool truncate_pending_ = false;  // a regular file whose old contents are still there
  bool made_here_ = false;         // made by the constructor, removed unless written or closed
  int made_slot_ = -1;             // its slot in the signal handler's registry
};

// An output file that holds either its old contents or the whole new text, never a part: the
// text goes to a temporary file next to `path`, made when this is constructed (so an
// unwritable directory fails before any work), and is renamed over `path` by commit() (over
// the file a link names, when `path` is a link). A run that fails before commit() leaves
// `path` as it was and removes the temporary, also when SIGINT or SIGTERM ends the run (the
// temporary is registered with the handler, tools/interrupt.h). A device or a FIFO is written
// in place.
class ReplacedFile {
 public:
  // Throws UsageError naming `flag` when `path` is a directory or its directory cannot take a
  // new file.
  ReplacedFile(const std::string& path, const std::string& flag);
  ReplacedFile(const ReplacedFile&) = delete;
  ReplacedFile& operator=(const ReplacedFile&) = delete;
  ~ReplacedFile();

  const std::string& path() const { return path_; }
  // Writes `text` to the temporary, closes it and renames it over the file. Throws
  // std::runtime_error naming the file and the system's reason.
  void commit(std::string_view text);
  // The same for a text written piece by piece as it is made (a document too large to hold):
  // append() writes a piece to the temporary, commit() puts the whole in place.
  void append(std::string_view piece);
  void commit();

 private:
  std::string path_, flag_, target_, temp_;
  int temp_slot_ = -1;  // the temporary's slot in the signal handler's registry
  OutputFile out_;
};

}  // namespace conveyor::cli
