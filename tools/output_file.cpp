#include "tools/output_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "tools/cli_common.h"
#include "tools/interrupt.h"

namespace conveyor::cli {

namespace {

// The name of the kernel file system `magic` (statfs's f_type) is, or null for any other.
const char* kernel_file_system_name(uint64_t magic) {
  switch (magic) {
    case PROC_SUPER_MAGIC:
      return "proc";
    case SYSFS_MAGIC:
      return "sysfs";
    case DEBUGFS_MAGIC:
      return "debugfs";
    case TRACEFS_MAGIC:
      return "tracefs";
    case SECURITYFS_MAGIC:
      return "securityfs";
    case CGROUP_SUPER_MAGIC:
      return "cgroup";
    case CGROUP2_SUPER_MAGIC:
      return "cgroup2";
    case BPF_FS_MAGIC:
      return "bpf";
    case PSTOREFS_MAGIC:
      return "pstore";
    case EFIVARFS_MAGIC:
      return "efivarfs";
    default:
      return nullptr;
  }
}

// The folder a file at `path` is made in.
std::string folder_of(const std::string& path) {
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  return folder.empty() ? "." : folder.string();
}

// Why a file cannot be made at `path`, given the error `err` of the attempt: a missing folder,
// a file where a folder should be or a link to nothing, named as such (the system says only
// "No such file or directory" or "Not a directory"); otherwise the system's reason.
std::string reason_no_file_is_made(const std::string& path, int err) {
  if (err == ENOENT || err == ENOTDIR) {
    if (std::string why = why_not_found(path); !why.empty()) return why;
    const std::string folder = folder_of(path);
    struct stat st {};
    if (::stat(folder.c_str(), &st) != 0)
      return "its folder " + quoted_file_name(folder) + " does not exist";
  }
  return std::strerror(err);
}

}  // namespace

std::filesystem::path resolved_path(const std::string& path) {
  std::error_code error;
  std::filesystem::path out = std::filesystem::weakly_canonical(path, error);
  if (error) out = std::filesystem::absolute(path, error).lexically_normal();
  return out.has_filename() ? out : out.parent_path();
}

namespace {

// The file a link names, through links that name files not made yet: resolved_path() stops
// at such a link, as the file system finds nothing behind it, while a write through it makes
// the file it names.
std::string through_links(const std::string& path) {
  std::filesystem::path at = path;
  for (int hop = 0; hop < 40; ++hop) {  // the kernel's own limit on links followed
    std::error_code error;
    if (!std::filesystem::is_symlink(std::filesystem::symlink_status(at, error)) || error) break;
    const std::filesystem::path target = std::filesystem::read_symlink(at, error);
    if (error) break;
    at = target.is_absolute() ? target : at.parent_path() / target;
  }
  return at.string();
}

}  // namespace

bool same_file(const std::string& a, const std::string& b) {
  std::error_code error;
  return std::filesystem::equivalent(a, b, error) ||
         resolved_path(through_links(a)) == resolved_path(through_links(b));
}

bool written_in_place(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

void refuse_kernel_file_system(const std::string& path, const std::string& shown) {
  if (written_in_place(path)) return;
  // A path not made yet: the nearest folder above it that exists, where it would be made.
  std::filesystem::path at = path.empty() ? "." : path;
  struct statfs fs {};
  while (::statfs(at.c_str(), &fs) != 0) {
    if (errno != ENOENT && errno != ENOTDIR) return;  // the open that follows says why
    const std::filesystem::path up = at.has_relative_path() && at.has_parent_path()
                                         ? at.parent_path()
                                         : std::filesystem::path(".");
    if (up == at) return;
    at = up;
  }
  if (const char* name = kernel_file_system_name(static_cast<uint64_t>(fs.f_type)))
    throw UsageError(shown + " is on the kernel's " + name +
                     " file system, which stores nothing written to it; give a path on a disk");
}

OutputFile::OutputFile(const std::string& path, const std::string& flag, bool lock,
                       const std::string& named_as)
    : path_(path), flag_(flag), named_as_(named_as.empty() ? path : named_as) {
  const std::string shown = quoted_file_name(path);
  if (path.empty()) throw UsageError(flag + " needs a file name");
  refuse_kernel_file_system(path, flag + " file " + shown);
  // Not O_TRUNC: a file another run holds must not be emptied before its lock is seen, nor
  // one the command is refused before writing. O_EXCL first, to know whether it is made here.
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  made_here_ = fd_ >= 0;
  if (fd_ < 0 && errno == EEXIST) fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw UsageError("cannot open " + flag + " file " + shown + " for writing: " +
                     (errno == EISDIR ? "it is a directory; give a file name"
                                      : reason_no_file_is_made(path, errno)));
  struct stat st {};
  const bool regular = ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode);
  if (lock && regular && ::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw UsageError(flag + " file " + shown +
                       " is being written by another run (it holds the file's lock); give "
                       "another file name or wait for that run to end");
    throw UsageError("cannot lock " + flag + " file " + shown + ": " + std::strerror(err));
  }
  truncate_pending_ = regular && !made_here_;
  if (made_here_) made_slot_ = register_temporary_file(path_);
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : path_(std::move(other.path_)),
      flag_(std::move(other.flag_)),
      named_as_(std::move(other.named_as_)),
      fd_(std::exchange(other.fd_, -1)),
      truncate_pending_(std::exchange(other.truncate_pending_, false)),
      made_here_(std::exchange(other.made_here_, false)),
      made_slot_(std::exchange(other.made_slot_, -1)) {}

OutputFile& OutputFile::operator=(OutputFile&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    flag_ = std::move(other.flag_);
    named_as_ = std::move(other.named_as_);
    fd_ = std::exchange(other.fd_, -1);
    truncate_pending_ = std::exchange(other.truncate_pending_, false);
    made_here_ = std::exchange(other.made_here_, false);
    made_slot_ = std::exchange(other.made_slot_, -1);
  }
  return *this;
}

OutputFile::~OutputFile() { discard(); }

void OutputFile::discard() {
  if (fd_ < 0) return;
  ::close(std::exchange(fd_, -1));
  // Neither written nor closed: the command failed before its output began.
  if (made_here_) {
    ::unlink(path_.c_str());
    unregister_temporary_file(std::exchange(made_slot_, -1));
    made_here_ = false;
  }
}

void OutputFile::begin_contents() {
  if (made_here_) {
    unregister_temporary_file(made_slot_);
    made_here_ = false;
    made_slot_ = -1;
  }
  if (!truncate_pending_) return;
  if (::ftruncate(fd_, 0) != 0)
    throw std::runtime_error("cannot truncate " + flag_ + " file '" +
                             escaped_for_message(named_as_) + "': " + std::strerror(errno));
  truncate_pending_ = false;
}

void OutputFile::write(std::string_view text) {
  if (fd_ < 0) throw std::logic_error("write to a closed " + flag_ + " file");
  begin_contents();
  // Where this text starts, in a regular file (-1 for a device or a FIFO).
  const off_t start = ::lseek(fd_, 0, SEEK_CUR);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      // A full disk or the file size limit takes part of a text first: cut it off again, so
      // that a log ends in its last whole line, not half of the next one.
      if (done > 0 && start >= 0 && ::ftruncate(fd_, start) == 0) ::lseek(fd_, start, SEEK_SET);
      throw std::runtime_error("cannot write " + flag_ + " file '" +
                               escaped_for_message(named_as_) + "': " + std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
}

void OutputFile::close() {
  if (fd_ < 0) return;
  begin_contents();
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0)
    throw std::runtime_error("cannot write " + flag_ + " file '" + escaped_for_message(named_as_) +
                             "' (close failed): " + std::strerror(errno));
}

namespace {

// `path` with its last component's symbolic links followed, also to a file not there yet.
std::string followed_links(std::string path) {
  for (int hops = 0; hops < 40; ++hops) {  // as the kernel's own limit of nested links
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
    std::error_code error;
    const std::filesystem::path to = std::filesystem::read_symlink(path, error);
    if (error) return path;
    path =
        to.is_absolute() ? to.string() : (std::filesystem::path(path).parent_path() / to).string();
  }
  return path;
}

}  // namespace

ReplacedFile::ReplacedFile(const std::string& path, const std::string& flag)
    : path_(path), flag_(flag) {
  const std::string shown = quoted_file_name(path);
  if (path.empty()) throw UsageError(flag + " needs a file name");
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (exists && S_ISDIR(st.st_mode))
    throw UsageError("cannot open " + flag + " file " + shown +
                     " for writing: it is a directory; give a file name");
  if (exists && !S_ISREG(st.st_mode)) {
    // A device or a FIFO holds no contents to keep, and a rename would replace the node
    // itself (/dev/full turned into a regular file): write to it as it is.
    out_ = OutputFile(path, flag, /*lock=*/false);
    return;
  }
  refuse_kernel_file_system(path, flag + " file " + shown);
  // Through a link to the file it names (made if need be), so that the rename replaces that
  // file, not the link.
  const std::string target = followed_links(path);
  target_ = target;
  // In the same directory, so that the rename replaces the file in one step.
  std::string temp = target + ".tmp.XXXXXX";
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) {
    const int err = errno;
    const std::string reason = reason_no_file_is_made(target, err);
    // A folder that is there but takes no new file: the file itself may well be writable,
    // so say that it is the folder the whole-file replacement needs.
    throw UsageError("cannot open " + flag + " file " + shown + " for writing: " +
                     (reason != std::strerror(err)
                          ? reason
                          : "no new file can be made in its folder '" +
                                escaped_for_message(folder_of(target)) + "' (" + reason +
                                "), and the file is replaced by one made there"));
  }
  temp_ = temp;
  temp_slot_ = register_temporary_file(temp_);
  // mkstemp makes the file 0600; the result gets the mode a new file would (or the old one's).
  mode_t mode = 0;
  if (exists) {
    mode = st.st_mode & 07777;
  } else {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    mode = 0666 & ~mask;
  }
  ::fchmod(fd, mode);
  ::close(fd);
  // A write that fails names the file given, not the temporary, which is removed.
  out_ = OutputFile(temp_, flag, /*lock=*/false, path);
}

ReplacedFile::~ReplacedFile() {
  if (!temp_.empty()) ::unlink(temp_.c_str());
  unregister_temporary_file(temp_slot_);
}

void ReplacedFile::commit(std::string_view text) {
  append(text);
  commit();
}

void ReplacedFile::append(std::string_view piece) { out_.write(piece); }

void ReplacedFile::commit() {
  out_.close();
  if (temp_.empty()) return;  // written in place (a device or a FIFO)
  const std::string shown = quoted_file_name(path_);
  if (::rename(temp_.c_str(), target_.c_str()) != 0)
    throw std::runtime_error(
        "cannot write " + flag_ + " file " + shown +
        " (renaming the finished file over it failed): " + std::strerror(errno));
  temp_.clear();
  // After the rename: a signal in between unlinks a name that is gone, harmlessly.
  unregister_temporary_file(std::exchange(temp_slot_, -1));
}

}  // namespace conveyor::cli
