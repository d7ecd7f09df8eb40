#include "tools/error_line.h"

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "comm/launch_environment.h"
#include "engine/schedule/input_file.h"  // escaped_for_message
#include "tools/flag_terms.h"

namespace conveyor::cli {

std::optional<std::string> stdout_write_error() {
  errno = 0;
  if (std::fflush(stdout) == 0 && std::ferror(stdout) == 0) return std::nullopt;
  return std::string("cannot write stdout: ") +
         (errno != 0 ? std::strerror(errno) : "an earlier write failed");
}
namespace {

// Longer than a launcher takes to end a job once a process failed (milliseconds for mpirun)
// and than the processes of one launch take to start apart on a busy machine.
constexpr std::chrono::seconds kPauseForTheFirstProcess{2};

bool errors_are_own = false;

bool one_of_several_but_not_the_first() {
  try {
    return comm::launched_process_count() > 1 && comm::launched_process_rank() != 0;
  } catch (const std::invalid_argument&) {  // a damaged launcher variable, refused elsewhere
    return false;
  }
}

}  // namespace

void print_error_line(const std::string& message) {
  std::fflush(stdout);
  std::string text;
  for (const char c : in_flag_terms(message))
    text += c == '\n' || c == '\\' ? std::string(1, c) : escaped_for_message(std::string(1, c));
  std::fprintf(stderr, "conveyor: error: %s\n", text.c_str());
}

bool waited_for_the_first_process() {
  if (!one_of_several_but_not_the_first()) return false;
  std::fflush(stdout);
  // Ended by the launcher during the pause: as by the signal, without the interrupted line
  // (no output file is unfinished by now: their owners removed them on the way out).
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGHUP, SIG_DFL);
  std::signal(SIGUSR1, SIG_DFL);
  std::this_thread::sleep_for(kPauseForTheFirstProcess);
  return true;
}

void print_usage_error_line(const std::string& message) {
  if (!errors_are_own) waited_for_the_first_process();
  print_error_line(message);
}

void usage_errors_are_this_process_own() { errors_are_own = true; }

}  // namespace conveyor::cli
