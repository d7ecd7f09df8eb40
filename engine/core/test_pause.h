#pragma once
// Failure tests only: a process stops for good at a named point of its run, so that a test
// can kill it there or watch the other processes end by themselves.
#include <string_view>

namespace conveyor {

// When the environment variable `variable` equals `point`, prints
// "conveyor: paused <where> <point>" on stderr and waits there until the process is killed;
// otherwise does nothing.
void pause_if_asked(const char* variable, std::string_view point, std::string_view where);

}  // namespace conveyor
