#include "tools/interrupt.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "comm/launch_environment.h"

namespace conveyor::cli {
namespace {

volatile std::sig_atomic_t received = 0;

// One process of a launch of several (mpirun, srun), read before any handler is installed.
bool under_a_launcher = false;

// The signals that stop a command: Ctrl-C, kill's default, a closed terminal, SIGUSR1,
// which OpenMPI's mpirun passes on to every process at once (it turns SIGINT, SIGTERM and
// SIGHUP into an abort of the job that kills the processes a second later), SIGPIPE, a
// write to a pipe whose reader has gone (`conveyor train ... | head`), and SIGXCPU, the soft
// CPU time limit reached (`ulimit -t`, a batch system's warning before its hard limit's
// SIGKILL): each one's default would end a run without its save and leave the temporaries
// of output files behind.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGPIPE, SIGXCPU};

// The stop signals the process started with ignored, which stay so: nohup's SIGHUP asks the
// run to outlive its terminal. Not SIGINT, which a shell without job control ignores in every
// command it starts with `&`, against the terminal's Ctrl-C, and which scripts still send to
// such a run to stop it.
bool ignored_at_start[std::size(kStopSignals)] = {};

extern "C" void record_signal(int signal) {
  if (received == 0) received = signal;
}

// The temporaries a signal removes, in fixed storage: a handler may not allocate or lock. A
// slot is free (0), being filled or emptied by its owner (1), or holds a path (2); the handler
// reads only slots that hold one.
constexpr int kTemporarySlots = 16;
constexpr size_t kTemporaryPathBytes = 4096;  // PATH_MAX on Linux, with its terminating zero
struct TemporarySlot {
  std::atomic<int> state{0};
  char path[kTemporaryPathBytes];
};
TemporarySlot temporaries[kTemporarySlots];
static_assert(std::atomic<int>::is_always_lock_free, "the handler reads the slots' states");

void write_text(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n <= 0) return;  // nothing to be done about an unwritable stderr here
    text += n;
    left -= static_cast<size_t>(n);
  }
}

// Only async-signal-safe calls: unlink, write, sigaction, raise.
extern "C" void remove_temporaries_and_end(int signal) {
  const int saved_errno = errno;
  int removed = 0;
  for (TemporarySlot& slot : temporaries)
    if (slot.state.load() == 2 && ::unlink(slot.path) == 0) ++removed;
  // A reader that went away is the usual end of `conveyor schedule | head`: said only when
  // there is something to say about files.
  if (signal != SIGPIPE || removed > 0) {
    write_text("conveyor: ");
    write_text(stopped_by_text(signal));
    write_text(removed > 0 ? "; the unfinished output files were removed, the files they were "
                             "to replace left as they were\n"
                           : "\n");
  }
  // Ended by the signal itself, as without a handler: the parent sees a process killed by it
  // (a shell: status 128 + signal). Pending until the handler returns, if blocked here.
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  sigaction(signal, &action, nullptr);
  std::raise(signal);
  errno = saved_errno;
}

void install(void (*handler)(int), int flags, bool one_at_a_time) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  if (one_at_a_time)
    for (const int signal : kStopSignals) sigaddset(&action.sa_mask, signal);
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    if (ignored_at_start[i]) continue;
    // A run's own writes to the closed pipe raise SIGPIPE again until it ends, and the kernel
    // sends SIGXCPU again every second of CPU time past the soft limit: neither may end the
    // run before its save.
    const bool repeated = kStopSignals[i] == SIGPIPE || kStopSignals[i] == SIGXCPU;
    action.sa_flags = repeated ? flags & ~SA_RESETHAND : flags;
    sigaction(kStopSignals[i], &action, nullptr);
  }
}

}  // namespace

const char* signal_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGXCPU:
      return "SIGXCPU";
  }
  return "a signal";
}

bool sigterm_under_a_launcher(int signal) { return signal == SIGTERM && under_a_launcher; }

const char* stopped_by_text(int signal) {
  if (sigterm_under_a_launcher(signal)) return "stopped by SIGTERM";
  switch (signal) {
    case SIGINT:
      return "interrupted by SIGINT";
    case SIGTERM:
      return "interrupted by SIGTERM";
    case SIGHUP:
      return "interrupted by SIGHUP";
    case SIGUSR1:
      return "interrupted by SIGUSR1";
    case SIGPIPE:
      return "stopped by SIGPIPE, its output having been closed";
    case SIGXCPU:
      return "stopped by SIGXCPU, its CPU time limit (ulimit -t) reached";
  }
  return "interrupted by a signal";
}

void install_cleanup_handlers() {
  try {
    under_a_launcher = comm::launched_process_count() > 1;
  } catch (const std::invalid_argument&) {  // a damaged launcher variable, refused later
    under_a_launcher = false;
  }
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    struct sigaction current {};
    ignored_at_start[i] = kStopSignals[i] != SIGINT &&
                          sigaction(kStopSignals[i], nullptr, &current) == 0 &&
                          current.sa_handler == SIG_IGN;
  }
  // One handler at a time: a second signal waits while the first's removes the files.
  install(remove_temporaries_and_end, SA_RESTART, true);
}

int register_temporary_file(const std::string& path) {
  if (path.size() >= kTemporaryPathBytes) return -1;
  for (int i = 0; i < kTemporarySlots; ++i) {
    int free = 0;
    if (!temporaries[i].state.compare_exchange_strong(free, 1)) continue;
    std::memcpy(temporaries[i].path, path.c_str(), path.size() + 1);
    temporaries[i].state.store(2);
    return i;
  }
  return -1;
}

void unregister_temporary_file(int slot) {
  if (slot >= 0 && slot < kTemporarySlots) temporaries[slot].state.store(0);
}

void install_interrupt_handlers() { install(record_signal, SA_RESTART | SA_RESETHAND, false); }

int interrupt_signal() { return received; }

}  // namespace conveyor::cli
