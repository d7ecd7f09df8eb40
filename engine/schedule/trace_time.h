#pragma once
// The times of a Chrome trace, on one grid: a slice's start and end each rounded to it, its
// duration their difference, so that a slice that ends where the next begins is written as
// ending there (start + duration computed in floating point would overshoot it by a rounding
// error, and viewers nest or move slices that overlap on one thread). The text of a time is
// exact decimal: what a reader adds up is what was rounded.
#include <cstdint>
#include <string>

namespace conveyor::schedule {

class TraceGrid {
 public:
  // The finest grid on which times up to `largest_us` (in magnitude) count fewer than 2^51
  // ticks: whole nanoseconds (Perfetto's own resolution) for times under 26 days, else as
  // coarse a power of ten as they need. Throws std::invalid_argument if `largest_us` is not
  // finite.
  explicit TraceGrid(double largest_us = 0);

  // `us` to the nearest tick; monotone, so times in order stay in order. Throws
  // std::invalid_argument if `us` is not finite or beyond the grid's range.
  int64_t ticks(double us) const;
  // `ticks` in microseconds as exact JSON number text: "1048575", "0.125", "-2.5", "12e5".
  void append(std::string& out, int64_t ticks) const;
  std::string text(int64_t ticks) const;

 private:
  int exponent_ = -3;  // a tick is 10^exponent_ microseconds
};

}  // namespace conveyor::schedule
