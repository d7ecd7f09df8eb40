// CPU reductions in double with a fixed blocking: eight interleaved partial sums (lane
// i % 8), combined pairwise in a fixed order, so the bits never depend on the run.
#include "kernels/cpu_check.h"
#include "kernels/reduce.h"

namespace conveyor::kernels::cpu {
namespace {

constexpr int kLanes = 8;

template <class F>
double lane_sum(const float* x, int64_t n, F term) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += term(static_cast<double>(x[i + l]));
  for (int l = 0; i < n; ++i, ++l) acc[l] += term(static_cast<double>(x[i]));
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

double sum(const float* x, int64_t n) {
  detail::require_at_least("sum", "n", n, 0);
  return lane_sum(x, n, [](double v) { return v; });
}

double sum_squares(const float* x, int64_t n) {
  detail::require_at_least("sum_squares", "n", n, 0);
  return lane_sum(x, n, [](double v) { return v * v; });
}

void scale(float* x, float scale, int64_t n) {
  detail::require_at_least("scale", "n", n, 0);
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

}  // namespace conveyor::kernels::cpu
