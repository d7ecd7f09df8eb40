#pragma once
// Element-wise CPU math eight floats at a time through Eigen's packet math (its vectorized
// exp is several times faster than a scalar libm call per element). A short tail is padded
// to a full group, so every element takes the same instructions wherever it sits in a buffer:
// an output depends on its inputs alone, not on the buffer's length or alignment.
#include <Eigen/Core>
#include <algorithm>
#include <cstdint>

// On the per-group lambdas: left to itself the compiler keeps a lambda holding an exp out of
// line, and then pays a call, a vzeroupper and a trip through the stack per eight elements.
#define CONVEYOR_INLINE __attribute__((always_inline))

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
  if (count == kGroup) {
    Eigen::Map<Group> out(p);
    out = g;  // one vector store, not a copy through the stack
    return;
  }
  std::copy(g.data(), g.data() + count, p);
}

// f(first element, elements in this group: kGroup, or fewer for the tail) over [first, last).
// One call site for f, so that the compiler inlines it into the loop.
template <class F>
[[gnu::always_inline]] inline void for_each_group(int64_t first, int64_t last, F&& f) {
  for (int64_t i = first; i < last; i += kGroup) f(i, std::min(kGroup, last - i));
}

}  // namespace conveyor::kernels::cpu::detail
