// Philox-4x32-10 known answers, parameter keys, and the exact init recipe of init.h.
#include "kernels/init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels;

void expect_block(const k::Philox4& got, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  EXPECT_EQ(got.v[0], a);
  EXPECT_EQ(got.v[1], b);
  EXPECT_EQ(got.v[2], c);
  EXPECT_EQ(got.v[3], d);
}

// Known-answer vectors of the Random123 distribution (kat_vectors, philox4x32 10 rounds).
TEST(Philox, MatchesRandom123KnownAnswers) {
  expect_block(k::philox4x32_10(0, 0, 0, 0, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu,
               0x9b00dbd8u);
  const uint32_t f = 0xffffffffu;
  expect_block(k::philox4x32_10(f, f, f, f, f, f), 0x408f276du, 0x41c83b0eu, 0xa20bc7c6u,
               0x6d5451fdu);
  expect_block(k::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u,
                                0x299f31d0u),
               0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u);
}

TEST(ParameterKey, IsXxHash64OfTheName) {
  EXPECT_EQ(k::parameter_key(""), 0xEF46DB3751D8E999ull);  // XXH64 of no bytes, seed 0
  EXPECT_EQ(k::parameter_key("blocks.3.fc1.weight"), k::parameter_key("blocks.3.fc1.weight"));
  EXPECT_NE(k::parameter_key("blocks.3.fc1.weight"), k::parameter_key("blocks.3.fc2.weight"));
  EXPECT_NE(k::parameter_key("blocks.3.fc1.weight"), k::parameter_key("blocks.3.fc1.bias"));
}

// The recipe written out again, independently: float products and sums of floats computed
// in double are exact or correctly rounded once to float, so this equals the three float
// roundings of init.h without depending on compiler contraction settings.
float recipe(int64_t i, uint64_t seed, uint64_t key, float low, float high) {
  const uint64_t block = static_cast<uint64_t>(i) / 4;
  const k::Philox4 w = k::philox4x32_10(
      static_cast<uint32_t>(block & 0xffffffffu), static_cast<uint32_t>(block >> 32),
      static_cast<uint32_t>(seed & 0xffffffffu), static_cast<uint32_t>(seed >> 32),
      static_cast<uint32_t>(key & 0xffffffffu), static_cast<uint32_t>(key >> 32));
  const double u = std::ldexp(static_cast<double>(w.v[i % 4] >> 8), -24);
  const float range = static_cast<float>(static_cast<double>(high) - low);
  const float t = static_cast<float>(static_cast<double>(range) * u);
  return static_cast<float>(static_cast<double>(low) + t);
}

TEST(InitUniform, FollowsTheExactRecipe) {
  const uint64_t seed = 0x123456789abcdefull;
  const uint64_t key = k::parameter_key("blocks.0.fc1.weight");
  for (auto [low, high] :
       {std::pair{-0.05f, 0.05f}, std::pair{0.1f, 0.3f}, std::pair{-1.0f / 3.0f, 2.0f}}) {
    const int64_t n = 1031;
    std::vector<float> out(n);
    k::cpu::init_uniform(out.data(), n, seed, key, low, high);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(out[i], recipe(i, seed, key, low, high)) << "element " << i << " low " << low;
  }
}

TEST(InitUniform, DependsOnlyOnSeedNameAndIndex) {
  const uint64_t key = k::parameter_key("embed.weight");
  std::vector<float> a(33), b(33), prefix(17);
  k::cpu::init_uniform(a.data(), 33, 42, key, -1.0f, 1.0f);
  k::cpu::init_uniform(b.data(), 33, 42, key, -1.0f, 1.0f);
  k::cpu::init_uniform(prefix.data(), 17, 42, key, -1.0f, 1.0f);
  EXPECT_TRUE(same_bits(a, b));
  EXPECT_TRUE(same_bits(prefix, std::vector<float>(a.begin(), a.begin() + 17)));

  std::vector<float> other_name(33), other_seed(33);
  k::cpu::init_uniform(other_name.data(), 33, 42, k::parameter_key("embed.bias"), -1.0f, 1.0f);
  k::cpu::init_uniform(other_seed.data(), 33, 43, key, -1.0f, 1.0f);
  int same_name = 0, same_seed = 0;
  for (int i = 0; i < 33; ++i) {
    same_name += a[i] == other_name[i];
    same_seed += a[i] == other_seed[i];
  }
  EXPECT_LE(same_name, 1);
  EXPECT_LE(same_seed, 1);
}

// Symmetric [-a, a) and one-sided [0, a) bounds (what layers use) are strict; the
// recipe's last rounding could reach `high` only for other bounds (see init.h).
TEST(InitUniform, StaysInsideSymmetricAndOneSidedBounds) {
  const int64_t n = 100003;
  std::vector<float> out(n);
  for (int fan_in : {1, 3, 17, 768, 3072}) {
    const float a = 1.0f / std::sqrt(static_cast<float>(fan_in));
    for (float low : {-a, 0.0f}) {
      const std::string name = std::string("w").append(std::to_string(fan_in));
      k::cpu::init_uniform(out.data(), n, 11, k::parameter_key(name), low, a);
      for (float v : out) {
        ASSERT_GE(v, low);
        ASSERT_LT(v, a);
      }
    }
  }
}

TEST(InitUniform, MeanAndVarianceArePlausible) {
  const int64_t n = 200003;
  const float low = -0.25f, high = 0.75f;
  std::vector<float> out(n);
  k::cpu::init_uniform(out.data(), n, 7, k::parameter_key("head.weight"), low, high);
  double s = 0.0, ss = 0.0;
  for (float v : out) {
    ASSERT_GE(v, low);
    ASSERT_LE(v, high);
    s += v;
    ss += double(v) * v;
  }
  const double mean = s / n, var = ss / n - mean * mean;
  const double width = high - low;
  // Uniform: mean (low+high)/2 with standard error width/sqrt(12 n); variance width²/12.
  EXPECT_NEAR(mean, 0.25, 5.0 * width / std::sqrt(12.0 * n));
  EXPECT_NEAR(var, width * width / 12.0, 0.01 * width * width / 12.0);
}

TEST(InitUniform, RejectsEmptyRangeAndNegativeCount) {
  std::vector<float> out(4);
  EXPECT_THROW(k::cpu::init_uniform(out.data(), 4, 1, 2, 1.0f, 1.0f), std::invalid_argument);
  EXPECT_THROW(k::cpu::init_uniform(out.data(), -1, 1, 2, 0.0f, 1.0f), std::invalid_argument);
}

TEST(Fill, WritesTheValueEverywhere) {
  std::vector<float> out = random_floats(17, 5);
  k::cpu::fill(out.data(), 17, 0.125f);
  for (float v : out) EXPECT_EQ(v, 0.125f);
}

}  // namespace
}  // namespace conveyor::testing
