// poll_until: asks until done, gives up after the deadline, never misses work finished by it.
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

}  // namespace
}  // namespace conveyor::comm
