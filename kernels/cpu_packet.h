#pragma once
// Element-wise CPU math eight floats at a time through Eigen's packet math (its vectorized
// exp is several times faster than a scalar libm call per element). A short tail is padded
// to a full group, so every element takes the same instructions wherever it sits in a buffer:
// an output depends on its inputs alone, not on the buffer's length or alignment.
#include <Eigen/Core>
#include <algorithm>
#include <cstdint>

namespace conveyor::kernels::cpu::detail {

constexpr int64_t kGroup = 8;
using Group = Eigen::Array<float, kGroup, 1>;

// The `count` (<= kGroup) floats at p, the rest of the group filled with `pad`.
[[gnu::always_inline]] inline Group load_group(const float* p, int64_t count, float pad = 0.0f) {
  if (count == kGroup) return Eigen::Map<const Group>(p);
  Group g = Group::Constant(pad);
  std::copy(p, p + count, g.data());
  return g;
}

[[gnu::always_inline]] inline void store_group(float* p, const Group& g, int64_t count) {
  std::copy(g.data(), g.data() + count, p);
}

// f(first element, elements in this group: kGroup, or fewer for the tail) over [first, last).
template <class F>
[[gnu::always_inline]] inline void for_each_group(int64_t first, int64_t last, F&& f) {
  int64_t i = first;
  for (; i + kGroup <= last; i += kGroup) f(i, kGroup);
  if (i < last) f(i, last - i);
}

}  // namespace conveyor::kernels::cpu::detail
