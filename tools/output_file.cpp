#include "tools/output_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "tools/cli_common.h"

namespace conveyor::cli {

OutputFile::OutputFile(const std::string& path, const std::string& flag, bool lock)
    : path_(path), flag_(flag) {
  const std::string shown = "'" + escape_for_message(path) + "'";
  if (path.empty()) throw UsageError(flag + " needs a file name");
  // Not O_TRUNC: a file another run holds must not be emptied before its lock is seen.
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw UsageError("cannot open " + flag + " file " + shown +
                     " for writing: " + std::strerror(errno));
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
  if (regular && ::ftruncate(fd_, 0) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw UsageError("cannot truncate " + flag + " file " + shown + ": " + std::strerror(err));
  }
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : path_(std::move(other.path_)), flag_(std::move(other.flag_)), fd_(other.fd_) {
  other.fd_ = -1;
}

OutputFile& OutputFile::operator=(OutputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    flag_ = std::move(other.flag_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const std::string& text) {
  if (fd_ < 0) throw std::logic_error("write to a closed " + flag_ + " file");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw std::runtime_error("cannot write " + flag_ + " file '" + escape_for_message(path_) +
                               "': " + std::strerror(n < 0 ? errno : EIO));
    done += static_cast<size_t>(n);
  }
}

void OutputFile::close() {
  if (fd_ < 0) return;
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0)
    throw std::runtime_error("cannot write " + flag_ + " file '" + escape_for_message(path_) +
                             "' (close failed): " + std::strerror(errno));
}

}  // namespace conveyor::cli
