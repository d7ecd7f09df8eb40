#pragma once
// The arithmetic of every transport's group sum and reduce-scatter, in one place, so that
// their bits agree whatever moved the values: each element is added from zero in group order.
#include <cstddef>
#include <vector>

namespace conveyor::comm {

// The ranges a sum of `count` values is cut into over `members`, one each, member i's being
// [bounds[i], bounds[i + 1]) with bounds[i] = count * i / members (lengths differ by one at most).
inline std::vector<size_t> even_ranges(size_t count, size_t members) {
  std::vector<size_t> bounds;
  for (size_t i = 0; i <= members; ++i) bounds.push_back(count * i / members);
  return bounds;
}

// out[k] = 0.0f + parts[0][k] + parts[1][k] + ..., for k < count, in that order. `out` may be
// one of the parts (a member's own values, summed in place): element k is written only after
// every part's element k has been read.
inline void add_in_group_order(float* out, size_t count, const std::vector<const float*>& parts) {
  for (size_t k = 0; k < count; ++k) {
    float sum = 0.0f;
    for (const float* part : parts) sum += part[k];
    out[k] = sum;
  }
}

}  // namespace conveyor::comm
