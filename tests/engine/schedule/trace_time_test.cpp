// The grid of a Chrome trace's times: whole nanoseconds written as exact decimal
// microseconds, coarser only for times a nanosecond count cannot hold, never a time that is
// not a number.
#include "engine/schedule/trace_time.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>

namespace conveyor::schedule {
namespace {

TEST(TraceGrid, WritesWholeNanosecondsAsExactMicroseconds) {
  const TraceGrid grid;
  EXPECT_EQ(grid.text(0), "0");
  EXPECT_EQ(grid.text(1), "0.001");
  EXPECT_EQ(grid.text(-1), "-0.001");
  EXPECT_EQ(grid.text(1048575000), "1048575");
  EXPECT_EQ(grid.text(1048575125), "1048575.125");
  EXPECT_EQ(grid.text(2500), "2.5");
  EXPECT_EQ(grid.text(-2050), "-2.05");
  EXPECT_EQ(grid.text(int64_t{2251799813685247}), "2251799813685.247");  // 2^51 - 1
  // Floating-point noise of a sum rounds away: what ends at 1048575 is written to end there.
  EXPECT_EQ(grid.text(grid.ticks(1048574.999999999)), "1048575");
  EXPECT_EQ(grid.text(grid.ticks(0.1 + 0.2)), "0.3");
  EXPECT_EQ(grid.ticks(0.0004999), 0);
  EXPECT_EQ(grid.ticks(-1.0006), -1001);
}

// Whatever the time, its text reads back as its tick count in microseconds, and ticks keep
// the order of the times.
TEST(TraceGrid, TextReadsBackAsTheTickAndTicksKeepOrder) {
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<double> exponent(-4, 12.3);
  const TraceGrid grid(2.2e12);  // whole nanoseconds up to 2^51 of them
  for (int k = 0; k < 20000; ++k) {
    const double a = std::pow(10.0, exponent(rng)), b = std::nextafter(a, 2 * a);
    const int64_t ta = grid.ticks(a), tb = grid.ticks(b);
    EXPECT_LE(ta, tb) << a;
    EXPECT_EQ(std::llround(std::stod(grid.text(ta)) * 1000), ta) << grid.text(ta);
    EXPECT_EQ(std::llround(std::stod(grid.text(-tb)) * 1000), -tb) << grid.text(-tb);
  }
}

// Times past what a count of nanoseconds holds (a simulation's costs may be any size) go on
// the finest power-of-ten grid that holds them, exactly again.
TEST(TraceGrid, CoarsensForTimesBeyondNanosecondCounts) {
  const TraceGrid tens_of_ns(1e13);  // 1e16 ns > 2^51
  EXPECT_EQ(tens_of_ns.ticks(1e13), int64_t{1000000000000000});
  EXPECT_EQ(tens_of_ns.text(tens_of_ns.ticks(1e13)), "10000000000000");
  EXPECT_EQ(tens_of_ns.text(tens_of_ns.ticks(299.5234)), "299.52");
  const TraceGrid tens_of_us(1e16);
  EXPECT_EQ(tens_of_us.text(tens_of_us.ticks(1e16)), "1e16");
  EXPECT_EQ(tens_of_us.text(tens_of_us.ticks(299.5234)), "3e2");
  EXPECT_EQ(tens_of_us.text(tens_of_us.ticks(-2345.6)), "-235e1");
  // Beyond 2^53 a power of ten is itself rounded: the text is the tick count times the power
  // of ten, within a relative 1e-15 of the time, trailing zeros moved into the exponent.
  for (const double largest : {1e203, 1e307}) {
    const TraceGrid huge(largest);
    for (const double us : {largest, 3e201, -2e202, 1.2345e200, 1.0}) {
      const std::string text = huge.text(huge.ticks(us));
      EXPECT_TRUE(text == "0" || text.back() != '0') << text;
      EXPECT_NEAR(std::strtod(text.c_str(), nullptr), us, 1e-15 * largest) << text;
    }
  }
}

TEST(TraceGrid, RefusesTimesThatAreNotNumbersOrBeyondItsRange) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THROW(TraceGrid{inf}, std::invalid_argument);
  EXPECT_THROW(TraceGrid{std::nan("")}, std::invalid_argument);
  const TraceGrid grid(1e6);
  EXPECT_THROW(grid.ticks(std::nan("")), std::invalid_argument);
  EXPECT_THROW(grid.ticks(-inf), std::invalid_argument);
  EXPECT_THROW(grid.ticks(1e13), std::invalid_argument);  // past 2^51 ns
}

}  // namespace
}  // namespace conveyor::schedule
