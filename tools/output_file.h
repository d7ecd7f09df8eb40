#pragma once
// Output files of the command line, opened and checked before any work starts and written
// with every write checked, so a full disk or a bad path fails loudly instead of "wrote ...".
#include <string>

namespace conveyor::cli {

class OutputFile {
 public:
  OutputFile() = default;
  // Opens `path` for writing (created, truncated) on behalf of `flag` (named in errors).
  // With `lock`, takes an advisory lock (flock) on a regular file first, so a second run
  // writing the same file is refused instead of interleaving lines. Throws UsageError.
  OutputFile(const std::string& path, const std::string& flag, bool lock);
  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&& other) noexcept;
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // Writes all of `text` straight to the file (unbuffered: a line is on disk when this
  // returns). Throws std::runtime_error naming the file and the system's reason.
  void write(const std::string& text);
  // Closes the file, reporting a failed close as write() does.
  void close();

 private:
  std::string path_, flag_;
  int fd_ = -1;
};

}  // namespace conveyor::cli
