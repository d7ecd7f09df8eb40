#pragma once
// SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGPIPE and SIGXCPU: the signals that stop a command.
// SIGUSR1 is the one OpenMPI's mpirun passes on to every process at once; SIGINT, SIGTERM and
// SIGHUP to mpirun abort the job, whose processes are sent SIGTERM and killed a second later.
// SIGPIPE comes from a write to a pipe whose reader has gone (`| head`), SIGXCPU from the soft
// CPU time limit (`ulimit -t`). One the process started with ignored (nohup's SIGHUP) stays
// ignored, SIGINT excepted (a shell ignores it in the commands it starts with `&`).
//
// Every command: until a command takes the signals over, the handler main() installs removes
// the temporary files output files are written to (ReplacedFile), says in one line that the
// run was interrupted (after SIGPIPE only when it removed files), and ends the process by the
// signal (status 128 + signal), so that an interrupted `plan --out` or `schedule --trace` leaves
// its files as they were and no temporary beside them.
//
// During training: the handler only records the signal; every rank asks for it in the step's
// all-reduce (PipelineExecutor::set_stop_request), so the step in progress finishes on every
// rank and every process stops after the same step, the log is complete, and the run ends with
// a summary and exit status 128 + signal.
#include <string>

namespace conveyor::cli {

// Installs the handler that removes the registered temporary files and ends the process by
// the signal. Called once, in main(), before any command runs.
void install_cleanup_handlers();

// Registers `path`, a temporary file this process has just made, to be removed if one of the
// signals ends the process before it is unregistered. Returns the slot to unregister, or -1
// when the path is not held: longer than a slot takes, or every slot is in use (a command
// writes a few files at a time); such a file is then only removed by its owner.
int register_temporary_file(const std::string& path);
// Forgets the temporary of `slot` (-1: none), once it is renamed or removed.
void unregister_temporary_file(int slot);

// Replaces the handlers above by ones that only record the signal (restartable system calls;
// a second signal of the same kind ends the process at once, as without a handler, but for
// SIGPIPE and SIGXCPU, which come again by themselves).
void install_interrupt_handlers();
// The first signal received since install_interrupt_handlers, or 0.
int interrupt_signal();

// "SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGPIPE" or "SIGXCPU" (a string literal: safe in a
// signal handler).
const char* signal_name(int signal);

// How a stop by `signal` is said after "conveyor: " or at the run's end: "interrupted by
// SIGINT"; under a launcher SIGTERM is "stopped by SIGTERM", which the launcher sends when
// another process failed, but so may a scheduler, or anyone by kill: the handler does not
// know which, so the text names none (a string literal: safe in a signal handler). Whether
// the process is one of a launch of several is read once, by install_cleanup_handlers.
const char* stopped_by_text(int signal);
// True for SIGTERM under a launcher: said as a stop, not as an interruption by the user.
bool sigterm_under_a_launcher(int signal);

}  // namespace conveyor::cli
