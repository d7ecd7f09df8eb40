#include "tools/interrupt.h"

#include <csignal>

namespace conveyor::cli {
namespace {

volatile std::sig_atomic_t received = 0;

extern "C" void record_signal(int signal) {
  if (received == 0) received = signal;
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_RESETHAND;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int interrupt_signal() { return received; }

}  // namespace conveyor::cli
