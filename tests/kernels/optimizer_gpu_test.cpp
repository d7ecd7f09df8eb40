// Fused multi-tensor AdamW and SGD on CUDA against the CPU over several steps, with awkward
// tensor sizes, an empty tensor, decay on some tensors only, and more tensors than one launch
// carries.
#include <gtest/gtest.h>

#include <memory>

#include "kernels/optimizer.h"
#include "support/gpu_buffer.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using testing::all_close;
using testing::DeviceBuffer;
using testing::GpuContext;
using testing::random_floats;

// Host and device copies of one parameter's tensors.
struct Slot {
  std::vector<float> param, grad, m, v;
  DeviceBuffer<float> d_param, d_grad, d_m, d_v;
  bool decay;
};

std::vector<std::unique_ptr<Slot>> make_slots(const std::vector<size_t>& sizes, uint64_t seed) {
  std::vector<std::unique_ptr<Slot>> slots;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto s = std::make_unique<Slot>();
    const size_t n = sizes[i];
    s->param = random_floats(n, seed++);
    s->m = random_floats(n, seed++, -0.1f, 0.1f);
    s->v = random_floats(n, seed++, 0.0f, 0.01f);
    s->d_param = DeviceBuffer<float>(s->param);
    s->d_grad = DeviceBuffer<float>(n);
    s->d_m = DeviceBuffer<float>(s->m);
    s->d_v = DeviceBuffer<float>(s->v);
    s->decay = i % 2 == 0;
    slots.push_back(std::move(s));
  }
  return slots;
}

std::vector<size_t> awkward_sizes() {
  return {1, 3, 17, 0, 33, 127, 1000, 4097, (size_t{1} << 16) + 5, 300000};
}

std::vector<size_t> many_sizes() {  // more than one launch's worth of descriptors
  std::vector<size_t> sizes;
  for (size_t i = 0; i < 600; ++i) sizes.push_back(1 + (i * 37) % 211);
  return sizes;
}

void check_adamw(const std::vector<size_t>& sizes) {
  GpuContext gpu;
  auto slots = make_slots(sizes, 100);
  uint64_t seed = 9000;
  for (int64_t step = 1; step <= 3; ++step) {
    kernels::AdamWParams p;
    p.lr = 1e-2f;
    p.weight_decay = 0.1f;
    p.step = step;
    p.grad_scale = 0.5f;
    std::vector<kernels::OptimizerTensor> host, dev;
    for (auto& s : slots) {
      s->grad = random_floats(s->param.size(), seed++);
      s->d_grad.upload(s->grad);
      const int64_t n = static_cast<int64_t>(s->param.size());
      host.push_back({s->param.data(), s->grad.data(), s->m.data(), s->v.data(), n, s->decay});
      dev.push_back(
          {s->d_param.data(), s->d_grad.data(), s->d_m.data(), s->d_v.data(), n, s->decay});
    }
    kernels::cpu::adamw_update(host.data(), static_cast<int64_t>(host.size()), p);
    kernels::cuda::adamw_update(gpu.ctx(), dev.data(), static_cast<int64_t>(dev.size()), p);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i) + " n=" + std::to_string(slots[i]->param.size()));
    // Contracted multiply-adds on the device differ from the CPU in the last bits.
    EXPECT_TRUE(all_close(slots[i]->d_param.download(), slots[i]->param, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(slots[i]->d_m.download(), slots[i]->m, 1e-5, 1e-7));
    EXPECT_TRUE(all_close(slots[i]->d_v.download(), slots[i]->v, 1e-5, 1e-9));
  }
}

void check_sgd(const std::vector<size_t>& sizes) {
  GpuContext gpu;
  auto slots = make_slots(sizes, 200);
  uint64_t seed = 19000;
  for (int step = 0; step < 3; ++step) {
    kernels::SgdParams p;
    p.lr = 0.05f;
    p.momentum = 0.9f;
    p.weight_decay = 0.01f;
    p.grad_scale = 0.25f;
    std::vector<kernels::OptimizerTensor> host, dev;
    for (auto& s : slots) {
      s->grad = random_floats(s->param.size(), seed++);
      s->d_grad.upload(s->grad);
      const int64_t n = static_cast<int64_t>(s->param.size());
      host.push_back({s->param.data(), s->grad.data(), s->m.data(), nullptr, n, s->decay});
      dev.push_back({s->d_param.data(), s->d_grad.data(), s->d_m.data(), nullptr, n, s->decay});
    }
    kernels::cpu::sgd_update(host.data(), static_cast<int64_t>(host.size()), p);
    kernels::cuda::sgd_update(gpu.ctx(), dev.data(), static_cast<int64_t>(dev.size()), p);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_TRUE(all_close(slots[i]->d_param.download(), slots[i]->param, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(slots[i]->d_m.download(), slots[i]->m, 1e-5, 1e-6));
  }
}

TEST(OptimizerGpu, AdamWMatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  check_adamw(awkward_sizes());
}

TEST(OptimizerGpu, AdamWOverManyTensorsMatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  check_adamw(many_sizes());
}

// A launch has at most kFixedSmCount * 8 = 1056 blocks, each taking one 2^16-element chunk
// at a time (69,206,016 elements in all, on any device); a larger call makes the blocks go
// round again (grid stride), here with a tensor straddling the first pass's end.
TEST(OptimizerGpu, AdamWBeyondOnePassOfTheGridMatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  const size_t one_pass = size_t{132} * 8 * (size_t{1} << 16);
  check_adamw({one_pass - 4099, 3, 70001, (size_t{1} << 16) + 1});
}

TEST(OptimizerGpu, SgdMatchesCpu) {
  CONVEYOR_REQUIRE_GPU();
  check_sgd(awkward_sizes());
  check_sgd(many_sizes());
}

TEST(OptimizerGpu, NoTensorsIsANoOp) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  kernels::cuda::adamw_update(gpu.ctx(), nullptr, 0, kernels::AdamWParams{});
  kernels::cuda::sgd_update(gpu.ctx(), nullptr, 0, kernels::SgdParams{});
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
