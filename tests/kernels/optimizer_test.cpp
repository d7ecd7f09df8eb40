// CPU AdamW and SGD-momentum against double references over several steps.
#include "kernels/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels;

struct State {
  std::vector<float> p, m, v;
};

// Two tensors of awkward sizes: the first decays, the second does not.
constexpr int64_t kSizes[2] = {17, 33};
constexpr bool kDecay[2] = {true, false};

TEST(AdamW, MatchesDoubleReferenceOverSeveralSteps) {
  k::AdamWParams params;
  params.lr = 3e-3f;
  params.beta1 = 0.9f;
  params.beta2 = 0.95f;
  params.eps = 1e-8f;
  params.weight_decay = 0.1f;
  params.grad_scale = 0.7f;

  State s[2];
  std::vector<double> rp[2], rm[2], rv[2];
  for (int t = 0; t < 2; ++t) {
    s[t].p = random_floats(kSizes[t], 10 + t);
    s[t].m = random_floats(kSizes[t], 20 + t, -0.1f, 0.1f);
    s[t].v = random_floats(kSizes[t], 30 + t, 0.01f, 0.2f);
    rp[t] = to_double(s[t].p);
    rm[t] = to_double(s[t].m);
    rv[t] = to_double(s[t].v);
  }
  for (int64_t step = 1; step <= 6; ++step) {
    params.step = step;
    std::vector<float> grads[2];
    k::OptimizerTensor tensors[2];
    for (int t = 0; t < 2; ++t) {
      grads[t] = random_floats(kSizes[t], 100 * step + t);
      tensors[t] = {s[t].p.data(), grads[t].data(), s[t].m.data(),
                    s[t].v.data(), kSizes[t],       kDecay[t]};
    }
    k::cpu::adamw_update(tensors, 2, params);
    const double b1 = params.beta1, b2 = params.beta2;
    for (int t = 0; t < 2; ++t)
      for (int64_t i = 0; i < kSizes[t]; ++i) {
        const double g = double(grads[t][i]) * params.grad_scale;
        rm[t][i] = b1 * rm[t][i] + (1 - b1) * g;
        rv[t][i] = b2 * rv[t][i] + (1 - b2) * g * g;
        const double mh = rm[t][i] / (1 - std::pow(b1, step));
        const double vh = rv[t][i] / (1 - std::pow(b2, step));
        const double wd = kDecay[t] ? params.weight_decay : 0.0;
        rp[t][i] -= params.lr * (mh / (std::sqrt(vh) + params.eps) + wd * rp[t][i]);
      }
  }
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE(::testing::Message() << "tensor " << t);
    EXPECT_TRUE(all_close(s[t].m, rm[t], 1e-5, 1e-7));
    EXPECT_TRUE(all_close(s[t].v, rv[t], 1e-5, 1e-8));
    EXPECT_TRUE(all_close(s[t].p, rp[t], 1e-5, 1e-6));
  }
}

// Weight decay touches only tensors with `decay` set: a non-decaying tensor follows the
// weight_decay = 0 run bit for bit, a decaying one does not.
TEST(AdamW, WeightDecayOnlyWhereDecaySet) {
  const int64_t n = 29;
  const auto p0 = random_floats(n, 1), g = random_floats(n, 2);
  auto run = [&](bool decay, float wd) {
    std::vector<float> p = p0, m(n, 0.01f), v(n, 0.02f);
    k::OptimizerTensor t{p.data(), g.data(), m.data(), v.data(), n, decay};
    k::AdamWParams params;
    params.weight_decay = wd;
    params.step = 3;
    k::cpu::adamw_update(&t, 1, params);
    return p;
  };
  EXPECT_TRUE(same_bits(run(false, 0.5f), run(false, 0.0f)));
  EXPECT_FALSE(same_bits(run(true, 0.5f), run(true, 0.0f)));
}

TEST(AdamW, RejectsStepZeroAndMissingState) {
  std::vector<float> p(3, 1.0f), g(3, 0.5f), m(3, 0.0f);
  k::OptimizerTensor t{p.data(), g.data(), m.data(), nullptr, 3, true};
  k::AdamWParams params;
  EXPECT_THROW(k::cpu::adamw_update(&t, 1, params), std::invalid_argument);  // no v
  t.state1 = m.data();
  params.step = 0;
  EXPECT_THROW(k::cpu::adamw_update(&t, 1, params), std::invalid_argument);
}

TEST(Sgd, MatchesDoubleReferenceOverSeveralSteps) {
  k::SgdParams params;
  params.lr = 0.05f;
  params.momentum = 0.9f;
  params.weight_decay = 0.01f;
  params.grad_scale = 1.3f;
  State s[2];
  std::vector<double> rp[2], rb[2];
  for (int t = 0; t < 2; ++t) {
    s[t].p = random_floats(kSizes[t], 40 + t);
    s[t].m = random_floats(kSizes[t], 50 + t, -0.1f, 0.1f);
    rp[t] = to_double(s[t].p);
    rb[t] = to_double(s[t].m);
  }
  for (int step = 1; step <= 6; ++step) {
    std::vector<float> grads[2];
    k::OptimizerTensor tensors[2];
    for (int t = 0; t < 2; ++t) {
      grads[t] = random_floats(kSizes[t], 200 * step + t);
      tensors[t] = {s[t].p.data(), grads[t].data(), s[t].m.data(), nullptr, kSizes[t], kDecay[t]};
    }
    k::cpu::sgd_update(tensors, 2, params);
    for (int t = 0; t < 2; ++t)
      for (int64_t i = 0; i < kSizes[t]; ++i) {
        const double g = double(grads[t][i]) * params.grad_scale;
        rb[t][i] = params.momentum * rb[t][i] + g;
        const double wd = kDecay[t] ? params.weight_decay : 0.0;
        rp[t][i] -= params.lr * (rb[t][i] + wd * rp[t][i]);
      }
  }
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE(::testing::Message() << "tensor " << t);
    EXPECT_TRUE(all_close(s[t].m, rb[t], 1e-5, 1e-6));
    EXPECT_TRUE(all_close(s[t].p, rp[t], 1e-5, 1e-6));
  }
}

TEST(Sgd, WeightDecayOnlyWhereDecaySet) {
  const int64_t n = 19;
  const auto p0 = random_floats(n, 3), g = random_floats(n, 4);
  auto run = [&](bool decay, float wd) {
    std::vector<float> p = p0, buf(n, 0.1f);
    k::OptimizerTensor t{p.data(), g.data(), buf.data(), nullptr, n, decay};
    k::SgdParams params;
    params.weight_decay = wd;
    k::cpu::sgd_update(&t, 1, params);
    return p;
  };
  EXPECT_TRUE(same_bits(run(false, 0.5f), run(false, 0.0f)));
  EXPECT_FALSE(same_bits(run(true, 0.5f), run(true, 0.0f)));
}

// Without momentum the buffer is the gradient and may be absent: p -= lr (g + wd p) straight
// from the scaled gradient, decay only where set. With momentum a missing buffer is refused.
TEST(Sgd, WithoutMomentumNeedsNoBuffer) {
  k::SgdParams params;
  params.lr = 0.05f;
  params.momentum = 0.0f;
  params.weight_decay = 0.3f;
  params.grad_scale = 1.7f;
  std::vector<float> p[2], g[2];
  k::OptimizerTensor tensors[2];
  for (int t = 0; t < 2; ++t) {
    p[t] = random_floats(kSizes[t], 70 + t);
    g[t] = random_floats(kSizes[t], 80 + t);
    tensors[t] = {p[t].data(), g[t].data(), nullptr, nullptr, kSizes[t], kDecay[t]};
  }
  const std::vector<float> p0[2] = {p[0], p[1]};
  k::cpu::sgd_update(tensors, 2, params);
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE(::testing::Message() << "tensor " << t);
    std::vector<double> want(kSizes[t]);
    const double wd = kDecay[t] ? params.weight_decay : 0.0;
    for (int64_t i = 0; i < kSizes[t]; ++i)
      want[i] = p0[t][i] - params.lr * (double(g[t][i]) * params.grad_scale + wd * p0[t][i]);
    EXPECT_TRUE(all_close(p[t], want, 1e-6, 1e-7));
  }
  params.momentum = 0.9f;
  EXPECT_THROW(k::cpu::sgd_update(tensors, 2, params), std::invalid_argument);
}

TEST(Optimizer, DeterministicAcrossRuns) {
  const int64_t n = 127;
  const auto p0 = random_floats(n, 61), g = random_floats(n, 62);
  auto adamw = [&] {
    std::vector<float> p = p0, m(n, 0.01f), v(n, 0.02f);
    k::OptimizerTensor t{p.data(), g.data(), m.data(), v.data(), n, true};
    k::AdamWParams params;
    params.weight_decay = 0.1f;
    for (params.step = 1; params.step <= 3; ++params.step) k::cpu::adamw_update(&t, 1, params);
    p.insert(p.end(), m.begin(), m.end());
    p.insert(p.end(), v.begin(), v.end());
    return p;
  };
  auto sgd = [&] {
    std::vector<float> p = p0, buf(n, 0.1f);
    k::OptimizerTensor t{p.data(), g.data(), buf.data(), nullptr, n, true};
    k::SgdParams params;
    params.weight_decay = 0.1f;
    for (int step = 0; step < 3; ++step) k::cpu::sgd_update(&t, 1, params);
    p.insert(p.end(), buf.begin(), buf.end());
    return p;
  };
  EXPECT_TRUE(same_bits(adamw(), adamw()));
  EXPECT_TRUE(same_bits(sgd(), sgd()));
}

}  // namespace
}  // namespace conveyor::testing
