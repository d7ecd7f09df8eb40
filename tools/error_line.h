#pragma once
// The one line every failure of the command line ends with: "conveyor: error: ..." on stderr,
// said once for a launch of several processes that all refuse alike.
#include <optional>
#include <string>

namespace conveyor::cli {

// Flushes stdout; when that or an earlier write there failed, the sentence that says so:
// "cannot write stdout: " and the system's reason ("an earlier write failed" where it is
// gone). What a command printed there is its result, which a full disk or a closed pipe lost.
std::optional<std::string> stdout_write_error();

// The library's names of settings are shown as the flags that set them (in_flag_terms).
// Control characters in the message (echoed file names) are shown escaped, line breaks kept
// for the validator's grid that may follow the sentence. Backslashes pass as they are: many
// messages hold names escaped already, whose \t would otherwise print as \\t. What the
// command printed before goes out first, so that in one file or pipe the error comes last.
void print_error_line(const std::string& message);

// True, after a pause, in a process that is one of several of a launch (mpirun, srun) and not
// its first: there every process read the same command line, so the first most likely refuses
// alike and says why. The pause lets its line out first, and a launcher that ends the job once
// one process fails (mpirun) ends this one during it, silently, so the sentence appears once.
// A process that lives through the pause says its own (usage errors) or ends silently where
// every process is known to refuse alike. False at once in a plain process or the first.
bool waited_for_the_first_process();

// A usage error's line (exit status 2): after waited_for_the_first_process() until
// usage_errors_are_this_process_own() was called, at once after.
void print_usage_error_line(const std::string& message);

// From the call on, a usage error is this process's own and is printed at once: what fails
// once a run's ranks are connected may fail in one process alone (a shard of its own that is
// corrupt), and another process's error may point to it ("failed in the process of rank 1;
// its error says why"), so waiting would let the launcher end this process unheard. Until
// then, errors come from the command line and the files every process reads alike.
void usage_errors_are_this_process_own();

}  // namespace conveyor::cli
