#pragma once
// Philox-4x32-10 (Salmon et al., Random123), usable on host and device. Must stay
// bit-identical to the host reference kernels::philox4x32_10 in init.cpp.
#include <cstdint>

namespace conveyor::kernels::cuda::detail {

struct PhiloxWords {
  uint32_t v[4];
};

__host__ __device__ __forceinline__ uint32_t mulhi32(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

__host__ __device__ __forceinline__ PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                              uint32_t c3, uint32_t k0,
                                                              uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key is bumped between rounds, not before the first
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const uint32_t hi0 = mulhi32(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = mulhi32(kMul1, c2), lo1 = kMul1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

}  // namespace conveyor::kernels::cuda::detail
