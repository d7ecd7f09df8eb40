// CUDA activations against the CPU kernels: awkward sizes, unaligned pointers, in-place dx.
#include <gtest/gtest.h>

#include "kernels/activation.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using testing::all_close;
using testing::DeviceBuffer;
using testing::GpuContext;
using testing::random_floats;

// The last size needs more blocks than a launch gets (grid_for caps the grid), on the float4
// path too, so every thread walks the grid-stride loop more than once.
constexpr size_t kSizes[] = {1, 3, 17, 33, 127, 1000, 4097, (size_t{1} << 20) + 3, 4'500'003};

using Forward = void (*)(const kernels::cuda::CudaContext&, float*, const float*, int64_t);
using Backward = void (*)(const kernels::cuda::CudaContext&, float*, const float*, const float*,
                          int64_t);
using CpuForward = void (*)(float*, const float*, int64_t, kernels::cpu::ThreadPool*);
using CpuBackward = void (*)(float*, const float*, const float*, int64_t,
                             kernels::cpu::ThreadPool*);

void check_pair(Forward fwd, CpuForward cpu_fwd, Backward bwd, CpuBackward cpu_bwd, double rtol,
                double atol) {
  GpuContext gpu;
  uint64_t seed = 1;
  for (size_t n : kSizes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {  // pad 1: unaligned, scalar path
      SCOPED_TRACE("n=" + std::to_string(n) + " pad=" + std::to_string(pad));
      const auto x = random_floats(n, seed++, -4.0f, 4.0f);
      const auto dy = random_floats(n, seed++);
      std::vector<float> y_ref(n), dx_ref(n);
      cpu_fwd(y_ref.data(), x.data(), static_cast<int64_t>(n), nullptr);
      cpu_bwd(dx_ref.data(), dy.data(), x.data(), static_cast<int64_t>(n), nullptr);

      DeviceBuffer<float> d_x(x, pad), d_dy(dy, pad), d_y(n, pad), d_dx(n, pad);
      fwd(gpu.ctx(), d_y.data(), d_x.data(), static_cast<int64_t>(n));
      bwd(gpu.ctx(), d_dx.data(), d_dy.data(), d_x.data(), static_cast<int64_t>(n));
      EXPECT_TRUE(all_close(d_y.download(), y_ref, rtol, atol));
      EXPECT_TRUE(all_close(d_dx.download(), dx_ref, rtol, atol));

      // dx may alias dy.
      bwd(gpu.ctx(), d_dy.data(), d_dy.data(), d_x.data(), static_cast<int64_t>(n));
      EXPECT_TRUE(all_close(d_dy.download(), dx_ref, rtol, atol));
    }
  }
  // n = 0 is a no-op, even with null pointers.
  fwd(gpu.ctx(), nullptr, nullptr, 0);
  bwd(gpu.ctx(), nullptr, nullptr, nullptr, 0);
  gpu.sync();
}

TEST(ActivationGpu, GeluMatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  // expf on the device and the packet exp of the host differ by an ulp or two.
  check_pair(kernels::cuda::gelu_forward, kernels::cpu::gelu_forward, kernels::cuda::gelu_backward,
             kernels::cpu::gelu_backward, 1e-5, 1e-6);
}

TEST(ActivationGpu, ReluMatchesCpuExactly) {
  CONVEYOR_REQUIRE_GPU();
  check_pair(kernels::cuda::relu_forward, kernels::cpu::relu_forward, kernels::cuda::relu_backward,
             kernels::cpu::relu_backward, 0.0, 0.0);
}

}  // namespace
}  // namespace conveyor
