#include "engine/pipeline/profile_samples.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace conveyor {
namespace {

// The q-quantile of sorted values, interpolated between neighbours.
double quantile(const std::vector<double>& sorted, double q) {
  const double at = q * static_cast<double>(sorted.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(at));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  return sorted[below] + (at - static_cast<double>(below)) * (sorted[above] - sorted[below]);
}

}  // namespace

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

SampleSummary summarize_samples(std::vector<double> samples) {
  SampleSummary out;
  if (samples.empty()) return out;
  std::sort(samples.begin(), samples.end());
  constexpr double p = 0.25, h = 0.125;
  out.quartile = quantile(samples, p);
  if (samples.size() < 4 || out.quartile <= 0) return out;
  const double spread = (quantile(samples, p + h) - quantile(samples, p - h)) / (2 * h);
  out.relative_error =
      std::sqrt(p * (1 - p) / static_cast<double>(samples.size())) * spread / out.quartile;
  return out;
}

}  // namespace conveyor
