// cuBLASLt linear against the CPU: forward with/without bias, backward_input, backward_weight
// accumulated over micro-batches (dW and db +=), fp32 and TF32, unaligned pointers,
// determinism.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/linear.h"
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
  int64_t n, in, out;
};
constexpr Shape kShapes[] = {{1, 1, 1},       {3, 17, 5},    {33, 127, 65},    {100, 1000, 33},
                             {257, 64, 4097}, {64, 4097, 3}, {512, 256, 1024}, {17, 3, 1}};

// Tolerances for a k-term dot product of inputs in [-1, 1]: fp32 differs from the CPU only in
// summation order; TF32 rounds the inputs to 10 mantissa bits.
double atol_for(bool tf32, int64_t k) {
  const double kd = static_cast<double>(k);
  return tf32 ? 2e-3 * std::sqrt(kd) : 1e-6 * kd + 1e-6;
}
double rtol_for(bool tf32) { return tf32 ? 5e-3 : 1e-4; }

void check_linear(bool tf32) {
  GpuContext gpu(tf32);
  uint64_t seed = tf32 ? 5000 : 4000;
  for (const Shape& s : kShapes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(s.n) + " in=" + std::to_string(s.in) +
                   " out=" + std::to_string(s.out) + " pad=" + std::to_string(pad) +
                   (tf32 ? " tf32" : " fp32"));
      const size_t nx = static_cast<size_t>(s.n * s.in), nw = static_cast<size_t>(s.out * s.in),
                   ny = static_cast<size_t>(s.n * s.out), nb = static_cast<size_t>(s.out);
      const auto x = random_floats(nx, seed++);
      const auto w = random_floats(nw, seed++);
      const auto b = random_floats(nb, seed++);
      const auto dy = random_floats(ny, seed++);

      DeviceBuffer<float> d_x(x, pad), d_w(w, pad), d_b(b, pad), d_dy(dy, pad);
      DeviceBuffer<float> d_y(ny, pad), d_dx(nx, pad);

      // Forward with bias (fused epilogue) and without.
      std::vector<float> y_ref(ny);
      kernels::cpu::linear_forward(y_ref.data(), x.data(), w.data(), b.data(), s.n, s.in, s.out);
      kernels::cuda::linear_forward(gpu.ctx(), d_y.data(), d_x.data(), d_w.data(), d_b.data(), s.n,
                                    s.in, s.out);
      EXPECT_TRUE(all_close(d_y.download(), y_ref, rtol_for(tf32), atol_for(tf32, s.in)));
      kernels::cpu::linear_forward(y_ref.data(), x.data(), w.data(), nullptr, s.n, s.in, s.out);
      kernels::cuda::linear_forward(gpu.ctx(), d_y.data(), d_x.data(), d_w.data(), nullptr, s.n,
                                    s.in, s.out);
      EXPECT_TRUE(all_close(d_y.download(), y_ref, rtol_for(tf32), atol_for(tf32, s.in)));

      // dx = dy·W
      std::vector<float> dx_ref(nx);
      kernels::cpu::linear_backward_input(dx_ref.data(), dy.data(), w.data(), s.n, s.in, s.out);
      kernels::cuda::linear_backward_input(gpu.ctx(), d_dx.data(), d_dy.data(), d_w.data(), s.n,
                                           s.in, s.out);
      EXPECT_TRUE(all_close(d_dx.download(), dx_ref, rtol_for(tf32), atol_for(tf32, s.out)));

      // dW += dyᵀx, db += Σ dy over three micro-batches, starting from non-zero gradients.
      const auto dw0 = random_floats(nw, seed++);
      const auto db0 = random_floats(nb, seed++);
      std::vector<float> dw_ref = dw0, db_ref = db0;
      DeviceBuffer<float> d_dw(dw0, pad), d_db(db0, pad), d_dw2(dw0, pad), d_db2(db0, pad);
      for (int micro = 0; micro < 3; ++micro) {
        const auto mx = random_floats(nx, seed++);
        const auto mdy = random_floats(ny, seed++);
        kernels::cpu::linear_backward_weight(dw_ref.data(), db_ref.data(), mdy.data(), mx.data(),
                                             s.n, s.in, s.out);
        DeviceBuffer<float> d_mx(mx, pad), d_mdy(mdy, pad);
        kernels::cuda::linear_backward_weight(gpu.ctx(), d_dw.data(), d_db.data(), d_mdy.data(),
                                              d_mx.data(), s.n, s.in, s.out);
        kernels::cuda::linear_backward_weight(gpu.ctx(), d_dw2.data(), d_db2.data(), d_mdy.data(),
                                              d_mx.data(), s.n, s.in, s.out);
      }
      const auto dw = d_dw.download();
      const auto db = d_db.download();
      EXPECT_TRUE(all_close(dw, dw_ref, rtol_for(tf32), 3 * atol_for(tf32, s.n)));
      // The bias gradient is a plain fp32 sum, never TF32.
      EXPECT_TRUE(all_close(db, db_ref, 1e-4, 3e-6 * static_cast<double>(s.n) + 1e-6));
      EXPECT_TRUE(bitwise_equal(dw, d_dw2.download()));
      EXPECT_TRUE(bitwise_equal(db, d_db2.download()));

      // A null dbias leaves only dW to accumulate.
      kernels::cuda::linear_backward_weight(gpu.ctx(), d_dw.data(), nullptr, d_dy.data(),
                                            d_x.data(), s.n, s.in, s.out);
      kernels::cpu::linear_backward_weight(dw_ref.data(), nullptr, dy.data(), x.data(), s.n, s.in,
                                           s.out);
      EXPECT_TRUE(all_close(d_dw.download(), dw_ref, rtol_for(tf32), 4 * atol_for(tf32, s.n)));
      EXPECT_TRUE(bitwise_equal(d_db.download(), db));
    }
  }
}

TEST(LinearGpu, Fp32MatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  check_linear(false);
}

TEST(LinearGpu, Tf32MatchesCpuLoosely) {
  CONVEYOR_REQUIRE_GPU();
  check_linear(true);
}

// A bias view at a 4-byte offset next to aligned operands: the GEMM may take the fast kernels,
// and the bias goes through our own kernel instead of the fused epilogue.
TEST(LinearGpu, UnalignedBiasAloneMatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  for (bool tf32 : {false, true}) {
    GpuContext gpu(tf32);
    const int64_t n = 64, in = 256, out = 128;
    const auto x = random_floats(static_cast<size_t>(n * in), 71);
    const auto w = random_floats(static_cast<size_t>(out * in), 72);
    const auto b = random_floats(static_cast<size_t>(out), 73);
    std::vector<float> y_ref(static_cast<size_t>(n * out));
    kernels::cpu::linear_forward(y_ref.data(), x.data(), w.data(), b.data(), n, in, out);
    DeviceBuffer<float> d_x(x), d_w(w), d_b(b, /*pad=*/1), d_y(y_ref.size());
    kernels::cuda::linear_forward(gpu.ctx(), d_y.data(), d_x.data(), d_w.data(), d_b.data(), n, in,
                                  out);
    EXPECT_TRUE(all_close(d_y.download(), y_ref, rtol_for(tf32), atol_for(tf32, in)))
        << (tf32 ? "tf32" : "fp32");
  }
}

// in = 0: y is the bias (or 0) and db still sums dy; out = 0: dx is 0. The outputs start
// non-zero, so they must be written.
TEST(LinearGpu, EmptyProductsMatchCpu) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  const int64_t n = 37, in = 11, out = 13;
  const size_t ny = static_cast<size_t>(n * out), nx = static_cast<size_t>(n * in);
  const auto b = random_floats(static_cast<size_t>(out), 81);
  const auto dy = random_floats(ny, 82);
  const auto db0 = random_floats(static_cast<size_t>(out), 83);
  std::vector<float> none(1);  // operands of zero extent

  DeviceBuffer<float> d_b(b), d_y(random_floats(ny, 84));
  kernels::cuda::linear_forward(gpu.ctx(), d_y.data(), nullptr, nullptr, d_b.data(), n, 0, out);
  std::vector<float> y_ref(ny);
  for (size_t i = 0; i < ny; ++i) y_ref[i] = b[i % static_cast<size_t>(out)];
  EXPECT_TRUE(bitwise_equal(d_y.download(), y_ref));
  kernels::cuda::linear_forward(gpu.ctx(), d_y.data(), nullptr, nullptr, nullptr, n, 0, out);
  EXPECT_TRUE(bitwise_equal(d_y.download(), std::vector<float>(ny, 0.0f)));

  DeviceBuffer<float> d_dx(random_floats(nx, 85));
  kernels::cuda::linear_backward_input(gpu.ctx(), d_dx.data(), nullptr, nullptr, n, in, 0);
  EXPECT_TRUE(bitwise_equal(d_dx.download(), std::vector<float>(nx, 0.0f)));

  std::vector<float> db_ref = db0;
  kernels::cpu::linear_backward_weight(none.data(), db_ref.data(), dy.data(), none.data(), n, 0,
                                       out);
  DeviceBuffer<float> d_db(db0), d_dy(dy);
  kernels::cuda::linear_backward_weight(gpu.ctx(), nullptr, d_db.data(), d_dy.data(), nullptr, n, 0,
                                        out);
  EXPECT_TRUE(all_close(d_db.download(), db_ref, 1e-5, 1e-6));
}

TEST(LinearGpu, EmptyBatchIsANoOp) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  kernels::cuda::linear_forward(gpu.ctx(), nullptr, nullptr, nullptr, nullptr, 0, 8, 8);
  kernels::cuda::linear_backward_input(gpu.ctx(), nullptr, nullptr, nullptr, 0, 8, 8);
  kernels::cuda::linear_backward_weight(gpu.ctx(), nullptr, nullptr, nullptr, nullptr, 0, 8, 8);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
