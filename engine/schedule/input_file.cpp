#include "engine/schedule/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

}  // namespace

std::string message_excerpt(std::string_view text) {
  return text.size() > 40 ? std::string(text.substr(0, 37)) + "..." : std::string(text);
}

std::string escaped_for_message(std::string_view text) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c >= 0x7f) {
      static constexpr char kDigits[] = "0123456789abcdef";
      out.append("\\x").append(1, kDigits[c >> 4]).append(1, kDigits[c & 0xf]);
    } else {
      out += ch;
    }
  }
  return out;
}

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
  const auto not_regular = [&] {
    fail(shown + " is not a regular file (a device, pipe or socket); give " + rules.expected +
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
    if (err == ENOENT || err == ENOTDIR) fail("cannot read " + shown + ": no such file");
    unreadable(err);
  }
  if (S_ISDIR(st.st_mode)) fail(shown + " is a directory; give " + rules.expected);
  if (!S_ISREG(st.st_mode)) not_regular();
  // O_NONBLOCK: should a FIFO have taken the name since, the open does not wait for a writer;
  // the descriptor is checked again, and a regular file reads the same with it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) unreadable(errno);
  const ClosedOnExit closer{fd};
  if (::fstat(fd, &st) != 0) unreadable(errno);
  if (!S_ISREG(st.st_mode)) not_regular();
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > rules.max_bytes) too_large(std::to_string(size));
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
