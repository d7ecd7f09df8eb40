// poll_until: asks until done, gives up after the deadline, never misses work finished at it.
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
  // Sleeps double from 20 µs to 1 ms: at least the first few asks fit before 30 ms.
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

TEST(Poll, WorkThatFinishesAfterTheLastSleepStillCounts) {
  // The answer turns true only once the deadline has passed: the ask after the last sleep
  // must see it.
  const auto deadline = PollClock::now() + 5ms;
  EXPECT_TRUE(poll_until(deadline, [&] { return PollClock::now() > deadline; }));
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
