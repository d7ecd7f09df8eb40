// The order of the profile's runs: warm-ups first, then every group's timed runs spread over
// the whole timing, never one unit's runs in a burst. What is kept of a group's times: the
// lower quartile, which runs slowed by other processes do not move while they are fewer than
// three quarters, and its standard error.
#include "engine/pipeline/profile_samples.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace conveyor {
namespace {

// Where each group's timed runs fall, as positions among the timed runs.
std::vector<std::vector<size_t>> timed_positions(const std::vector<ProfileRun>& runs,
                                                 size_t groups) {
  std::vector<std::vector<size_t>> at(groups);
  size_t position = 0;
  for (const ProfileRun& run : runs)
    if (run.timed) at[run.group].push_back(position++);
  return at;
}

TEST(ProfileSamples, WarmUpsComeFirstOneRoundPerGroupAtATime) {
  const auto runs = interleaved_runs({5, 40, 5}, 2);
  ASSERT_EQ(runs.size(), 2u * 3 + 50);
  for (size_t k = 0; k < 6; ++k) {
    EXPECT_FALSE(runs[k].timed) << k;
    EXPECT_EQ(runs[k].group, k % 3) << k;
  }
  for (size_t k = 6; k < runs.size(); ++k) EXPECT_TRUE(runs[k].timed) << k;
}

// The j-th of a group's n timed runs stands within one place per other group of (j + 1/2) / n
// of the way through the timing: a group of few runs is spread over all of it, however many
// runs the others take.
TEST(ProfileSamples, EveryGroupsRunsAreSpreadOverTheTiming) {
  const std::vector<std::vector<int>> cases = {{5, 40, 5}, {1, 7, 3}, {3, 3, 3, 3},
                                               {2, 64},    {10},      {15, 120, 15}};
  for (const auto& counts : cases) {
    const auto at = timed_positions(interleaved_runs(counts, 1), counts.size());
    size_t total = 0;
    for (int n : counts) total += static_cast<size_t>(n);
    for (size_t g = 0; g < counts.size(); ++g) {
      ASSERT_EQ(at[g].size(), static_cast<size_t>(counts[g]));
      for (size_t j = 0; j < at[g].size(); ++j) {
        const double expected = (j + 0.5) / counts[g] * static_cast<double>(total) - 0.5;
        EXPECT_LE(std::abs(static_cast<double>(at[g][j]) - expected),
                  static_cast<double>(counts.size()))
            << "group " << g << " run " << j << " of case " << ::testing::PrintToString(counts);
      }
    }
  }
}

TEST(ProfileSamples, AGroupOfFewRunsIsNeverTimedTwiceInARow) {
  const auto runs = interleaved_runs({5, 40, 5}, 0);
  for (size_t k = 1; k < runs.size(); ++k)
    if (runs[k].group != 1) EXPECT_NE(runs[k].group, runs[k - 1].group) << k;
  // Ties (runs at the same point of the timing) go in group order: one order every time.
  const auto even = interleaved_runs({2, 2}, 0);
  ASSERT_EQ(even.size(), 4u);
  EXPECT_EQ(even[0].group, 0u);
  EXPECT_EQ(even[1].group, 1u);
  EXPECT_EQ(even[2].group, 0u);
  EXPECT_EQ(even[3].group, 1u);
}

TEST(ProfileSamples, TheQuartileAndItsErrorByHand) {
  // n = 9: the quartile is the third value; the 1/8 and 3/8 quantiles the second and fourth,
  // 2 apart: a density of 0.25 / 2; the error sqrt(3/16 / 9) x 8 over the quartile.
  const SampleSummary s = summarize_samples({9, 1, 8, 2, 7, 3, 6, 4, 5});
  EXPECT_DOUBLE_EQ(s.quartile, 3.0);
  EXPECT_NEAR(s.relative_error, std::sqrt(3.0 / 16 / 9) * 8 / 3, 1e-12);
  // Interpolated between neighbours: 0.25 x 7 = 1.75 of the way through 1..8.
  EXPECT_DOUBLE_EQ(summarize_samples({8, 7, 6, 5, 4, 3, 2, 1}).quartile, 2.75);
  // Too few samples for a spread: no error claimed; none at all: zeros.
  EXPECT_EQ(summarize_samples({3, 1, 2}).relative_error, 0.0);
  EXPECT_DOUBLE_EQ(summarize_samples({3, 1, 2}).quartile, 1.5);
  EXPECT_EQ(summarize_samples({}).quartile, 0.0);
}

// Twelve undisturbed runs of about 1 ms and eight slowed: whether by 3x or by 10x, and in
// whatever order, the same quartile among the undisturbed, with an error below 1 %, where
// the median lands between the two kinds and moves with how slow the slowed ones are.
TEST(ProfileSamples, SlowedRunsMoveNeitherTheQuartileNorItsError) {
  std::vector<double> clean;
  for (int k = 0; k < 12; ++k) clean.push_back(1.0 + 0.001 * ((k * 7) % 12));
  auto with_slowed = [&](double factor) {
    std::vector<double> all = clean;
    for (int k = 0; k < 8; ++k) all.insert(all.begin() + 2 * k, factor * clean[k]);
    return all;
  };
  const SampleSummary three = summarize_samples(with_slowed(3));
  const SampleSummary ten = summarize_samples(with_slowed(10));
  EXPECT_EQ(three.quartile, ten.quartile);
  EXPECT_EQ(three.relative_error, ten.relative_error);
  EXPECT_GE(three.quartile, 1.0);
  EXPECT_LE(three.quartile, 1.011);
  EXPECT_GT(three.relative_error, 0.0);
  EXPECT_LT(three.relative_error, 0.01);
  // Spread out, the same count gives a larger error: it says how well the quartile is known.
  std::vector<double> wide;
  for (int k = 0; k < 20; ++k) wide.push_back(1.0 + 0.1 * k);
  EXPECT_GT(summarize_samples(wide).relative_error, 10 * three.relative_error);
}

}  // namespace
}  // namespace conveyor
