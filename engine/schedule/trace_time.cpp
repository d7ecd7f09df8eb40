#include "engine/schedule/trace_time.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace conveyor::schedule {
namespace {

// Tick counts stay below this: a reader that takes a time as a double in microseconds gets a
// count of nanoseconds back exactly (Perfetto multiplies by 1000 and rounds), and an end minus
// a start never overflows. 2^51 ns is 26 days.
constexpr double kLargestTicks = 0x1p51;

double power_of_ten(int exponent) { return std::pow(10.0, exponent); }

// `us` in ticks of 10^exponent microseconds, unrounded: a multiplication by an exact 10, 100
// or 1000 where the tick is finer than a microsecond.
double scaled(double us, int exponent) {
  return exponent < 0 ? us * power_of_ten(-exponent) : us / power_of_ten(exponent);
}

std::string time_text(double us) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, us).ptr;
  return std::string(buf, end);
}

}  // namespace

TraceGrid::TraceGrid(double largest_us) {
  if (!std::isfinite(largest_us))
    throw std::invalid_argument("a trace's times must be finite numbers, got " +
                                time_text(largest_us) + " us");
  while (std::fabs(scaled(largest_us, exponent_)) >= kLargestTicks) ++exponent_;
}

int64_t TraceGrid::ticks(double us) const {
  const double t = std::nearbyint(scaled(us, exponent_));
  if (!(std::fabs(t) < kLargestTicks))
    throw std::invalid_argument("a trace's time of " + time_text(us) +
                                " us is not a finite number within its grid's range");
  return static_cast<int64_t>(t);
}

void TraceGrid::append(std::string& out, int64_t ticks) const {
  // A tick count, or a difference of two, is far from the int64 limits: negating it is safe.
  if (ticks < 0) out += '-';
  const uint64_t magnitude = static_cast<uint64_t>(std::llabs(ticks));
  char buf[24];
  if (exponent_ >= 0) {
    if (exponent_ == 0 || magnitude == 0) {
      out.append(buf, std::to_chars(buf, buf + sizeof buf, magnitude).ptr);
      return;
    }
    // The digits without their trailing zeros, then the power of ten: "1e203".
    uint64_t digits = magnitude;
    int exponent = exponent_;
    for (; digits % 10 == 0; digits /= 10) ++exponent;
    out.append(buf, std::to_chars(buf, buf + sizeof buf, digits).ptr);
    out.append("e").append(buf, std::to_chars(buf, buf + sizeof buf, exponent).ptr);
    return;
  }
  uint64_t unit = 1;
  for (int e = exponent_; e < 0; ++e) unit *= 10;
  out.append(buf, std::to_chars(buf, buf + sizeof buf, magnitude / unit).ptr);
  uint64_t fraction = magnitude % unit;
  if (fraction == 0) return;
  out += '.';
  // The fraction's digits, leading zeros kept, trailing ones dropped.
  for (unit /= 10; fraction != 0; unit /= 10) {
    out += static_cast<char>('0' + fraction / unit);
    fraction %= unit;
  }
}

std::string TraceGrid::text(int64_t ticks) const {
  std::string out;
  append(out, ticks);
  return out;
}

}  // namespace conveyor::schedule
