#pragma once
// Inline Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", the
// Random123 reference) and the per-element init recipe of init.h, shared by the CPU code and
// the CUDA kernels: under nvcc the functions are __host__ __device__, so both backends run the
// very same integer code and the same three correctly rounded float operations.
#include <cstdint>

#ifdef __CUDACC__
#define CONVEYOR_HOST_DEVICE __host__ __device__
#else
#define CONVEYOR_HOST_DEVICE
#endif

namespace conveyor::kernels::philox {

inline constexpr uint32_t kMul0 = 0xD2511F53u;
inline constexpr uint32_t kMul1 = 0xCD9E8D57u;
inline constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

struct Block {
  uint32_t v[4];
};

CONVEYOR_HOST_DEVICE inline Block generate(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key is bumped between rounds, not before the first
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return Block{{c0, c1, c2, c3}};
}

// The four 32-bit words that feed elements 4*block .. 4*block+3 of a tensor (init.h recipe).
CONVEYOR_HOST_DEVICE inline Block init_block(uint64_t block, uint64_t seed, uint64_t key) {
  return generate(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                  static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
}

// u = (w >> 8) * 2^-24: exact, in [0, 1).
CONVEYOR_HOST_DEVICE inline float unit_float(uint32_t w) {
  return static_cast<float>(w >> 8) * (1.0f / 16777216.0f);
}

// low + (high - low) * u with exactly three roundings and no fused multiply-add.
CONVEYOR_HOST_DEVICE inline float uniform_from_word(uint32_t w, float low, float high) {
  const float u = unit_float(w);
#ifdef __CUDA_ARCH__
  return __fadd_rn(low, __fmul_rn(__fsub_rn(high, low), u));
#else
  // The volatile store keeps a host compiler (GCC with -ffp-contract=fast and FMA enabled)
  // from fusing the multiply into the add, which would change the bits.
  const float range = high - low;
  volatile float t = range * u;
  return low + t;
#endif
}

}  // namespace conveyor::kernels::philox

#undef CONVEYOR_HOST_DEVICE
