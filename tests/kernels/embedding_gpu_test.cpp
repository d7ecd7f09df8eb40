// CUDA embedding against the CPU: exact forward, accumulated deterministic backward.
#include <gtest/gtest.h>

#include "common/test_util.h"
#include "kernels/embedding.h"
#include "tests/kernels/gpu_buffer.h"

namespace conveyor {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::DeviceBuffer;
using testing::GpuContext;
using testing::random_floats;
using testing::random_ints;

struct Shape {
  int64_t n, c, vocab;
};
// Small vocabularies give long runs of repeated tokens; c covers odd and vector widths.
constexpr Shape kShapes[] = {{1, 1, 1},      {3, 3, 2},      {17, 17, 5},    {33, 33, 1000},
                             {127, 4, 7},    {1000, 128, 50}, {300, 4097, 3}, {4096, 64, 32768},
                             {20000, 8, 100000}};

TEST(EmbeddingGpu, ForwardMatchesCpuExactly) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 5;
  for (const Shape& s : kShapes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c));
      const auto table = random_floats(static_cast<size_t>(s.vocab * s.c), seed++);
      const auto tokens = random_ints(static_cast<size_t>(s.n), seed++, 0,
                                      static_cast<int32_t>(s.vocab - 1));
      std::vector<float> ref(static_cast<size_t>(s.n * s.c));
      kernels::cpu::embedding_forward(ref.data(), tokens.data(), table.data(), s.n, s.c, s.vocab);
      DeviceBuffer<float> d_table(table, pad), d_y(ref.size(), pad);
      DeviceBuffer<int32_t> d_tokens(tokens);
      kernels::cuda::embedding_forward(gpu.ctx(), d_y.data(), d_tokens.data(), d_table.data(),
                                       s.n, s.c, s.vocab);
      EXPECT_TRUE(bitwise_equal(d_y.download(), ref));
    }
  }
}

TEST(EmbeddingGpu, BackwardAccumulatesLikeCpuAndIsDeterministic) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 500;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c) +
                 " vocab=" + std::to_string(s.vocab));
    const auto dtable0 = random_floats(static_cast<size_t>(s.vocab * s.c), seed++);
    std::vector<float> ref = dtable0;
    DeviceBuffer<float> d_dtable(dtable0), d_dtable2(dtable0);
    DeviceBuffer<char> scratch(kernels::cuda::embedding_backward_scratch_bytes(s.n));
    for (int micro = 0; micro < 3; ++micro) {  // gradients accumulate (+=)
      const auto dy = random_floats(static_cast<size_t>(s.n * s.c), seed++);
      const auto tokens = random_ints(static_cast<size_t>(s.n), seed++, 0,
                                      static_cast<int32_t>(s.vocab - 1));
      kernels::cpu::embedding_backward(ref.data(), dy.data(), tokens.data(), s.n, s.c, s.vocab);
      DeviceBuffer<float> d_dy(dy);
      DeviceBuffer<int32_t> d_tokens(tokens);
      kernels::cuda::embedding_backward(gpu.ctx(), d_dtable.data(), d_dy.data(), d_tokens.data(),
                                        s.n, s.c, s.vocab, scratch.data());
      kernels::cuda::embedding_backward(gpu.ctx(), d_dtable2.data(), d_dy.data(), d_tokens.data(),
                                        s.n, s.c, s.vocab, scratch.data());
    }
    const auto got = d_dtable.download();
    // Same additions in the same (ascending position) order as the CPU loop.
    EXPECT_TRUE(all_close(got, ref, 1e-6, 1e-6));
    EXPECT_TRUE(bitwise_equal(got, d_dtable2.download()));
  }
}

TEST(EmbeddingGpu, EmptyBatchIsANoOp) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  EXPECT_EQ(kernels::cuda::embedding_backward_scratch_bytes(0), 0u);
  kernels::cuda::embedding_forward(gpu.ctx(), nullptr, nullptr, nullptr, 0, 8, 10);
  kernels::cuda::embedding_backward(gpu.ctx(), nullptr, nullptr, nullptr, 0, 8, 10, nullptr);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
