// CUDA embedding against the CPU: exact forward, accumulated deterministic backward.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/embedding.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

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
constexpr Shape kShapes[] = {{1, 1, 1},      {3, 3, 2},         {17, 17, 5},
                             {33, 33, 1000}, {127, 4, 7},       {1000, 128, 50},
                             {300, 4097, 3}, {4096, 64, 32768}, {20000, 8, 100000}};

TEST(EmbeddingGpu, ForwardMatchesCpuExactly) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 5;
  for (const Shape& s : kShapes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c));
      const auto table = random_floats(static_cast<size_t>(s.vocab * s.c), seed++);
      const auto tokens =
          random_ints(static_cast<size_t>(s.n), seed++, 0, static_cast<int32_t>(s.vocab - 1));
      std::vector<float> ref(static_cast<size_t>(s.n * s.c));
      kernels::cpu::embedding_forward(ref.data(), tokens.data(), table.data(), s.n, s.c, s.vocab);
      // pad also puts the token ids at an odd 4-byte offset, as slice_rows of the [m, n]
      // token tensor does for odd n.
      DeviceBuffer<float> d_table(table, pad), d_y(ref.size(), pad);
      DeviceBuffer<int32_t> d_tokens(tokens, pad);
      kernels::cuda::embedding_forward(gpu.ctx(), d_y.data(), d_tokens.data(), d_table.data(), s.n,
                                       s.c, s.vocab);
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
      const auto tokens =
          random_ints(static_cast<size_t>(s.n), seed++, 0, static_cast<int32_t>(s.vocab - 1));
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

// Bad ids must neither touch memory nor disturb the rows of valid ids. The sort looks only at
// the low bits a valid id needs, so ids such as vocab + 1 or -1 share low bits with valid ids;
// they must not split a valid id's run (two blocks would then update one row at once). The
// token pointer sits at an odd 4-byte offset (a row slice of the step's token tensor).
TEST(EmbeddingGpu, BackwardSkipsBadIdsWithoutSplittingRuns) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 800;
  for (const Shape& s : {Shape{4096, 33, 4}, Shape{1000, 64, 5}, Shape{777, 8, 1024}}) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c) +
                 " vocab=" + std::to_string(s.vocab));
    const auto dtable0 = random_floats(static_cast<size_t>(s.vocab * s.c), seed++);
    const auto dy = random_floats(static_cast<size_t>(s.n * s.c), seed++);
    const auto tokens =
        random_ints(static_cast<size_t>(s.n), seed++, -9, static_cast<int32_t>(3 * s.vocab + 9));
    // Reference: the CPU loop over positions, skipping bad ids (the CPU kernel throws on them).
    std::vector<float> ref = dtable0;
    int64_t bad = 0;
    for (int64_t i = 0; i < s.n; ++i) {
      const int32_t t = tokens[static_cast<size_t>(i)];
      if (t < 0 || t >= s.vocab) {
        ++bad;
        continue;
      }
      for (int64_t j = 0; j < s.c; ++j)
        ref[static_cast<size_t>(t * s.c + j)] += dy[static_cast<size_t>(i * s.c + j)];
    }
    ASSERT_GT(bad, 0);
    ASSERT_LT(bad, s.n);
    DeviceBuffer<float> d_dtable(dtable0), d_dtable2(dtable0), d_dy(dy);
    DeviceBuffer<int32_t> d_tokens(tokens, /*pad=*/1);
    DeviceBuffer<char> scratch(kernels::cuda::embedding_backward_scratch_bytes(s.n));
    kernels::cuda::embedding_backward(gpu.ctx(), d_dtable.data(), d_dy.data(), d_tokens.data(), s.n,
                                      s.c, s.vocab, scratch.data());
    kernels::cuda::embedding_backward(gpu.ctx(), d_dtable2.data(), d_dy.data(), d_tokens.data(),
                                      s.n, s.c, s.vocab, scratch.data());
    const auto got = d_dtable.download();
    EXPECT_TRUE(all_close(got, ref, 1e-6, 1e-6));
    EXPECT_TRUE(bitwise_equal(got, d_dtable2.download()));

    // Forward: rows of bad ids are NaN, the others exact copies.
    DeviceBuffer<float> d_y(static_cast<size_t>(s.n * s.c), /*pad=*/1);
    kernels::cuda::embedding_forward(gpu.ctx(), d_y.data(), d_tokens.data(), d_dtable.data(), s.n,
                                     s.c, s.vocab);
    const auto y = d_y.download();
    for (int64_t i = 0; i < s.n; ++i) {
      const int32_t t = tokens[static_cast<size_t>(i)];
      const bool ok = t >= 0 && t < s.vocab;
      for (int64_t j = 0; j < s.c; ++j) {
        const float v = y[static_cast<size_t>(i * s.c + j)];
        if (ok)
          ASSERT_EQ(v, got[static_cast<size_t>(t * s.c + j)]) << "row " << i;
        else
          ASSERT_TRUE(std::isnan(v)) << "row " << i << " (id " << t << ")";
      }
    }
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
