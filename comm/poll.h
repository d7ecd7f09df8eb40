#pragma once
// Waiting on work that someone else finishes (a device's stream, NCCL's own threads, an MPI
// request) without blocking in it: ask, pause a little, ask again, until it is done or the
// deadline has passed. A wait that blocked inside the library could not be bounded, and a
// rank whose peer is gone would hang there.
#include <algorithm>
#include <chrono>
#include <thread>

namespace conveyor::comm {

using PollClock = std::chrono::steady_clock;

// Calls `done()` until it returns true, and returns true then; returns false once `deadline`
// has passed with `done()` still false. The clock is read before each ask, so the last ask
// always comes after the deadline was seen to pass: work finished by the deadline is never
// missed (and `done()` is asked at least once). For the first 50 µs the asks follow each
// other, yielding the core between them (most of what is waited for here is done within
// tens of microseconds); then the pauses are sleeps from 20 µs doubling up to 1 ms, so a
// long wait costs a thousand wake-ups a second. Whatever `done()` throws goes to the caller.
template <class Done>
bool poll_until(PollClock::time_point deadline, Done&& done) {
  const auto spin_until = PollClock::now() + std::chrono::microseconds(50);
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    const auto now = PollClock::now();
    const bool late = now > deadline;
    if (done()) return true;
    if (late) return false;
    if (now < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

// A wait's deadline that counts only the time this process was there to wait. Between two
// looks more than kAway apart the process was not running (stopped by SIGSTOP or a debugger,
// or not scheduled), and the deadline moves on by that gap: a process that comes back from a
// stop longer than the timeout looks again before it gives up on the peer it waited for,
// whose message may be there, or whose notice that it gave up on this process, which is the
// one that failed. A peer that never answers still fails the wait after `timeout` of this
// process's own time.
class WaitDeadline {
 public:
  static constexpr std::chrono::milliseconds kAway{100};

  explicit WaitDeadline(std::chrono::milliseconds timeout,
                        PollClock::time_point now = PollClock::now())
      : deadline_(now + timeout), last_look_(now) {}

  // Whether the deadline has passed at `now`, after moving it on by a gap since the last look.
  bool passed(PollClock::time_point now = PollClock::now()) {
    if (now - last_look_ > kAway) deadline_ += now - last_look_;
    last_look_ = std::max(last_look_, now);
    return now >= deadline_;
  }

 private:
  PollClock::time_point deadline_;
  PollClock::time_point last_look_;
};

}  // namespace conveyor::comm
