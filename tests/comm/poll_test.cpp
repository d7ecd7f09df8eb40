// poll_until: asks until done, gives up after the deadline, never misses work finished by it.
// WaitDeadline: counts only the time the process was there to wait.
#include "comm/poll.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

TEST(Poll, ReturnsAtTheFirstAskThatSaysDone) {
  int asks = 0;
  EXPECT_TRUE(poll_until(PollClock::now() + 10s, [&] { return ++asks == 5; }));
  EXPECT_EQ(asks, 5);
}

TEST(Poll, WorkDoneAtOnceIsAskedOnce) {
  int asks = 0;
  EXPECT_TRUE(poll_until(PollClock::now() + 10s, [&] { return ++asks > 0; }));
  EXPECT_EQ(asks, 1);
}

TEST(Poll, GivesUpOnceTheDeadlineHasPassed) {
  int asks = 0;
  const auto start = PollClock::now();
  EXPECT_FALSE(poll_until(start + 30ms, [&] {
    ++asks;
    return false;
  }));
  EXPECT_GE(PollClock::now() - start, 30ms);
  // Asks follow each other for 50 µs, then sleeps double from 20 µs to 1 ms: many asks fit.
  EXPECT_GE(asks, 5);
}

TEST(Poll, AsksOnceEvenWhenTheDeadlineHasAlreadyPassed) {
  int asks = 0;
  EXPECT_FALSE(poll_until(PollClock::now() - 1s, [&] {
    ++asks;
    return false;
  }));
  EXPECT_EQ(asks, 1);
  EXPECT_TRUE(poll_until(PollClock::now() - 1s, [] { return true; }));
}

TEST(Poll, WorkFinishedByTheDeadlineIsNeverMissed) {
  // The answer turns true exactly as the deadline passes: the clock is read before each ask,
  // so the ask that follows the reading that saw the deadline pass sees it true.
  for (const auto wait : {0ms, 1ms, 5ms}) {
    const auto deadline = PollClock::now() + wait;
    EXPECT_TRUE(poll_until(deadline, [&] { return PollClock::now() > deadline; }));
  }
}

TEST(Poll, WhatTheQuestionThrowsReachesTheCaller) {
  int asks = 0;
  EXPECT_THROW(poll_until(PollClock::now() + 10s,
                          [&]() -> bool {
                            if (++asks == 3) throw std::runtime_error("peer gone");
                            return false;
                          }),
               std::runtime_error);
  EXPECT_EQ(asks, 3);
}

TEST(WaitDeadline, PassesAfterTheTimeoutOfLooksCloseTogether) {
  const auto start = PollClock::now();
  WaitDeadline deadline(3s, start);
  // Looks 50 ms apart, closer than WaitDeadline::kAway: every moment counts.
  auto t = start;
  for (; t < start + 3s; t += 50ms) EXPECT_FALSE(deadline.passed(t)) << (t - start).count();
  EXPECT_TRUE(deadline.passed(t));
}

TEST(WaitDeadline, TimeBetweenLooksFarApartDoesNotCount) {
  // A process stopped (SIGSTOP) for 10 s in a wait of 3 s: when it looks again, it has
  // waited 1 s of its own, and the peer's message or notice has 2 s more to be seen.
  const auto start = PollClock::now();
  WaitDeadline deadline(3s, start);
  for (auto t = start; t <= start + 1s; t += 50ms) EXPECT_FALSE(deadline.passed(t));
  EXPECT_FALSE(deadline.passed(start + 11s));
  auto t = start + 11s;
  for (; t < start + 13s; t += 50ms) EXPECT_FALSE(deadline.passed(t)) << (t - start).count();
  EXPECT_TRUE(deadline.passed(t));
}

TEST(WaitDeadline, ALookAtAnEarlierTimeMovesNothing) {
  const auto start = PollClock::now();
  WaitDeadline deadline(100ms, start);
  EXPECT_FALSE(deadline.passed(start + 60ms));
  EXPECT_FALSE(deadline.passed(start + 10ms));  // another thread's older reading
  EXPECT_TRUE(deadline.passed(start + 110ms));
}

}  // namespace
}  // namespace conveyor::comm
