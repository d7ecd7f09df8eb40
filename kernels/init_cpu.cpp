// CPU initialisation: the exact recipe of init.h, one Philox block per four elements.
#include <stdexcept>
#include <string>

#include "kernels/init.h"
#include "kernels/philox.h"

namespace conveyor::kernels::cpu {

void init_uniform(float* out, int64_t n, uint64_t seed, uint64_t key, float low, float high) {
  if (n < 0) throw std::invalid_argument("init_uniform: n must be >= 0, got " + std::to_string(n));
  if (!(low < high))
    throw std::invalid_argument("init_uniform: need low < high, got low " + std::to_string(low) +
                                ", high " + std::to_string(high));
  for (int64_t base = 0; base < n; base += 4) {
    const philox::Block b = philox::init_block(static_cast<uint64_t>(base) / 4, seed, key);
    const int64_t count = n - base < 4 ? n - base : 4;
    for (int64_t j = 0; j < count; ++j)
      out[base + j] = philox::uniform_from_word(b.v[j], low, high);
  }
}

void fill(float* out, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) out[i] = value;
}

}  // namespace conveyor::kernels::cpu
