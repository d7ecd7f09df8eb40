// CUDA reductions against the CPU (both accumulate in double), determinism, n = 0, scale.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/reduce.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using testing::bitwise_equal;
using testing::DeviceBuffer;
using testing::GpuContext;
using testing::random_floats;

constexpr size_t kSizes[] = {1, 3, 17, 33, 127, 1000, 4097, (size_t{1} << 20) + 7, 5'000'003};

double run(const GpuContext& gpu, bool squares, const float* x, int64_t n) {
  DeviceBuffer<char> scratch(kernels::cuda::reduce_scratch_bytes(n));
  DeviceBuffer<double> out(std::vector<double>{12345.0});  // must be overwritten
  if (squares)
    kernels::cuda::sum_squares(gpu.ctx(), out.data(), x, n, scratch.data());
  else
    kernels::cuda::sum(gpu.ctx(), out.data(), x, n, scratch.data());
  return out.download()[0];
}

TEST(ReduceGpu, SumAndSumSquaresMatchCpu) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 11;
  for (size_t n : kSizes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " pad=" + std::to_string(pad));
      const auto x = random_floats(n, seed++, -1.0f, 1.5f);
      DeviceBuffer<float> d_x(x, pad);
      const int64_t len = static_cast<int64_t>(n);
      const double s_ref = kernels::cpu::sum(x.data(), len);
      const double q_ref = kernels::cpu::sum_squares(x.data(), len);
      const double s = run(gpu, false, d_x.data(), len);
      const double q = run(gpu, true, d_x.data(), len);
      // Both sum float inputs in double; only the order differs.
      EXPECT_NEAR(s, s_ref, 1e-12 * static_cast<double>(n) + 1e-12);
      EXPECT_NEAR(q, q_ref, 1e-12 * std::abs(q_ref) + 1e-12);
      // Same input, same bits.
      EXPECT_EQ(s, run(gpu, false, d_x.data(), len));
      EXPECT_EQ(q, run(gpu, true, d_x.data(), len));
    }
  }
}

TEST(ReduceGpu, EmptyInputWritesZero) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  EXPECT_EQ(kernels::cuda::reduce_scratch_bytes(0), 0u);
  EXPECT_EQ(run(gpu, false, nullptr, 0), 0.0);
  EXPECT_EQ(run(gpu, true, nullptr, 0), 0.0);
}

TEST(ReduceGpu, ScaleMatchesCpuExactly) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 77;
  for (size_t n : kSizes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      auto x = random_floats(n, seed++);
      DeviceBuffer<float> d_x(x, pad);
      kernels::cuda::scale(gpu.ctx(), d_x.data(), 0.37f, static_cast<int64_t>(n));
      kernels::cpu::scale(x.data(), 0.37f, static_cast<int64_t>(n));
      EXPECT_TRUE(bitwise_equal(d_x.download(), x)) << "n=" << n << " pad=" << pad;
    }
  }
  kernels::cuda::scale(gpu.ctx(), nullptr, 2.0f, 0);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
