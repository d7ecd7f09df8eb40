// CUDA add_inplace against the CPU: exact, at awkward sizes, unaligned pointers, y aliasing x.
#include <gtest/gtest.h>

#include "kernels/elementwise.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using testing::bitwise_equal;
using testing::DeviceBuffer;
using testing::GpuContext;
using testing::random_floats;

// The last size needs more blocks than a launch gets, on the float4 path too.
constexpr size_t kSizes[] = {1, 3, 17, 33, 127, 1000, 4097, (size_t{1} << 20) + 3, 4'500'003};

TEST(ElementwiseGpu, AddInplaceMatchesCpuExactly) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 61;
  for (size_t n : kSizes) {
    // pad 1 on y only: x aligned, y not, so the scalar path must serve a mixed pair.
    for (size_t pad_y : {size_t{0}, size_t{1}}) {
      for (size_t pad_x : {size_t{0}, size_t{1}}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " pad_y=" + std::to_string(pad_y) +
                     " pad_x=" + std::to_string(pad_x));
        auto y = random_floats(n, seed++);
        const auto x = random_floats(n, seed++);
        DeviceBuffer<float> d_y(y, pad_y), d_x(x, pad_x);
        kernels::cuda::add_inplace(gpu.ctx(), d_y.data(), d_x.data(), static_cast<int64_t>(n));
        kernels::cpu::add_inplace(y.data(), x.data(), static_cast<int64_t>(n));
        EXPECT_TRUE(bitwise_equal(d_y.download(), y));
      }
    }
  }
}

TEST(ElementwiseGpu, AddInplaceToItselfDoubles) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  for (size_t n : kSizes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      auto y = random_floats(n, n + pad);
      DeviceBuffer<float> d_y(y, pad);
      kernels::cuda::add_inplace(gpu.ctx(), d_y.data(), d_y.data(), static_cast<int64_t>(n));
      kernels::cpu::add_inplace(y.data(), y.data(), static_cast<int64_t>(n));
      EXPECT_TRUE(bitwise_equal(d_y.download(), y)) << "n=" << n << " pad=" << pad;
    }
  }
  kernels::cuda::add_inplace(gpu.ctx(), nullptr, nullptr, 0);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
