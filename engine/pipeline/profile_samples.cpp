#include "engine/pipeline/profile_samples.h"

#include <algorithm>
#include <tuple>

namespace conveyor {

std::vector<ProfileRun> interleaved_runs(const std::vector<int>& timed_runs, int warmup) {
  std::vector<ProfileRun> out;
  for (int k = 0; k < warmup; ++k)
    for (size_t g = 0; g < timed_runs.size(); ++g) out.push_back({g, false});
  // (where in the timing, group, run): sorted, the even spread.
  std::vector<std::tuple<double, size_t, int>> timed;
  for (size_t g = 0; g < timed_runs.size(); ++g)
    for (int j = 0; j < timed_runs[g]; ++j) timed.emplace_back((j + 0.5) / timed_runs[g], g, j);
  std::sort(timed.begin(), timed.end());
  for (const auto& [at, g, j] : timed) out.push_back({g, true});
  return out;
}

}  // namespace conveyor
