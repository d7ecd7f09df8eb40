// The order of the profile's runs: warm-ups first, then every group's timed runs spread over
// the whole timing, never one unit's runs in a burst.
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

}  // namespace
}  // namespace conveyor
