// CPU fused softmax cross-entropy: double reference, finite differences, in-place, ignored
// rows, large logits, bad targets.
#include "kernels/cross_entropy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "kernels/thread_pool.h"
#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

constexpr int32_t kIgnore = -100;

struct Shape {
  int64_t n, vocab;
};

// Per-row losses (0 for ignored rows) in double.
std::vector<double> ref_losses(const std::vector<double>& logits, const std::vector<int32_t>& t,
                               const Shape& s) {
  std::vector<double> out(s.n, 0.0);
  for (int64_t i = 0; i < s.n; ++i) {
    if (t[i] == kIgnore) continue;
    const double* row = logits.data() + i * s.vocab;
    const double mx = *std::max_element(row, row + s.vocab);
    double z = 0.0;
    for (int64_t j = 0; j < s.vocab; ++j) z += std::exp(row[j] - mx);
    out[i] = mx + std::log(z) - row[t[i]];
  }
  return out;
}

std::vector<double> ref_dlogits(const std::vector<double>& logits, const std::vector<int32_t>& t,
                                const Shape& s, double scale) {
  std::vector<double> d(s.n * s.vocab, 0.0);
  for (int64_t i = 0; i < s.n; ++i) {
    if (t[i] == kIgnore) continue;
    const double* row = logits.data() + i * s.vocab;
    const double mx = *std::max_element(row, row + s.vocab);
    double z = 0.0;
    for (int64_t j = 0; j < s.vocab; ++j) z += std::exp(row[j] - mx);
    for (int64_t j = 0; j < s.vocab; ++j)
      d[i * s.vocab + j] = (std::exp(row[j] - mx) / z - (j == t[i] ? 1.0 : 0.0)) * scale;
  }
  return d;
}

// Targets in range with every third row ignored (when n > 1).
std::vector<int32_t> make_targets(const Shape& s, uint64_t seed) {
  auto t = random_ints(s.n, seed, 0, static_cast<int32_t>(s.vocab - 1));
  for (int64_t i = 1; i < s.n; i += 3) t[i] = kIgnore;
  return t;
}

class CrossEntropyTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CrossEntropyTest, MatchesDoubleReferenceAndFiniteDifferences) {
  const Shape s = GetParam();
  const auto logits = random_floats(s.n * s.vocab, 3 * s.n + s.vocab, -6.0f, 6.0f);
  const auto targets = make_targets(s, 5 * s.n + s.vocab);
  const float scale = 0.37f;
  std::vector<float> losses(s.n, 7.0f), dlogits(s.n * s.vocab, 7.0f);
  k::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), s.n,
                           s.vocab, kIgnore, scale);
  auto ld = to_double(logits);
  EXPECT_TRUE(all_close(losses, ref_losses(ld, targets, s), 1e-5, 1e-6));
  EXPECT_TRUE(all_close(dlogits, ref_dlogits(ld, targets, s, scale), 1e-4, 1e-7));

  // dlogits = grad_scale * d(Σ losses)/dlogits.
  auto total = [&] {
    double l = 0.0;
    for (double v : ref_losses(ld, targets, s)) l += v;
    return l;
  };
  auto fd = numeric_gradient(ld, total, 1e-4);
  for (double& v : fd) v *= scale;
  EXPECT_TRUE(all_close(dlogits, fd, 1e-4, 1e-7));
}

TEST_P(CrossEntropyTest, InPlaceOverLogitsMatchesOutOfPlace) {
  const Shape s = GetParam();
  const auto logits = random_floats(s.n * s.vocab, 7 * s.n + s.vocab, -6.0f, 6.0f);
  const auto targets = make_targets(s, 11 * s.n + s.vocab);
  std::vector<float> losses(s.n), dlogits(s.n * s.vocab);
  k::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), s.n,
                           s.vocab, kIgnore, 1.0f);
  std::vector<float> losses_in(s.n);
  auto buffer = logits;
  k::softmax_cross_entropy(losses_in.data(), buffer.data(), buffer.data(), targets.data(), s.n,
                           s.vocab, kIgnore, 1.0f);
  EXPECT_TRUE(same_bits(losses, losses_in));
  EXPECT_TRUE(same_bits(dlogits, buffer));
}

TEST_P(CrossEntropyTest, IgnoredRowsGiveZeroLossAndZeroGradient) {
  const Shape s = GetParam();
  const auto logits = random_floats(s.n * s.vocab, 13 * s.n + s.vocab, -6.0f, 6.0f);
  const auto targets = make_targets(s, 17 * s.n + s.vocab);
  std::vector<float> losses(s.n, 7.0f), dlogits(s.n * s.vocab, 7.0f);
  k::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), s.n,
                           s.vocab, kIgnore, 1.0f);
  for (int64_t i = 0; i < s.n; ++i) {
    if (targets[i] != kIgnore) {
      EXPECT_GE(losses[i], 0.0f);
      continue;
    }
    EXPECT_EQ(losses[i], 0.0f) << "row " << i;
    for (int64_t j = 0; j < s.vocab; ++j) ASSERT_EQ(dlogits[i * s.vocab + j], 0.0f) << "row " << i;
  }
}

TEST_P(CrossEntropyTest, Deterministic) {
  const Shape s = GetParam();
  const auto logits = random_floats(s.n * s.vocab, 19 * s.n + s.vocab, -6.0f, 6.0f);
  const auto targets = make_targets(s, 23 * s.n + s.vocab);
  std::vector<float> l1(s.n), l2(s.n), d1(s.n * s.vocab), d2(s.n * s.vocab);
  k::softmax_cross_entropy(l1.data(), d1.data(), logits.data(), targets.data(), s.n, s.vocab,
                           kIgnore, 0.5f);
  k::softmax_cross_entropy(l2.data(), d2.data(), logits.data(), targets.data(), s.n, s.vocab,
                           kIgnore, 0.5f);
  EXPECT_TRUE(same_bits(l1, l2));
  EXPECT_TRUE(same_bits(d1, d2));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyTest,
                         ::testing::Values(Shape{1, 1}, Shape{1, 3}, Shape{3, 17}, Shape{17, 33},
                                           Shape{5, 127}, Shape{4, 1001}));

// Rows are handed out in tasks of 16384 / vocab rows: 37 rows of 1001 make tasks of 16, 16
// and 5 rows, each row checked against the reference (finite differences over so many
// logits would take minutes; the suite above checks them on one-task shapes).
TEST(CrossEntropy, RowsInSeveralTasksMatchDoubleReference) {
  const Shape s{37, 1001};
  const auto logits = random_floats(s.n * s.vocab, 29, -6.0f, 6.0f);
  const auto targets = make_targets(s, 30);
  const float scale = 0.61f;
  k::ThreadPool pool(2);
  std::vector<float> losses(s.n, 7.0f), dlogits(s.n * s.vocab, 7.0f);
  k::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), s.n,
                           s.vocab, kIgnore, scale, &pool);
  const auto ld = to_double(logits);
  EXPECT_TRUE(all_close(losses, ref_losses(ld, targets, s), 1e-5, 1e-6));
  EXPECT_TRUE(all_close(dlogits, ref_dlogits(ld, targets, s, scale), 1e-4, 1e-7));
}

// Subtracting the row max keeps huge logits finite; the result is shift invariant.
TEST(CrossEntropy, StableForLargeLogits) {
  const Shape s{5, 37};
  const auto logits = random_floats(s.n * s.vocab, 31, -3.0f, 3.0f);
  const auto targets = random_ints(s.n, 32, 0, s.vocab - 1);
  auto shifted = logits;
  for (auto& v : shifted) v += 1000.0f;
  std::vector<float> l_shift(s.n), d_shift(s.n * s.vocab);
  k::softmax_cross_entropy(l_shift.data(), d_shift.data(), shifted.data(), targets.data(), s.n,
                           s.vocab, kIgnore, 1.0f);
  for (float v : l_shift) ASSERT_TRUE(std::isfinite(v));
  for (float v : d_shift) ASSERT_TRUE(std::isfinite(v));
  // Reference on the shifted floats themselves (the shift rounds the logits to 2^-14).
  const auto sd = to_double(shifted);
  EXPECT_TRUE(all_close(l_shift, ref_losses(sd, targets, s), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(d_shift, ref_dlogits(sd, targets, s, 1.0), 1e-4, 1e-7));
}

// A NaN logit anywhere in a row, the target's or another's, makes that row's loss NaN, so a
// divergence check on the loss sees it; the other rows are untouched by it.
TEST(CrossEntropy, ANaNLogitAnywhereMakesItsRowsLossNaN) {
  for (int64_t vocab : {int64_t{1}, int64_t{5}, int64_t{17}, int64_t{40}, int64_t{1001}}) {
    for (int64_t at : {int64_t{0}, vocab / 2, vocab - 1}) {
      SCOPED_TRACE("vocab " + std::to_string(vocab) + ", NaN at " + std::to_string(at));
      const Shape s{2, vocab};
      auto logits = random_floats(s.n * s.vocab, 43 + static_cast<uint64_t>(vocab), -3.0f, 3.0f);
      logits[static_cast<size_t>(at)] = std::nanf("");
      const std::vector<int32_t> targets = {0, static_cast<int32_t>(vocab - 1)};
      std::vector<float> losses(s.n), dlogits(s.n * s.vocab);
      k::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), s.n,
                               s.vocab, kIgnore, 1.0f);
      EXPECT_TRUE(std::isnan(losses[0]));
      const double want = ref_losses(to_double(logits), targets, s)[1];
      EXPECT_NEAR(losses[1], want, 1e-5 * std::abs(want) + 1e-5);
    }
  }
}

TEST(CrossEntropy, TargetOutsideVocabularyThrowsAndWritesNothing) {
  const Shape s{3, 8};
  const auto logits = random_floats(s.n * s.vocab, 41);
  for (int32_t bad : {-1, 8, 1000}) {
    std::vector<int32_t> targets = {2, bad, 5};
    std::vector<float> losses(s.n, 7.0f), dlogits(s.n * s.vocab, 7.0f);
    EXPECT_THROW(k::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(),
                                          targets.data(), s.n, s.vocab, kIgnore, 1.0f),
                 std::out_of_range);
    EXPECT_TRUE(same_bits(losses, std::vector<float>(s.n, 7.0f)));
    EXPECT_TRUE(same_bits(dlogits, std::vector<float>(s.n * s.vocab, 7.0f)));
  }
}

TEST(CrossEntropy, RejectsEmptyVocabularyAndNegativeRows) {
  std::vector<float> buf(16, 1.0f);
  std::vector<int32_t> targets(4, kIgnore);
  EXPECT_THROW(k::softmax_cross_entropy(buf.data(), buf.data(), buf.data(), targets.data(), 4, 0,
                                        kIgnore, 1.0f),
               std::invalid_argument);
  EXPECT_THROW(k::softmax_cross_entropy(buf.data(), buf.data(), buf.data(), targets.data(), -1, 4,
                                        kIgnore, 1.0f),
               std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::testing
