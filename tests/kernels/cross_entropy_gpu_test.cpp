// Fused softmax-cross-entropy on CUDA against the CPU: losses, dlogits, in-place dlogits,
// ignore_index, grad_scale, unaligned rows, the same bits aligned or not, determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <utility>

#include "kernels/cross_entropy.h"
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

constexpr int32_t kIgnore = -100;

struct Shape {
  int64_t n, vocab;
};
// {9000, 12}: more rows than a launch has blocks, so the row loop wraps.
constexpr Shape kShapes[] = {{1, 1},    {3, 3},     {17, 17},   {5, 33},   {4, 127},  {8, 1000},
                             {3, 4097}, {6, 32768}, {2, 50257}, {300, 64}, {9000, 12}};

struct LossesAndGradients {
  std::vector<float> loss, dlogits;
};

// The kernel out of place over `logits` (targets.size() rows of `vocab`), grad_scale 1.
LossesAndGradients run_on_gpu(GpuContext& gpu, const std::vector<float>& logits,
                              const std::vector<int32_t>& targets, int64_t vocab) {
  const auto n = static_cast<int64_t>(targets.size());
  DeviceBuffer<float> d_logits(logits), d_dlogits(logits.size()), d_loss(n);
  DeviceBuffer<int32_t> d_targets(targets);
  kernels::cuda::softmax_cross_entropy(gpu.ctx(), d_loss.data(), d_dlogits.data(), d_logits.data(),
                                       d_targets.data(), n, vocab, kIgnore, 1.0f);
  return {d_loss.download(), d_dlogits.download()};
}

TEST(CrossEntropyGpu, MatchesCpuOutOfPlaceAndInPlace) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 900;
  for (const Shape& s : kShapes) {
    for (size_t pad : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE("n=" + std::to_string(s.n) + " vocab=" + std::to_string(s.vocab) +
                   " pad=" + std::to_string(pad));
      const size_t total = static_cast<size_t>(s.n * s.vocab);
      const auto logits = random_floats(total, seed++, -6.0f, 6.0f);
      auto targets =
          random_ints(static_cast<size_t>(s.n), seed++, 0, static_cast<int32_t>(s.vocab - 1));
      int valid = 0;
      for (size_t i = 0; i < targets.size(); ++i) {
        if (i % 3 == 1) targets[i] = kIgnore;  // every third row is padding
        valid += targets[i] != kIgnore;
      }
      const float grad_scale = 1.0f / static_cast<float>(std::max(valid, 1) * 2);

      std::vector<float> loss_ref(static_cast<size_t>(s.n)), dlogits_ref(total);
      kernels::cpu::softmax_cross_entropy(loss_ref.data(), dlogits_ref.data(), logits.data(),
                                          targets.data(), s.n, s.vocab, kIgnore, grad_scale);

      DeviceBuffer<float> d_logits(logits, pad), d_dlogits(total, pad), d_loss(s.n);
      DeviceBuffer<int32_t> d_targets(targets);
      kernels::cuda::softmax_cross_entropy(gpu.ctx(), d_loss.data(), d_dlogits.data(),
                                           d_logits.data(), d_targets.data(), s.n, s.vocab, kIgnore,
                                           grad_scale);
      const auto loss = d_loss.download();
      const auto dlogits = d_dlogits.download();
      EXPECT_TRUE(all_close(loss, loss_ref, 1e-5, 1e-5));
      EXPECT_TRUE(all_close(dlogits, dlogits_ref, 1e-4, 1e-7));
      for (size_t i = 0; i < targets.size(); ++i) {
        if (targets[i] != kIgnore) continue;
        EXPECT_EQ(loss[i], 0.0f);
        for (int64_t j = 0; j < s.vocab; ++j)
          ASSERT_EQ(dlogits[i * static_cast<size_t>(s.vocab) + static_cast<size_t>(j)], 0.0f);
      }

      // In place over the logits: the same bits as out of place.
      kernels::cuda::softmax_cross_entropy(gpu.ctx(), d_loss.data(), d_logits.data(),
                                           d_logits.data(), d_targets.data(), s.n, s.vocab, kIgnore,
                                           grad_scale);
      EXPECT_TRUE(bitwise_equal(d_logits.download(), dlogits));
      EXPECT_TRUE(bitwise_equal(d_loss.download(), loss));
    }
  }
}

// The same logits at a 16-byte aligned address and at a 4-byte one (float4 loads, scalar
// loads), and with only the output unaligned: the same bits. Widths that are multiples of 4
// take the float4 path when aligned; the others check the tail alone.
TEST(CrossEntropyGpu, SameBitsWhateverTheAlignment) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  uint64_t seed = 1900;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " vocab=" + std::to_string(s.vocab));
    const size_t total = static_cast<size_t>(s.n * s.vocab);
    const auto logits = random_floats(total, seed++, -6.0f, 6.0f);
    const auto targets =
        random_ints(static_cast<size_t>(s.n), seed++, 0, static_cast<int32_t>(s.vocab - 1));
    DeviceBuffer<int32_t> d_targets(targets);
    const auto run = [&](size_t logits_pad, size_t dlogits_pad) {
      DeviceBuffer<float> d_logits(logits, logits_pad), d_dlogits(total, dlogits_pad), d_loss(s.n);
      kernels::cuda::softmax_cross_entropy(gpu.ctx(), d_loss.data(), d_dlogits.data(),
                                           d_logits.data(), d_targets.data(), s.n, s.vocab, kIgnore,
                                           0.25f);
      return LossesAndGradients{d_loss.download(), d_dlogits.download()};
    };
    const LossesAndGradients aligned = run(0, 0);
    for (const auto& [logits_pad, dlogits_pad] : {std::pair{1, 1}, std::pair{0, 1}}) {
      SCOPED_TRACE("pads " + std::to_string(logits_pad) + ", " + std::to_string(dlogits_pad));
      const LossesAndGradients other = run(logits_pad, dlogits_pad);
      EXPECT_TRUE(bitwise_equal(other.loss, aligned.loss));
      EXPECT_TRUE(bitwise_equal(other.dlogits, aligned.dlogits));
    }
  }
}

TEST(CrossEntropyGpu, LargeLogitsStayFinite) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  const int64_t n = 4, vocab = 4097;
  auto logits = random_floats(static_cast<size_t>(n * vocab), 31, -1.0f, 1.0f);
  for (size_t i = 0; i < logits.size(); i += 97) logits[i] = 80.0f;  // exp would overflow
  const auto targets = random_ints(static_cast<size_t>(n), 32, 0, static_cast<int32_t>(vocab - 1));
  std::vector<float> loss_ref(n), dl_ref(logits.size());
  kernels::cpu::softmax_cross_entropy(loss_ref.data(), dl_ref.data(), logits.data(), targets.data(),
                                      n, vocab, kIgnore, 1.0f);
  DeviceBuffer<float> d_logits(logits), d_loss(n);
  DeviceBuffer<int32_t> d_targets(targets);
  kernels::cuda::softmax_cross_entropy(gpu.ctx(), d_loss.data(), d_logits.data(), d_logits.data(),
                                       d_targets.data(), n, vocab, kIgnore, 1.0f);
  EXPECT_TRUE(all_close(d_loss.download(), loss_ref, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(d_logits.download(), dl_ref, 1e-4, 1e-7));
}

// A target outside [0, vocab) that is not the ignore_index: the CPU throws; the kernel gives
// that row a NaN loss, reads and writes nothing out of bounds, and leaves the other rows right.
TEST(CrossEntropyGpu, TargetOutsideVocabGivesNaNLoss) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  for (int64_t vocab : {int64_t{37}, int64_t{40}}) {  // scalar and float4 paths
    SCOPED_TRACE("vocab=" + std::to_string(vocab));
    const int64_t n = 3;
    const auto logits = random_floats(static_cast<size_t>(n * vocab), 41, -3.0f, 3.0f);
    const std::vector<int32_t> targets = {static_cast<int32_t>(vocab), -1, 5};
    const auto [loss, dlogits] = run_on_gpu(gpu, logits, targets, vocab);
    EXPECT_TRUE(std::isnan(loss[0]));
    EXPECT_TRUE(std::isnan(loss[1]));
    // The valid last row against the CPU on that row alone.
    const size_t row = static_cast<size_t>(2 * vocab);
    const std::vector<float> last(logits.begin() + static_cast<std::ptrdiff_t>(row), logits.end());
    float loss_ref = 0.0f;
    std::vector<float> dl_ref(last.size());
    kernels::cpu::softmax_cross_entropy(&loss_ref, dl_ref.data(), last.data(), &targets[2], 1,
                                        vocab, kIgnore, 1.0f);
    EXPECT_NEAR(loss[2], loss_ref, 1e-5 * std::abs(loss_ref) + 1e-5);
    EXPECT_TRUE(all_close(
        std::vector<float>(dlogits.begin() + static_cast<std::ptrdiff_t>(row), dlogits.end()),
        dl_ref, 1e-4, 1e-7));
  }
}

// A NaN logit makes its row's loss NaN as on the CPU, wherever it sits: alone in a thread's
// share of the row (vocab 17: one element per thread) or beside others, on the scalar and the
// float4 path; the other row matches the CPU.
TEST(CrossEntropyGpu, ANaNLogitAnywhereMakesItsRowsLossNaNAsOnTheCpu) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  for (int64_t vocab : {int64_t{1}, int64_t{17}, int64_t{40}, int64_t{4097}, int64_t{32768}}) {
    for (int64_t at : {int64_t{0}, vocab / 2, vocab - 1}) {
      SCOPED_TRACE("vocab=" + std::to_string(vocab) + " NaN at " + std::to_string(at));
      const int64_t n = 2;
      auto logits = random_floats(static_cast<size_t>(n * vocab), 47, -3.0f, 3.0f);
      logits[static_cast<size_t>(at)] = std::nanf("");
      const std::vector<int32_t> targets = {0, static_cast<int32_t>(vocab - 1)};
      std::vector<float> loss_ref(n), dl_ref(logits.size());
      kernels::cpu::softmax_cross_entropy(loss_ref.data(), dl_ref.data(), logits.data(),
                                          targets.data(), n, vocab, kIgnore, 1.0f);
      const std::vector<float> loss = run_on_gpu(gpu, logits, targets, vocab).loss;
      EXPECT_TRUE(std::isnan(loss_ref[0]));
      EXPECT_TRUE(std::isnan(loss[0]));
      EXPECT_NEAR(loss[1], loss_ref[1], 1e-5 * std::abs(loss_ref[1]) + 1e-5);
    }
  }
}

TEST(CrossEntropyGpu, EmptyBatchIsANoOp) {
  CONVEYOR_REQUIRE_GPU();
  GpuContext gpu;
  kernels::cuda::softmax_cross_entropy(gpu.ctx(), nullptr, nullptr, nullptr, nullptr, 0, 10,
                                       kIgnore, 1.0f);
  gpu.sync();
}

}  // namespace
}  // namespace conveyor
