// CUDA LayerNorm against the CPU: forward (y, mean, rstd), backward_input (also in place),
// backward_weight accumulated over micro-batches, determinism, unaligned rows, the same bits
// aligned or not.
#include <gtest/gtest.h>

#include <utility>

#include "kernels/layernorm.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::DeviceBuffer;
using testing::GpuContext;
using testing::random_floats;

struct Shape {
  int64_t n, c;
};
// {40000, 8}: more rows than a launch has warps, so the row loop wraps (float4 path with pad 0,
// scalar with pad 1).
constexpr Shape kShapes[] = {{1, 1},    {3, 3},      {17, 17},   {33, 33},  {5, 127},  {64, 1000},
                             {7, 4097}, {300, 1024}, {2000, 64}, {1, 8192}, {40000, 8}};
constexpr float kEps = 1e-5f;

TEST(LayerNormGpu, ForwardAndBackwardInputMatchCpu) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 300;
  for (const Shape& s : kShapes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c) +
                   " pad=" + std::to_string(pad));
      const size_t total = static_cast<size_t>(s.n * s.c), c = static_cast<size_t>(s.c);
      const auto x = random_floats(total, seed++, -2.0f, 3.0f);  // non-zero mean
      const auto gamma = random_floats(c, seed++, 0.5f, 1.5f);
      const auto beta = random_floats(c, seed++);
      const auto dy = random_floats(total, seed++);
      std::vector<float> y_ref(total), mean_ref(s.n), rstd_ref(s.n), dx_ref(total);
      kernels::cpu::layernorm_forward(y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(),
                                      gamma.data(), beta.data(), s.n, s.c, kEps);
      kernels::cpu::layernorm_backward_input(dx_ref.data(), dy.data(), x.data(), mean_ref.data(),
                                             rstd_ref.data(), gamma.data(), s.n, s.c);

      DeviceBuffer<float> d_x(x, pad), d_gamma(gamma, pad), d_beta(beta, pad), d_y(total, pad);
      DeviceBuffer<float> d_mean(s.n), d_rstd(s.n), d_dy(dy, pad), d_dx(total, pad);
      kernels::cuda::layernorm_forward(gpu.ctx(), d_y.data(), d_mean.data(), d_rstd.data(),
                                       d_x.data(), d_gamma.data(), d_beta.data(), s.n, s.c, kEps);
      EXPECT_TRUE(all_close(d_y.download(), y_ref, 1e-4, 1e-5));
      EXPECT_TRUE(all_close(d_mean.download(), mean_ref, 1e-4, 1e-6));
      EXPECT_TRUE(all_close(d_rstd.download(), rstd_ref, 1e-4, 1e-6));

      // Backward from the CPU's saved statistics isolates the backward kernel.
      DeviceBuffer<float> d_mean_ref(mean_ref), d_rstd_ref(rstd_ref);
      kernels::cuda::layernorm_backward_input(gpu.ctx(), d_dx.data(), d_dy.data(), d_x.data(),
                                              d_mean_ref.data(), d_rstd_ref.data(), d_gamma.data(),
                                              s.n, s.c);
      const auto dx = d_dx.download();
      EXPECT_TRUE(all_close(dx, dx_ref, 1e-4, 1e-5));
      // In place over dy: same bits.
      kernels::cuda::layernorm_backward_input(gpu.ctx(), d_dy.data(), d_dy.data(), d_x.data(),
                                              d_mean_ref.data(), d_rstd_ref.data(), d_gamma.data(),
                                              s.n, s.c);
      EXPECT_TRUE(bitwise_equal(d_dy.download(), dx));
    }
  }
}

// The same rows at 16-byte aligned addresses and at 4-byte ones (float4 loads, scalar loads),
// and with only the outputs unaligned: the same bits for y, mean, rstd and dx. Widths that
// are multiples of 4 take the float4 path when aligned; the others check the tail alone.
TEST(LayerNormGpu, SameBitsWhateverTheAlignment) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 1300;
  struct Outputs {
    std::vector<float> y, mean, rstd, dx;
  };
  for (const Shape& s : kShapes) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c));
    const size_t total = static_cast<size_t>(s.n * s.c), c = static_cast<size_t>(s.c);
    const auto x = random_floats(total, seed++, -2.0f, 3.0f);
    const auto gamma = random_floats(c, seed++, 0.5f, 1.5f);
    const auto beta = random_floats(c, seed++);
    const auto dy = random_floats(total, seed++);
    const auto run = [&](size_t in_pad, size_t out_pad) {
      DeviceBuffer<float> d_x(x, in_pad), d_gamma(gamma, in_pad), d_beta(beta, in_pad),
          d_dy(dy, in_pad), d_y(total, out_pad), d_dx(total, out_pad);
      DeviceBuffer<float> d_mean(s.n), d_rstd(s.n);
      kernels::cuda::layernorm_forward(gpu.ctx(), d_y.data(), d_mean.data(), d_rstd.data(),
                                       d_x.data(), d_gamma.data(), d_beta.data(), s.n, s.c, kEps);
      kernels::cuda::layernorm_backward_input(gpu.ctx(), d_dx.data(), d_dy.data(), d_x.data(),
                                              d_mean.data(), d_rstd.data(), d_gamma.data(), s.n,
                                              s.c);
      return Outputs{d_y.download(), d_mean.download(), d_rstd.download(), d_dx.download()};
    };
    const Outputs aligned = run(0, 0);
    for (const auto& [in_pad, out_pad] : {std::pair{1, 1}, std::pair{0, 1}}) {
      SCOPED_TRACE("pads " + std::to_string(in_pad) + ", " + std::to_string(out_pad));
      const Outputs other = run(in_pad, out_pad);
      EXPECT_TRUE(bitwise_equal(other.y, aligned.y));
      EXPECT_TRUE(bitwise_equal(other.mean, aligned.mean));
      EXPECT_TRUE(bitwise_equal(other.rstd, aligned.rstd));
      EXPECT_TRUE(bitwise_equal(other.dx, aligned.dx));
    }
  }
}

TEST(LayerNormGpu, BackwardWeightAccumulatesAndIsDeterministic) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  GpuContext gpu_no_workspace(false, 0);  // partials then come from the stream-ordered pool
  uint64_t seed = 700;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " c=" + std::to_string(s.c));
    const size_t total = static_cast<size_t>(s.n * s.c), c = static_cast<size_t>(s.c);
    const auto dgamma0 = random_floats(c, seed++);
    const auto dbeta0 = random_floats(c, seed++);
    std::vector<float> dgamma_ref = dgamma0, dbeta_ref = dbeta0;
    DeviceBuffer<float> d_dgamma(dgamma0), d_dbeta(dbeta0), d_dgamma2(dgamma0), d_dbeta2(dbeta0);
    for (int micro = 0; micro < 3; ++micro) {  // parameter gradients accumulate (+=)
      const auto x = random_floats(total, seed++, -2.0f, 3.0f);
      const auto dy = random_floats(total, seed++);
      const auto mean = random_floats(static_cast<size_t>(s.n), seed++, 0.0f, 1.0f);
      const auto rstd = random_floats(static_cast<size_t>(s.n), seed++, 0.5f, 2.0f);
      kernels::cpu::layernorm_backward_weight(dgamma_ref.data(), dbeta_ref.data(), dy.data(),
                                              x.data(), mean.data(), rstd.data(), s.n, s.c);
      DeviceBuffer<float> d_x(x), d_dy(dy), d_mean(mean), d_rstd(rstd);
      kernels::cuda::layernorm_backward_weight(gpu.ctx(), d_dgamma.data(), d_dbeta.data(),
                                               d_dy.data(), d_x.data(), d_mean.data(),
                                               d_rstd.data(), s.n, s.c);
      kernels::cuda::layernorm_backward_weight(gpu_no_workspace.ctx(), d_dgamma2.data(),
                                               d_dbeta2.data(), d_dy.data(), d_x.data(),
                                               d_mean.data(), d_rstd.data(), s.n, s.c);
    }
    // Sums of n terms of size ~1 in a different order than the CPU.
    const double atol = 1e-6 * static_cast<double>(s.n) + 1e-6;
    const auto dgamma = d_dgamma.download();
    const auto dbeta = d_dbeta.download();
    EXPECT_TRUE(all_close(dgamma, dgamma_ref, 1e-4, atol));
    EXPECT_TRUE(all_close(dbeta, dbeta_ref, 1e-4, atol));
    EXPECT_TRUE(bitwise_equal(dgamma, d_dgamma2.download()));
    EXPECT_TRUE(bitwise_equal(dbeta, d_dbeta2.download()));
  }
}

TEST(LayerNormGpu, EmptyBatchIsANoOp) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  kernels::cuda::layernorm_forward(gpu.ctx(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   0, 16, kEps);
  kernels::cuda::layernorm_backward_input(gpu.ctx(), nullptr, nullptr, nullptr, nullptr, nullptr,
                                          nullptr, 0, 16);
  kernels::cuda::layernorm_backward_weight(gpu.ctx(), nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, 0, 16);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
