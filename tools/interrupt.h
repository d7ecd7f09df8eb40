#pragma once
// SIGINT and SIGTERM during training: the handler only records the signal; every rank asks
// for it in the step's all-reduce (PipelineExecutor::set_stop_request), so the step in
// progress finishes on every rank and every process stops after the same step, the log is
// complete, and the run ends with a summary and exit status 128 + signal.
namespace conveyor::cli {

// Installs the handlers (restartable system calls; a second signal of the same kind ends the
// process at once, as without a handler).
void install_interrupt_handlers();
// The first signal received since install, or 0.
int interrupt_signal();

}  // namespace conveyor::cli
