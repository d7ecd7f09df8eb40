#pragma once
// Shared test helpers: seeded random inputs (never zeros), relative comparisons, GPU skips.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "engine/core/device.h"

namespace conveyor::testing {

inline std::vector<float> random_floats(size_t n, uint64_t seed, float low = -1.0f,
                                        float high = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(low, high);
  std::vector<float> out(n);
  for (auto& v : out) v = dist(rng);
  return out;
}

inline std::vector<int32_t> random_ints(size_t n, uint64_t seed, int32_t low, int32_t high) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(low, high);
  std::vector<int32_t> out(n);
  for (auto& v : out) v = dist(rng);
  return out;
}

// |actual - expected| <= atol + rtol * |expected| for every element; reports the worst one.
template <class A, class E>
::testing::AssertionResult all_close(const A& actual, const E& expected, double rtol, double atol) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " != expected " << expected.size();
  size_t worst = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = static_cast<double>(actual[i]);
    const double e = static_cast<double>(expected[i]);
    const double excess = std::abs(a - e) - (atol + rtol * std::abs(e));
    if (!(excess <= 0.0) && (std::isnan(excess) || excess > worst_excess)) {
      worst = i;
      worst_excess = std::isnan(excess) ? INFINITY : excess;
    }
  }
  if (worst_excess > 0.0)
    return ::testing::AssertionFailure()
           << "element " << worst << ": got " << static_cast<double>(actual[worst]) << ", expected "
           << static_cast<double>(expected[worst]) << " (rtol " << rtol << ", atol " << atol << ")";
  return ::testing::AssertionSuccess();
}

// Whether a missing CUDA device is a failure rather than a reason to skip: set
// CONVEYOR_EXPECT_GPU (to anything but "" or "0") on a machine that has a GPU, as
// tools/gpu_check.sh does, so that a CUDA set-up this binary cannot use (a driver too old for
// its runtime, a device hidden from it) fails every gpu test instead of skipping them all.
inline bool gpu_expected() {
  const char* value = std::getenv("CONVEYOR_EXPECT_GPU");
  return value != nullptr && *value != '\0' && std::string(value) != "0";
}

}  // namespace conveyor::testing

// Skips (reported as skipped by ctest) when no CUDA device is usable; fails instead when one
// is expected (gpu_expected).
#define CONVEYOR_REQUIRE_GPU()                                                                \
  do {                                                                                        \
    if (::conveyor::cuda_device_count() == 0) {                                               \
      if (::conveyor::testing::gpu_expected())                                                \
        FAIL() << "no usable CUDA device, but CONVEYOR_EXPECT_GPU says this machine has one"; \
      GTEST_SKIP() << "no CUDA device";                                                       \
    }                                                                                         \
  } while (0)
