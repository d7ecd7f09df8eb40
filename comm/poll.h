#pragma once
// Waiting on work that someone else finishes (a device's stream, NCCL's own threads, an MPI
// request) without blocking in it: ask, sleep a little, ask again, until it is done or the
// deadline has passed. A wait that blocked inside the library could not be bounded, and a
// rank whose peer is gone would hang there.
#include <algorithm>
#include <chrono>
#include <thread>

namespace conveyor::comm {

using PollClock = std::chrono::steady_clock;

// Calls `done()` until it returns true, and returns true then; returns false once `deadline`
// has passed with `done()` still false (it is always asked at least once, and once more
// after the deadline's last sleep, so work finished just in time is not missed). The sleeps
// start at 20 µs and double up to 1 ms: a short wait costs microseconds, a long one a
// thousand wake-ups a second. Whatever `done()` throws goes to the caller.
template <class Done>
bool poll_until(PollClock::time_point deadline, Done&& done) {
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    if (done()) return true;
    if (PollClock::now() > deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace conveyor::comm
