#pragma once
// The arithmetic of every transport's group sum and reduce-scatter, in one place, so that
// their bits agree whatever moved the values: each element is added from zero in group order.
#include <cstddef>
#include <vector>

namespace conveyor::comm {

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
