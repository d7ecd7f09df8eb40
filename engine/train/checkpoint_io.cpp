#include "engine/train/checkpoint_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/core/test_pause.h"
#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_error.h"

// The library's implementation compiled into this file (it is what libxxhash builds), so the
// installed package needs no extra link dependency.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace conveyor::checkpoint_io {
namespace {

std::string reason(int error) { return std::error_code(error, std::generic_category()).message(); }

[[noreturn]] void fail(const std::string& what, const std::filesystem::path& path, int error) {
  throw CheckpointError("cannot " + what + " " + shown_path(path) + ": " + reason(error));
}

}  // namespace

std::string shown_path(const std::filesystem::path& path) {
  return quoted_file_name(path.native());
}

// ------------------------------------------------------------------------------------ File

File File::create(const std::filesystem::path& path, uint64_t total_bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", path, errno);
  return File(path, fd, total_bytes);
}

File File::open_for_reading(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. What is
  // opened is checked, not the name, so a rename in between cannot slip a FIFO past.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail("open", path, errno);
  File file(path, fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("stat", path, errno);
  if (!S_ISREG(st.st_mode))
    throw CheckpointError("cannot read " + shown_path(path) + ": it is " + file_kind(st.st_mode) +
                          ", not a regular file");
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) fail("open", path, errno);
  return file;
}

File::File(File&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      written_(other.written_),
      total_(other.total_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    written_ = other.written_;
    total_ = other.total_;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("stat", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

void File::write_all(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd_, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : EIO;
      // Counted against the whole file, not this call's part of it.
      const uint64_t written = written_ + done;
      const uint64_t total = std::max<uint64_t>(total_, written_ + bytes);
      throw CheckpointError("cannot write " + shown_path(path_) + ": " + reason(error) + " (" +
                            std::to_string(written) + " of " + std::to_string(total) +
                            " bytes written, " + std::to_string(total - written) + " more to go)");
    }
    done += static_cast<size_t>(n);
  }
  written_ += bytes;
}

void File::read_exactly_at(void* dst, size_t bytes, uint64_t offset) const {
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("read", path_, errno);
    if (n == 0)
      throw CheckpointError("cannot read " + shown_path(path_) + ": it ends at byte " +
                            std::to_string(offset + done) + ", expected " +
                            std::to_string(offset + bytes) + " (truncated while being read?)");
    done += static_cast<size_t>(n);
  }
}

void File::sync() {
  if (::fsync(fd_) != 0) fail("fsync", path_, errno);
}

void File::close() {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0) fail("close", path_, errno);
}

// --------------------------------------------------------------------------------- Folders

void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open folder", dir, errno);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) fail("fsync folder", dir, error);
}

void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw CheckpointError("cannot rename " + shown_path(from) + " to " + shown_path(to) + ": " +
                          reason(errno));
}

void write_file_atomically(const std::filesystem::path& path, std::string_view content) {
  std::filesystem::path temp = path;
  temp += ".tmp";
  File file = File::create(temp, content.size());
  file.write_all(content.data(), content.size());
  file.sync();
  file.close();
  rename_path(temp, path);
  sync_directory(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

void create_checkpoint_folder(const std::filesystem::path& dir) {
  // The system would say only "Invalid argument" about ''.
  if (dir.empty()) throw CheckpointError("no checkpoint folder was given: its path is empty");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!ec && std::filesystem::is_directory(dir)) return;
  // A link to nothing, of which the system says "File exists", or a file in the way.
  const std::string why = why_not_found((dir / "").string());
  if (!why.empty())
    throw CheckpointError("cannot create checkpoint folder " + shown_path(dir) + ": " + why);
  throw CheckpointError("cannot create checkpoint folder " + shown_path(dir) + ": " +
                        (ec ? ec.message() : "it is not a folder"));
}

std::string read_small_file(const std::filesystem::path& path, uint64_t max_bytes) {
  File file = File::open_for_reading(path);
  const uint64_t size = file.size();
  if (size > max_bytes)
    throw CheckpointError(shown_path(path) + " is " + std::to_string(size) +
                          " bytes, more than the " + std::to_string(max_bytes) +
                          " this file may have: it is not what it should be");
  std::string content(size, '\0');
  file.read_exactly_at(content.data(), content.size(), 0);
  return content;
}

// -------------------------------------------------------------------------------- Checksums

uint64_t xxh3_64(const void* data, size_t bytes) {
  return static_cast<uint64_t>(XXH3_64bits(data, bytes));
}

struct Xxh3Stream::State {
  XXH3_state_t* state = nullptr;
};

Xxh3Stream::Xxh3Stream() : state_(std::make_unique<State>()) {
  state_->state = XXH3_createState();
  if (state_->state == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(state_->state);
}

Xxh3Stream::~Xxh3Stream() {
  if (state_) XXH3_freeState(state_->state);
}

Xxh3Stream::Xxh3Stream(Xxh3Stream&&) noexcept = default;
Xxh3Stream& Xxh3Stream::operator=(Xxh3Stream&& other) noexcept {
  if (this != &other) {
    if (state_) XXH3_freeState(state_->state);
    state_ = std::move(other.state_);
  }
  return *this;
}

void Xxh3Stream::update(const void* data, size_t bytes) {
  XXH3_64bits_update(state_->state, data, bytes);
}

uint64_t Xxh3Stream::digest() const {
  return static_cast<uint64_t>(XXH3_64bits_digest(state_->state));
}

std::string hex64(uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) text[i] = kDigits[value & 0xf];
  return text;
}

namespace {
constexpr std::string_view kXxh3Prefix = "xxh3_64:";
}  // namespace

std::string xxh3_64_text(const void* data, size_t bytes) {
  return std::string(kXxh3Prefix) + hex64(xxh3_64(data, bytes));
}

bool is_xxh3_64_text(std::string_view text) {
  if (!text.starts_with(kXxh3Prefix)) return false;
  const std::string_view digits = text.substr(kXxh3Prefix.size());
  const std::optional<uint64_t> value = parse_hex64(digits);
  return value && hex64(*value) == digits;  // lowercase, as written
}

std::optional<uint64_t> parse_hex64(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t value = 0;
  for (char c : text) {
    int digit;
    if (c >= '0' && c <= '9')
      digit = c - '0';
    else if (c >= 'a' && c <= 'f')
      digit = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      digit = c - 'A' + 10;
    else
      return std::nullopt;
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  return value;
}

// ------------------------------------------------------------------------------------- JSON

std::string in_quotes(std::string_view text) {
  constexpr size_t kMax = 160;
  std::string out = "'";
  for (char c : text.substr(0, kMax)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte != 0x7f) {
      out += c;
    } else {  // control characters of a corrupt file would garble the terminal
      static constexpr char kDigits[] = "0123456789abcdef";
      out.append("\\x").append(1, kDigits[byte >> 4]).append(1, kDigits[byte & 0xf]);
    }
  }
  if (text.size() <= kMax) return out.append("'");
  return out.append("...' (").append(std::to_string(text.size())).append(" characters)");
}

nlohmann::json parse_json_strictly(std::string_view text, const std::string& file, int max_depth) {
  using nlohmann::json;
  // The parser takes a NUL byte for the end of the input, so whatever follows one would pass
  // unread; JSON text never holds one (a string spells it \u0000).
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw CheckpointError(file + ": a NUL byte at byte " + std::to_string(nul) +
                          " of its JSON, which JSON text never holds: the file is corrupt");
  // One set of keys per object being parsed, innermost last.
  std::vector<std::unordered_set<std::string>> open_objects;
  auto check = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > max_depth)
      throw CheckpointError(file + ": JSON nested deeper than " + std::to_string(max_depth) +
                            " levels: not a checkpoint file");
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open_objects.back().insert(key).second)
          throw CheckpointError(file + ": JSON key " + in_quotes(key) +
                                " appears twice in one object; a checkpoint never repeats a key");
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), check, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    // The parser quotes the token it choked on, which in a corrupt file may be huge.
    std::string detail = e.what();
    if (detail.size() > 300) detail = detail.substr(0, 300) + "...";
    throw CheckpointError(file + ": malformed JSON (" + detail + ")");
  }
}

void pause_for_crash_test(std::string_view point) {
  pause_if_asked("CONVEYOR_TEST_PAUSE_IN_SAVE", point, "in save at");
}

}  // namespace conveyor::checkpoint_io
