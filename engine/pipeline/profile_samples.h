#pragma once
// How profile_units orders its runs and reduces their times to costs: pure functions, apart
// from the clock so that what they promise is tested exactly.
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

// What the planner keeps of a group's timed runs: their lower quartile, and its relative
// standard error. The noise of a shared machine is one-sided: a run that loses its core to
// another process for a time slice (10 ms on Linux) is slowed, and none is sped up. The median
// moves with the share of runs slowed, and jumps to the slowed ones once more than half are;
// the lower quartile stays with the undisturbed runs until three quarters are slowed. The
// error is the large-sample one, sqrt(p (1 - p) / n) over the density at the quartile, that
// density taken from the samples around it (between the 1/8 and 3/8 quantiles): a tight
// cluster of undisturbed runs gives a small error however slow the others were. 0 error for
// fewer than four samples, which give no spread, or a quartile of 0.
struct SampleSummary {
  double quartile = 0;
  double relative_error = 0;
};
SampleSummary summarize_samples(std::vector<double> samples);

}  // namespace conveyor
