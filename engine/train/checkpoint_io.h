#pragma once
// File handling for checkpoints: writes and reads that either complete or throw a
// CheckpointError naming the file and the system's reason, fsync of files and folders,
// atomic replacement of small files, XXH3-64 checksums (libxxhash), and a JSON parser that
// rejects what nlohmann::json would silently accept (duplicate keys, absurd nesting).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace conveyor::checkpoint_io {

// An open file descriptor, closed on destruction.
class File {
 public:
  // For writing: created, or truncated if it exists. `total_bytes`: the size the file has once
  // written whole, against which a failed write counts what was written and what was left.
  static File create(const std::filesystem::path& path, uint64_t total_bytes);
  // For reading a regular file; anything else (a FIFO, a device, a folder) is refused at once
  // with a CheckpointError naming it, rather than blocking or reading forever.
  static File open_for_reading(const std::filesystem::path& path);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();  // closes, ignoring errors: call close() to see them

  const std::filesystem::path& path() const { return path_; }
  uint64_t size() const;
  // Writes all `bytes` at the current position (partial writes are continued; EINTR retried).
  void write_all(const void* data, size_t bytes);
  // Reads exactly `bytes` at `offset`; a short read (the file shrank) throws. Thread-safe.
  void read_exactly_at(void* dst, size_t bytes, uint64_t offset) const;
  void sync();   // fsync: the data is on the device
  void close();  // reports a failing close (NFS reports write errors there)

 private:
  File(std::filesystem::path path, int fd, uint64_t total_bytes = 0)
      : path_(std::move(path)), fd_(fd), total_(total_bytes) {}
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t written_ = 0;  // bytes written so far, for error messages
  uint64_t total_ = 0;    // the whole file's size, for error messages
};

// Makes the checkpoint folder `dir` and those above it as needed. Throws a CheckpointError
// naming the file that stands where a folder should be (the system says only "Not a
// directory"), or the system's reason.
void create_checkpoint_folder(const std::filesystem::path& dir);
// fsync of a folder, so that entries created, renamed or removed in it are durable.
void sync_directory(const std::filesystem::path& dir);
// Renames `from` to `to` (same file system), throwing a CheckpointError naming both.
void rename_path(const std::filesystem::path& from, const std::filesystem::path& to);
// Replaces `path` with `content` so that readers see the old or the new file, never a part:
// writes `path`.tmp, fsyncs it, renames it over `path`, fsyncs the folder.
void write_file_atomically(const std::filesystem::path& path, std::string_view content);
// The whole file, which must not be larger than `max_bytes`.
std::string read_small_file(const std::filesystem::path& path, uint64_t max_bytes);

// XXH3-64 (seed 0), the checksum of every tensor and of every shard file.
uint64_t xxh3_64(const void* data, size_t bytes);
// XXH3-64 of data given in pieces: the same value as xxh3_64 of their concatenation.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(Xxh3Stream&&) noexcept;
  Xxh3Stream& operator=(Xxh3Stream&&) noexcept;
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};
// 16 lowercase hex digits, and back (nullopt unless exactly 16 hex digits).
std::string hex64(uint64_t value);
std::optional<uint64_t> parse_hex64(std::string_view text);
// A digest as the manifest writes one: "xxh3_64:" and the hex64 of xxh3_64 over the bytes
// (the model fingerprint, a data file's contents); and whether `text` is one.
std::string xxh3_64_text(const void* data, size_t bytes);
bool is_xxh3_64_text(std::string_view text);

// `text` in single quotes for an error message, cut to a readable length and with control
// characters as \xNN (names read from a corrupt file may be megabytes of anything).
std::string in_quotes(std::string_view text);

// `path` as every checkpoint message names it: quoted, with a line break or another control
// character escaped (quoted_file_name), so that the message stays on one line.
std::string shown_path(const std::filesystem::path& path);

// Parses JSON `text` from `file`, throwing a CheckpointError naming the file for malformed
// JSON, a key that appears twice in one object, or nesting deeper than `max_depth`.
nlohmann::json parse_json_strictly(std::string_view text, const std::string& file,
                                   int max_depth = 64);

// Crash tests only: when the environment variable CONVEYOR_TEST_PAUSE_IN_SAVE equals `point`
// ("shard": a shard half written; "commit": the manifest written, the folder not yet renamed;
// with processes, "sizes": before they gather the shards' sizes and checksums, and "written":
// before they ask, after a step, whether every shard of an --async-save is written),
// says so on stderr and waits there until the process is killed. Otherwise does nothing.
void pause_for_crash_test(std::string_view point);

}  // namespace conveyor::checkpoint_io
