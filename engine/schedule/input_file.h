#pragma once
// Reading a file a user named (a data file, a schedule file, a plan file): the checks every
// such reader makes before it trusts the bytes, written once. It lives in the schedule layer
// because that is the one layer the schedule loader, the trainer's data source and the
// command line may all include (engine/schedule includes only itself); nothing in it is
// about schedules.
#include <sys/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace conveyor {

// How a reader names its file and what it expects of it, for its messages.
struct InputFileRules {
  // The file as messages name it, e.g. "data file 'corpus.txt'" (with any escaping done).
  std::string shown;
  // What to give instead of a directory or a device, e.g. "a regular file whose bytes are the
  // text".
  std::string expected;
  // The most bytes read; a larger file is refused before it is read.
  uint64_t max_bytes = 0;
  // Ends the sentence refusing a larger file, after "at most N MiB", e.g. "are read into
  // memory".
  std::string over_the_limit;
};

// A file that cannot be used as input; an invalid_argument, as any bad input to the engine.
class InputFileError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The whole of the file at `path`, once it has passed every check: it exists; it is a regular
// file (a directory, and a device, FIFO or socket, are refused by name: a device would be
// read without end, a FIFO wait for a writer); it has at most `rules.max_bytes` bytes (files
// whose size the kernel does not report, such as those of /proc, are read up to that limit);
// it can be opened and read. What is opened is what is checked, so a rename in between
// cannot slip a FIFO past. Throws InputFileError with one sentence naming the file as
// `rules.shown` does.
std::string read_input_file(const std::string& path, const InputFileRules& rules);

// What a file of type `mode` (a stat's st_mode) is, for a message: "a file", "a directory",
// "a FIFO (named pipe)", "a character device", "a block device", "a socket", else "a special
// file".
std::string file_kind(mode_t mode);

// Why `path`, which the system did not find (ENOENT or ENOTDIR), is not there, when more can
// be said than that a name is missing: "'a/link' is a symbolic link to 'gone', which does not
// exist", or "'a/file' is a file, not a folder" for a file where the path goes on (a path
// ending in '/' goes on after its last name, which must then be a folder too). Empty when a
// name along the path is simply absent, or the path is there after all. Each component is
// looked at by name, so a link is followed only where the path goes through it.
std::string why_not_found(const std::string& path);

// `text` taken from a user (a file name, a flag's value) made safe for one message line: a
// line break, a tab, other control characters and bytes past ASCII as \n, \t and \xHH, a
// backslash doubled. A file name may hold any of them; the message must stay one line.
std::string escaped_for_message(std::string_view text);

// `text` read back from a file that Conveyor wrote (a checkpoint's data source, tensor names,
// schedule name), escaped as escaped_for_message does but with each backslash kept as it is:
// a description that names a file was escaped when written, and escaping it again would show
// it, and compare it, as another text.
std::string escaped_keeping_backslashes(std::string_view text);

// The start of `text` for a message: text of up to 40 bytes whole, longer text cut to its
// first 37 and "...", as a token or a line of a file may be megabytes long. Not escaped.
std::string message_excerpt(std::string_view text);

// `path` escaped as escaped_for_message does, between single quotes.
std::string quoted_file_name(std::string_view path);

}  // namespace conveyor
