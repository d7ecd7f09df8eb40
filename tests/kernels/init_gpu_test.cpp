// CUDA init_uniform must reproduce the CPU bits exactly (the recipe in init.h); fill is exact.
#include <gtest/gtest.h>

#include "kernels/init.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using testing::bitwise_equal;
using testing::DeviceBuffer;
using testing::GpuContext;

TEST(InitGpu, UniformIsBitIdenticalToCpu) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  struct Case {
    size_t n;
    uint64_t seed, key;
    float low, high;
  };
  const Case cases[] = {
      {1, 0, 0, -1.0f, 1.0f},
      {3, 1, kernels::parameter_key("blocks.0.fc1.weight"), -0.05f, 0.05f},
      {4, 0xfedcba9876543210ull, 0x0123456789abcdefull, 0.0f, 1.0f},
      {5, 42, kernels::parameter_key("embedding.weight"), -0.1f, 0.3f},
      {17, 7, 0xffffffffffffffffull, -3.0f, 2.5f},
      {1000, 123456789, kernels::parameter_key("head.weight"), -0.02f, 0.02f},
      {4097, 99, 1ull << 40, 1.0f, 1.5f},
      {(size_t{1} << 20) + 3, 2024, kernels::parameter_key("blocks.7.fc2.weight"), -0.01f, 0.01f},
      // More groups of four than a launch has threads: the grid-stride loop wraps.
      {4'500'003, 3, kernels::parameter_key("blocks.3.attn.weight"), -0.1f, 0.1f},
  };
  for (const Case& c : cases) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(c.n) + " pad=" + std::to_string(pad));
      std::vector<float> ref(c.n);
      kernels::cpu::init_uniform(ref.data(), static_cast<int64_t>(c.n), c.seed, c.key, c.low,
                                 c.high);
      DeviceBuffer<float> out(c.n, pad);
      kernels::cuda::init_uniform(gpu.ctx(), out.data(), static_cast<int64_t>(c.n), c.seed, c.key,
                                  c.low, c.high);
      const auto got = out.download();
      EXPECT_TRUE(bitwise_equal(got, ref));
      for (float v : got) {
        ASSERT_GE(v, c.low);
        ASSERT_LE(v, c.high);
      }
    }
  }
  kernels::cuda::init_uniform(gpu.ctx(), nullptr, 0, 1, 2, 0.0f, 1.0f);
  gpu.sync();
}

TEST(InitGpu, FillWritesEveryElement) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  for (size_t n :
       {size_t{1}, size_t{3}, size_t{17}, size_t{4097}, size_t{1} << 20, size_t{4'500'003}}) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      DeviceBuffer<float> out(testing::random_floats(n, n + pad), pad);
      kernels::cuda::fill(gpu.ctx(), out.data(), static_cast<int64_t>(n), 0.375f);
      EXPECT_TRUE(bitwise_equal(out.download(), std::vector<float>(n, 0.375f))) << "n=" << n;
    }
  }
  kernels::cuda::fill(gpu.ctx(), nullptr, 0, 1.0f);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
