// CPU token embedding: exact gather, ordered scatter-add, finite differences, bad ids.
#include "kernels/embedding.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

struct Shape {
  int64_t n, c, vocab;
};

class EmbeddingTest : public ::testing::TestWithParam<Shape> {};

TEST_P(EmbeddingTest, ForwardGathersRowsExactly) {
  const Shape s = GetParam();
  const auto table = random_floats(s.vocab * s.c, 1 + s.n);
  const auto tokens = random_ints(s.n, 2 + s.n, 0, static_cast<int32_t>(s.vocab - 1));
  std::vector<float> y(s.n * s.c, 7.0f);
  k::embedding_forward(y.data(), tokens.data(), table.data(), s.n, s.c, s.vocab);
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t j = 0; j < s.c; ++j)
      ASSERT_EQ(y[i * s.c + j], table[tokens[i] * s.c + j]) << "row " << i << " col " << j;
}

TEST_P(EmbeddingTest, BackwardAccumulatesInAscendingPositionOrder) {
  const Shape s = GetParam();
  const auto dy = random_floats(s.n * s.c, 3 + s.n);
  // A small vocabulary relative to n makes repeated tokens certain.
  const auto tokens = random_ints(s.n, 4 + s.n, 0, static_cast<int32_t>(s.vocab - 1));
  const auto dtable0 = random_floats(s.vocab * s.c, 5 + s.n);
  auto dtable = dtable0;
  k::embedding_backward(dtable.data(), dy.data(), tokens.data(), s.n, s.c, s.vocab);

  // Bitwise: the same float additions in ascending position order.
  auto ordered = dtable0;
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t j = 0; j < s.c; ++j) ordered[tokens[i] * s.c + j] += dy[i * s.c + j];
  EXPECT_TRUE(same_bits(dtable, ordered));

  // Against central differences of L = Σ dy ⊙ forward(table) in double.
  std::vector<double> td = to_double(random_floats(s.vocab * s.c, 6 + s.n));
  const auto dyd = to_double(dy);
  auto loss = [&] {
    double l = 0.0;
    for (int64_t i = 0; i < s.n; ++i)
      for (int64_t j = 0; j < s.c; ++j) l += dyd[i * s.c + j] * td[tokens[i] * s.c + j];
    return l;
  };
  auto expected = numeric_gradient(td, loss, 1e-3);
  for (size_t q = 0; q < expected.size(); ++q) expected[q] += dtable0[q];
  EXPECT_TRUE(all_close(dtable, expected, 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingTest,
                         ::testing::Values(Shape{1, 1, 1}, Shape{3, 17, 2}, Shape{33, 5, 7},
                                           Shape{127, 33, 17}, Shape{17, 3, 127}));

TEST(Embedding, MicroBatchesAccumulateLikeOneCall) {
  const int64_t c = 9, vocab = 5, n = 21;
  const auto dy = random_floats(n * c, 11);
  const auto tokens = random_ints(n, 12, 0, vocab - 1);
  const auto d0 = random_floats(vocab * c, 13);
  auto parts = d0, whole = d0;
  int64_t first = 0;
  for (int64_t rows : {4, 1, 16}) {
    k::embedding_backward(parts.data(), dy.data() + first * c, tokens.data() + first, rows, c,
                          vocab);
    first += rows;
  }
  k::embedding_backward(whole.data(), dy.data(), tokens.data(), n, c, vocab);
  // Same additions in the same order: identical bits.
  EXPECT_TRUE(same_bits(parts, whole));
}

TEST(Embedding, TokenOutsideVocabularyThrowsAndWritesNothing) {
  const int64_t c = 4, vocab = 10, n = 6;
  const auto table = random_floats(vocab * c, 21);
  const auto dy = random_floats(n * c, 22);
  for (int32_t bad : {-1, 10, 1 << 30}) {
    std::vector<int32_t> tokens = {0, 3, 9, bad, 2, 1};
    std::vector<float> y(n * c, 7.0f);
    try {
      k::embedding_forward(y.data(), tokens.data(), table.data(), n, c, vocab);
      ADD_FAILURE() << "no exception for token " << bad;
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("[0, 10)"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(same_bits(y, std::vector<float>(n * c, 7.0f)));
    auto dtable = table;
    EXPECT_THROW(k::embedding_backward(dtable.data(), dy.data(), tokens.data(), n, c, vocab),
                 std::out_of_range);
    EXPECT_TRUE(same_bits(dtable, table));
  }
}

TEST(Embedding, RejectsNegativeSizes) {
  std::vector<float> buf(16, 1.0f);
  std::vector<int32_t> tokens(4, 0);
  EXPECT_THROW(k::embedding_forward(buf.data(), tokens.data(), buf.data(), -1, 4, 4),
               std::invalid_argument);
  EXPECT_THROW(k::embedding_backward(buf.data(), buf.data(), tokens.data(), 4, -4, 4),
               std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::testing
