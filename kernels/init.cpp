// Backend-independent parts of initialisation: the parameter-name key and the Philox block.
#include "kernels/init.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kernels/philox.h"

namespace conveyor::kernels {

uint64_t parameter_key(std::string_view name) {
  return static_cast<uint64_t>(XXH64(name.data(), name.size(), /*seed=*/0));
}

Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                      uint32_t k1) {
  const philox::Block b = philox::generate(c0, c1, c2, c3, k0, k1);
  return Philox4{{b.v[0], b.v[1], b.v[2], b.v[3]}};
}

}  // namespace conveyor::kernels
