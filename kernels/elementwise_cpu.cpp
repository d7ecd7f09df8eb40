#include "kernels/elementwise.h"

namespace conveyor::kernels::cpu {

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace conveyor::kernels::cpu
