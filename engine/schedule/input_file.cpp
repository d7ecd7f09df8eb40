#include "engine/schedule/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iterator>

namespace conveyor {
namespace {

// "64 MiB", or the bytes when they are not whole MiB.
std::string size_text(uint64_t bytes) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  return bytes > 0 && bytes % kMiB == 0 ? std::to_string(bytes / kMiB) + " MiB"
                                        : std::to_string(bytes) + " bytes";
}

// Closes a file descriptor on every way out.
struct ClosedOnExit {
  int fd;
  ~ClosedOnExit() { ::close(fd); }
};

// Where the symbolic link `link` ends: its target as written for one link, else the last
// link's target joined to the folder it is read from.
std::string link_end(const std::filesystem::path& link) {
  std::error_code error;
  std::filesystem::path at = link;
  std::filesystem::path to = std::filesystem::read_symlink(at, error);
  if (error) return {};
  bool chained = false;
  for (int hop = 1; hop < 40; ++hop) {  // the kernel's own limit on links followed
    const std::filesystem::path next = to.is_absolute() ? to : at.parent_path() / to;
    struct stat st {};
    if (::lstat(next.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) break;
    at = next;
    to = std::filesystem::read_symlink(at, error);
    if (error) return {};
    chained = true;
  }
  return (chained && !to.is_absolute() ? at.parent_path() / to : to).string();
}

}  // namespace

std::string file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

std::string why_not_found(const std::string& path) {
  const std::filesystem::path whole = path;
  std::filesystem::path at;
  for (auto part = whole.begin(); part != whole.end(); ++part) {
    if (part->empty()) break;  // the end of a path that ends in '/'
    at /= *part;
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0) return {};
    if (S_ISLNK(st.st_mode) && ::stat(at.c_str(), &st) != 0) {
      if (errno != ENOENT && errno != ENOTDIR) return {};
      const std::string end = link_end(at);
      if (end.empty()) return {};
      return quoted_file_name(at.native()) + " is a symbolic link to " + quoted_file_name(end) +
             ", which does not exist";
    }
    const bool goes_on = std::next(part) != whole.end();
    if (goes_on && !S_ISDIR(st.st_mode))
      return quoted_file_name(at.native()) + " is " + file_kind(st.st_mode) + ", not a folder";
  }
  return {};
}

std::string message_excerpt(std::string_view text) {
  return text.size() > 40 ? std::string(text.substr(0, 37)) + "..." : std::string(text);
}

namespace {

std::string escaped(std::string_view text, bool double_backslashes) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\\') {
      out += double_backslashes ? "\\\\" : "\\";
    } else if (c < 0x20 || c >= 0x7f) {
      static constexpr char kDigits[] = "0123456789abcdef";
      out.append("\\x").append(1, kDigits[c >> 4]).append(1, kDigits[c & 0xf]);
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace

std::string escaped_for_message(std::string_view text) { return escaped(text, true); }

std::string escaped_keeping_backslashes(std::string_view text) { return escaped(text, false); }

std::string quoted_file_name(std::string_view path) {
  std::string out = "'";
  out += escaped_for_message(path);
  out += '\'';
  return out;
}

std::string read_input_file(const std::string& path, const InputFileRules& rules) {
  const std::string& shown = rules.shown;
  const auto fail = [](const std::string& sentence) { throw InputFileError(sentence); };
  const auto unreadable = [&](int err) {
    fail("cannot read " + shown + ": " + std::strerror(err));
  };
  const auto not_regular = [&](mode_t mode) {
    fail(shown + " is " + file_kind(mode) + ", not a regular file; give " + rules.expected +
         " (at most " + size_text(rules.max_bytes) + ")");
  };
  const auto too_large = [&](const std::string& size) {
    fail(shown + " has " + size + " bytes; at most " + size_text(rules.max_bytes) + " " +
         rules.over_the_limit);
  };
  // Looked at by name first, to say what is there without opening it.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      const std::string why = why_not_found(path);
      fail("cannot read " + shown + ": " + (why.empty() ? "no such file" : why));
    }
    unreadable(err);
  }
  if (S_ISDIR(st.st_mode)) fail(shown + " is a directory; give " + rules.expected);
  if (!S_ISREG(st.st_mode)) not_regular(st.st_mode);
  // O_NONBLOCK: should a FIFO have taken the name since, the open does not wait for a writer;
  // the descriptor is checked again, and a regular file reads the same with it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) unreadable(errno);
  const ClosedOnExit closer{fd};
  if (::fstat(fd, &st) != 0) unreadable(errno);
  if (!S_ISREG(st.st_mode)) not_regular(st.st_mode);
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > rules.max_bytes) too_large(std::to_string(size));
  // A file whose size the kernel does not report (those of /proc) is asked for a byte past the
  // limit first: one that has it is refused before up to the limit is read into memory for
  // nothing (/proc/self/pagemap holds many GiB). One that cannot be read at an offset is read
  // from the start, the loop below holding it to the limit.
  if (size == 0) {
    // From a multiple of 8 bytes, as files of 8-byte entries (pagemap) take no other offset.
    const uint64_t at = rules.max_bytes / 8 * 8;
    char bytes[16];
    ssize_t n = 0;
    do {
      n = ::pread(fd, bytes, sizeof bytes, static_cast<off_t>(at));
    } while (n < 0 && errno == EINTR);
    if (n > 0 && at + static_cast<uint64_t>(n) > rules.max_bytes)
      too_large("more than " + std::to_string(rules.max_bytes));
  }
  // To the end, not to the size: files of /proc report 0 bytes and hold more.
  std::string content;
  content.reserve(size);
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) unreadable(errno);
    if (n <= 0) break;
    if (content.size() + static_cast<uint64_t>(n) > rules.max_bytes)
      too_large("more than " + std::to_string(rules.max_bytes));
    content.append(buffer, static_cast<size_t>(n));
  }
  return content;
}

}  // namespace conveyor
