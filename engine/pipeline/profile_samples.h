#pragma once
// How profile_units orders its runs: a pure function, apart from the clock so that what it
// promises is tested exactly.
#include <cstddef>
#include <vector>

namespace conveyor {

// One run of a unit in the profile: of which group of identical units (identical_units.h),
// and whether it is timed or a warm-up.
struct ProfileRun {
  size_t group = 0;
  bool timed = false;
};

// The order of the runs when group g takes `warmup` warm-up runs and timed_runs[g] timed
// ones: the warm-ups first, a round of one per group at a time, then every group's timed
// runs spread evenly over the timing (the j-th of n at (j + 1/2) / n of the way, ties in
// group order). Timed in one burst per unit, a busy second of the machine (another process,
// a frequency change) lands on one unit's runs and moves its cost alone; spread out, it lands
// on every group alike.
std::vector<ProfileRun> interleaved_runs(const std::vector<int>& timed_runs, int warmup);

}  // namespace conveyor
