// The `conveyor` command line: `train`, `schedule`, ... Each subcommand registers itself with
// CLI11 and runs from its callback; errors end here as one line and a non-zero exit.
#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/core/version.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/error_line.h"
#include "tools/interrupt.h"
#include "tools/parse_errors.h"

using conveyor::cli::print_error_line;
using conveyor::cli::print_usage_error_line;

namespace {

// A standard stream closed by the caller (`>&-`) leaves its descriptor free, and the first
// file the command opens (the --log-json file, a checkpoint's shard) would take it: every
// line printed would then go into that file. /dev/null stands in for the closed stream, so
// what is printed there is dropped, as closing it asked. Returns the system's reason when
// /dev/null cannot be opened, empty otherwise.
std::string open_closed_standard_streams() {
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    // The lowest free descriptor: this one, as those below it are open.
    const int opened = ::open("/dev/null", fd == STDIN_FILENO ? O_RDONLY : O_WRONLY);
    if (opened == fd) continue;
    const std::string why = opened < 0 ? std::strerror(errno) : "it did not open as that stream";
    if (opened >= 0) ::close(opened);
    return why;
  }
  return "";
}

// The stack every thread gets at least: the kernels' matrix products keep blocks of up to
// 128 KiB on the stack (Eigen), which a small `ulimit -s` (the default size of new threads,
// and the main thread's limit) turned into a segmentation fault mid-step. 8 MiB is Linux's
// usual limit.
constexpr size_t kThreadStackBytes = size_t{8} << 20;

// Gives the threads made from now on kThreadStackBytes at least, and raises the main
// thread's limit to it as far as the hard limit lets it. False when the main thread's stack
// stays smaller.
bool make_room_on_the_stacks() {
  pthread_attr_t attr;
  if (::pthread_getattr_default_np(&attr) == 0) {
    size_t bytes = 0;
    if (::pthread_attr_getstacksize(&attr, &bytes) == 0 && bytes < kThreadStackBytes &&
        ::pthread_attr_setstacksize(&attr, kThreadStackBytes) == 0)
      ::pthread_setattr_default_np(&attr);
    ::pthread_attr_destroy(&attr);
  }
  rlimit stack{};
  if (::getrlimit(RLIMIT_STACK, &stack) != 0 || stack.rlim_cur == RLIM_INFINITY ||
      stack.rlim_cur >= kThreadStackBytes)
    return true;
  if (stack.rlim_max != RLIM_INFINITY && stack.rlim_max < kThreadStackBytes) return false;
  stack.rlim_cur = kThreadStackBytes;
  return ::setrlimit(RLIMIT_STACK, &stack) == 0;
}

// The status of a command that did its work: what it printed is its result (a schedule, a
// plan, a run's numbers, its help), and lost on a full disk or device it is a failed output,
// not a success the caller cannot tell apart.
int stdout_status() {
  const std::optional<std::string> error = conveyor::cli::stdout_write_error();
  if (!error) return conveyor::cli::kExitOk;
  // A reader gone after a run's last step, too late to stop it: the end of
  // `conveyor train ... | head`, as a SIGPIPE during the run ends it, without the error of a
  // full disk.
  if (conveyor::cli::interrupt_signal() == SIGPIPE)
    return conveyor::cli::kExitInterrupted + SIGPIPE;
  print_error_line(*error + "; what the command printed there is incomplete");
  return conveyor::cli::kExitFailure;
}

int run_command(int argc, char** argv) {
  // Before any file is opened: none may take the descriptor of a closed stdout or stderr.
  if (const std::string why = open_closed_standard_streams(); !why.empty()) {
    print_error_line(
        "a standard stream (stdin, stdout or stderr) is closed, and '/dev/null' "
        "cannot stand in for it: " +
        why);
    return conveyor::cli::kExitFailure;
  }
  // Before any command makes a file: an interrupt removes the temporaries of output files.
  conveyor::cli::install_cleanup_handlers();
  // A write past the file size limit (ulimit -f) then fails with EFBIG, which the writer of a
  // checkpoint or an output file reports naming the file, instead of killing the process
  // without a word (and, under mpirun, the job with it).
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"Conveyor: pipeline-parallel training engine"};
  app.set_version_flag("--version", conveyor::version());
  app.require_subcommand(1);
  app.footer(std::string("Example: conveyor train --stages 2 --steps 50\n") +
             conveyor::cli::kExitStatusText);
  conveyor::cli::register_commands(app);
  // CLI11 would only say "A subcommand is required"; name the word it did not know, at the
  // top (`conveyor trian`) and under a command of subcommands (`conveyor ckpt verfy`).
  // The top level's own flags may come first (`conveyor --version train --bogus`): the
  // command that did not take a word is still `conveyor train`.
  CLI::App* level = &app;
  int i = 1;
  const auto top_level_flag = [&](const std::string& word) {
    return level == &app && (word == "--version" || word == "--help" || word == "-h");
  };
  for (; i < argc && !level->get_subcommands({}).empty(); ++i) {
    if (top_level_flag(argv[i])) continue;
    if (argv[i][0] == '-') break;
    CLI::App* found = nullptr;
    for (CLI::App* sub : level->get_subcommands({}))
      if (sub->get_name() == argv[i]) found = sub;
    if (found == nullptr) {
      const std::string of = level == &app ? "" : level->get_name() + " ";
      print_usage_error_line("unknown " + of + "subcommand '" +
                             conveyor::escaped_for_message(argv[i]) +
                             "', expected one of: " + conveyor::cli::offered_subcommands(*level));
      return conveyor::cli::kExitUsage;
    }
    level = found;
  }
  std::vector<std::string> words(argv, argv + argc);
  conveyor::cli::mark_empty_switch_values(*level, words, static_cast<size_t>(i));
  std::vector<const char*> marked;
  for (const std::string& word : words) marked.push_back(word.c_str());
  try {
    app.parse(argc, marked.data());
  } catch (const CLI::ParseError& e) {
    // Help and version are CLI11's to print (exit 0); its parse errors (an unknown flag, a
    // missing value or argument) get the one line every other error gets. CLI11 stops for
    // help and version before it looks for words it did not take: `--help --bogus` is
    // refused as `--bogus` alone is, rather than passing a typo by unseen.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success) &&
        app.remaining(true).empty()) {
      const int status = app.exit(e);
      return status == conveyor::cli::kExitOk ? stdout_status() : status;
    }
    print_usage_error_line(conveyor::cli::parse_error_sentence(
        e, app, *level, std::vector<std::string>(argv + i, argv + argc)));
    return conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::ExitRequest& e) {
    return e.code;
  } catch (const std::bad_alloc& e) {
    // Commands that know where they were say so themselves (train: building the model, a
    // training step); one that reaches here may have failed at any point of its work.
    print_error_line(conveyor::error_sentence(e) + "; use smaller sizes or free some memory");
    return conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::ErrorOfEveryProcess& e) {
    if (!conveyor::cli::waited_for_the_first_process()) print_error_line(e.what());
    return e.status();
  } catch (const conveyor::cli::UsageError& e) {
    print_usage_error_line(e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::invalid_argument& e) {
    print_usage_error_line(e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::exception& e) {
    print_error_line(e.what());
    return conveyor::cli::kExitFailure;
  }
  return stdout_status();
}

}  // namespace

int main(int argc, char** argv) {
  // Under a hard stack limit below the kernels' needs, the command runs on a thread of its own,
  // whose stack is not bound by that limit.
  if (make_room_on_the_stacks()) return run_command(argc, argv);
  int status = conveyor::cli::kExitFailure;
  std::thread([&] { status = run_command(argc, argv); }).join();
  return status;
}
