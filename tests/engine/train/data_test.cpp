// Token sources: the Markov chain's printed entropy is the real loss floor, positions are
// reproducible and resumable, and file tokens are read in order with wrap-around.
#include "engine/train/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/trainer.h"

namespace conveyor {
namespace {

TEST(MarkovSource, EmpiricalCrossEntropyMatchesTheExactEntropy) {
  MarkovSource source(32, 5);
  const int64_t n = 400000;
  std::vector<int32_t> in(n), out(n);
  source.next(in.data(), out.data(), n);
  // The average of -log P(target | input) under the true transition table estimates the
  // conditional entropy; the chain is stationary after a short burn-in.
  double total = 0.0;
  for (int64_t i = 1000; i < n; ++i) {
    double p = 0.0;
    for (const auto& [s, q] : source.row(in[i]))
      if (s == out[i]) p = q;
    ASSERT_GT(p, 0.0) << "transition " << in[i] << " -> " << out[i] << " not in the table";
    total -= std::log(p);
  }
  const double empirical = total / static_cast<double>(n - 1000);
  EXPECT_NEAR(empirical, *source.entropy(), 0.01 * *source.entropy());
  EXPECT_GT(*source.entropy(), 0.3);
  EXPECT_LT(*source.entropy(), std::log(4.0) + 1e-9);  // at most fanout successors
}

// The entropy weighs each row's entropy by the chain's stationary distribution, found here
// another way than the source's power iteration: by Gaussian elimination on pi P = pi,
// sum(pi) = 1. The sampled estimate above allows 1%, more than a wrong weighting (each row
// alike, say) may move it.
TEST(MarkovSource, EntropyWeighsRowsByTheStationaryDistribution) {
  for (const auto& [vocab, seed] : {std::pair{32, 5}, std::pair{17, 3}}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab) + " seed " + std::to_string(seed));
    MarkovSource source(vocab, seed);
    const int n = vocab;
    // Rows 0..n-2 of (P^T - I) pi = 0, then sum(pi) = 1; augmented column n.
    std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0.0));
    for (int i = 0; i < n; ++i)
      for (const auto& [s, q] : source.row(i)) a[s][i] += q;
    for (int i = 0; i < n; ++i) a[i][i] -= 1.0;
    a[n - 1].assign(n + 1, 1.0);
    for (int col = 0; col < n; ++col) {
      int pivot = col;
      for (int r = col + 1; r < n; ++r)
        if (std::abs(a[r][col]) > std::abs(a[pivot][col])) pivot = r;
      std::swap(a[col], a[pivot]);
      ASSERT_GT(std::abs(a[col][col]), 1e-12) << "the chain has no unique stationary distribution";
      for (int r = 0; r < n; ++r) {
        if (r == col) continue;
        const double f = a[r][col] / a[col][col];
        for (int k = col; k <= n; ++k) a[r][k] -= f * a[col][k];
      }
    }
    double h = 0.0, least = 1.0, most = 0.0;
    for (int i = 0; i < n; ++i) {
      const double pi = a[i][n] / a[i][i];
      least = std::min(least, pi);
      most = std::max(most, pi);
      for (const auto& [s, q] : source.row(i)) h -= pi * q * std::log(q);
    }
    EXPECT_NEAR(*source.entropy(), h, 1e-9 * h);
    EXPECT_GT(most, 1.5 * least) << "a stationary distribution this even tells no weighting apart";
  }
}

TEST(MarkovSource, ARowOutsideTheVocabularyIsRefused) {
  MarkovSource source(64, 1);
  EXPECT_FALSE(source.row(63).empty());
  EXPECT_THROW(source.row(64), std::out_of_range);
  EXPECT_THROW(source.row(-1), std::out_of_range);
}

TEST(MarkovSource, TargetsAreTheNextInputs) {
  MarkovSource source(64, 1);
  std::vector<int32_t> in(100), out(100);
  source.next(in.data(), out.data(), 100);
  for (int i = 0; i + 1 < 100; ++i) EXPECT_EQ(out[i], in[i + 1]);
  std::vector<int32_t> in2(1), out2(1);
  source.next(in2.data(), out2.data(), 1);
  EXPECT_EQ(in2[0], out[99]);  // batches continue the same chain
}

TEST(MarkovSource, SeekReproducesTheStream) {
  MarkovSource a(50, 9), b(50, 9), other_seed(50, 10);
  std::vector<int32_t> in_a(300), out_a(300), in_b(100), out_b(100), in_c(300), out_c(300);
  a.next(in_a.data(), out_a.data(), 300);
  b.seek(200);
  EXPECT_EQ(b.position(), 200u);
  b.next(in_b.data(), out_b.data(), 100);
  EXPECT_EQ(std::vector<int32_t>(in_a.begin() + 200, in_a.end()), in_b);
  other_seed.next(in_c.data(), out_c.data(), 300);
  EXPECT_NE(in_a, in_c);
}

// Seek draws four positions per generator call: every position within and across those
// groups lands on the token the stream has there.
TEST(MarkovSource, SeekLandsOnTheStreamsTokenAtEveryPosition) {
  MarkovSource stream(50, 9);
  std::vector<int32_t> in(41), out(41);
  stream.next(in.data(), out.data(), 41);
  for (uint64_t p = 0; p <= 40; ++p) {
    MarkovSource sought(50, 9);
    sought.seek(p);
    EXPECT_EQ(sought.position(), p);
    EXPECT_EQ(sought.current_token(), in[p]) << "position " << p;
  }
}

TEST(MarkovSource, RestoreFromTheTokenGivesTheTokensOfAReplay) {
  MarkovSource replayed(50, 9), restored(50, 9);
  const uint64_t at = 100003;
  replayed.seek(at);
  ASSERT_TRUE(replayed.current_token().has_value());
  restored.restore(at, replayed.current_token());
  EXPECT_EQ(restored.position(), at);
  std::vector<int32_t> in_a(500), out_a(500), in_b(500), out_b(500);
  replayed.next(in_a.data(), out_a.data(), 500);
  restored.next(in_b.data(), out_b.data(), 500);
  EXPECT_EQ(in_a, in_b);
  EXPECT_EQ(out_a, out_b);
  EXPECT_EQ(restored.current_token(), out_b.back());  // the token follows the draws
  // Without a token, restore replays: the same tokens again.
  MarkovSource fallback(50, 9);
  fallback.restore(at, std::nullopt);
  fallback.next(in_b.data(), out_b.data(), 500);
  EXPECT_EQ(in_a, in_b);
}

// A position of 2^60 tokens, which a replay would take centuries to reach: restoring there
// continues the chain exactly as the source restored earlier does when it gets there.
TEST(MarkovSource, RestoresAtAHugePositionWithoutReplaying) {
  const uint64_t at = uint64_t{1} << 60;
  MarkovSource earlier(50, 9), later(50, 9);
  earlier.restore(at, 7);
  std::vector<int32_t> in_a(1000), out_a(1000), in_b(600), out_b(600);
  earlier.next(in_a.data(), out_a.data(), 1000);
  EXPECT_EQ(in_a[0], 7);
  later.restore(at + 400, in_a[400]);
  later.next(in_b.data(), out_b.data(), 600);
  EXPECT_EQ(std::vector<int32_t>(in_a.begin() + 400, in_a.end()), in_b);
  EXPECT_EQ(std::vector<int32_t>(out_a.begin() + 400, out_a.end()), out_b);
  // Draws are keyed by the position: the same token elsewhere starts another stream.
  MarkovSource elsewhere(50, 9);
  elsewhere.restore(at + 1, 7);
  elsewhere.next(in_b.data(), out_b.data(), 600);
  EXPECT_NE(std::vector<int32_t>(out_a.begin(), out_a.begin() + 600), out_b);
}

TEST(MarkovSource, RestoreRefusesATokenOutsideTheVocab) {
  MarkovSource source(50, 9);
  EXPECT_THROW(source.restore(10, 50), std::invalid_argument);
  EXPECT_THROW(source.restore(10, -1), std::invalid_argument);
}

TEST(MarkovSource, RejectsImpossibleSizes) {
  EXPECT_THROW(MarkovSource(1, 0), std::invalid_argument);
  EXPECT_THROW(MarkovSource(10, 0, 0), std::invalid_argument);
}

TEST(MarkovSource, AVocabOutsideItsRangeIsRefusedWithTheWayOutOfThatSide) {
  auto refusal = [](int64_t vocab) {
    try {
      MarkovSource source(vocab, 0);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::string range =
      "Markov source vocab must be in [2, 262144] (its set-up grows with the vocab and takes "
      "seconds at the top), got ";
  // A model of one token id has no larger vocab to be told about.
  for (const int64_t vocab : {int64_t{1}, int64_t{0}, int64_t{-4}})
    EXPECT_EQ(refusal(vocab),
              range + std::to_string(vocab) +
                  "; a chain needs 2 states, so a model of fewer token ids needs "
                  "a data source of one's own (a TokenSource given to the trainer)");
  EXPECT_EQ(refusal(MarkovSource::kMaxVocab + 1),
            range +
                "262145; a larger model vocab needs another data source, such as a file's "
                "bytes (TrainConfig::data_path)");
}

TEST(MarkovSource, AFanoutWhoseTableWouldTakeMinutesIsRefusedNamingIt) {
  auto refusal = [](int64_t vocab, int fanout) {
    try {
      MarkovSource source(vocab, 0, fanout);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(refusal(MarkovSource::kMaxVocab, 5),
            "Markov source fanout must be from 1 to 4 for vocab 262144 (its set-up draws vocab x "
            "fanout successors, at most 1048576), got 5");
  EXPECT_EQ(refusal(10, 0),
            "Markov source fanout must be from 1 to 104857 for vocab 10 (its set-up draws vocab x "
            "fanout successors, at most 1048576), got 0");
  EXPECT_EQ(refusal(10, -3).substr(refusal(10, -3).size() - 6), "got -3");
  // The bound itself builds, and more draws than states only repeat successors.
  MarkovSource widest(256, 0, 4096);
  EXPECT_LE(widest.row(0).size(), 256u);
  EXPECT_NO_THROW(MarkovSource(2, 0));  // the default fanout of 4 over 2 states
  // Without a bound this one drew 2^31 successors per state before it answered.
  EXPECT_EQ(refusal(256, std::numeric_limits<int>::max()),
            "Markov source fanout must be from 1 to 4096 for vocab 256 (its set-up draws vocab x "
            "fanout successors, at most 1048576), got 2147483647");
}

TEST(FileSource, ReadsBytesInOrderAndWraps) {
  const std::string path = ::testing::TempDir() + "conveyor_file_source.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "abcde";
  }
  FileSource source(path);
  EXPECT_EQ(source.vocab(), 256);
  std::vector<int32_t> in(7), out(7);
  source.next(in.data(), out.data(), 7);
  // Four pairs, then the first again: the last byte is never paired with the first.
  EXPECT_EQ(in, (std::vector<int32_t>{'a', 'b', 'c', 'd', 'a', 'b', 'c'}));
  EXPECT_EQ(out, (std::vector<int32_t>{'b', 'c', 'd', 'e', 'b', 'c', 'd'}));
  source.seek(3);
  source.next(in.data(), out.data(), 1);
  EXPECT_EQ(in[0], 'd');
  // Its seek is already O(1): no token to record, and restore seeks.
  EXPECT_FALSE(source.current_token().has_value());
  source.restore(5 * 1000000000000ULL + 1, std::nullopt);
  source.next(in.data(), out.data(), 1);
  EXPECT_EQ(in[0], 'b');
  std::remove(path.c_str());
}

// The unigram entropy counts every byte of the file, the last (only a target) included:
// "abbccc" has frequencies 1/6, 2/6 and 3/6.
TEST(FileSource, UnigramEntropyOfTheFilesBytes) {
  const std::string path = ::testing::TempDir() + "conveyor_unigram.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "abbccc";
  }
  FileSource source(path);
  const double want =
      -(std::log(1.0 / 6) / 6 + 2 * std::log(2.0 / 6) / 6 + 3 * std::log(3.0 / 6) / 6);
  EXPECT_NEAR(source.unigram_entropy(), want, 1e-12);
  std::remove(path.c_str());
}

// The digest a checkpoint records identifies the bytes: a copy under another name has the
// same one, a file with one byte changed (the same size) another; it is XXH3-64 of the bytes.
TEST(FileSource, TheContentsDigestFollowsTheBytesNotTheName) {
  std::mt19937_64 rng(11);
  std::string bytes(100000, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  const std::string a = ::testing::TempDir() + "conveyor_digest_a.bin";
  const std::string b = ::testing::TempDir() + "conveyor_digest_b.bin";
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << text;
  };
  write(a, bytes);
  write(b, bytes);
  const std::optional<std::string> digest = FileSource(a).contents_digest();
  ASSERT_TRUE(digest.has_value());
  EXPECT_EQ(*digest,
            "xxh3_64:" + checkpoint_io::hex64(checkpoint_io::xxh3_64(bytes.data(), bytes.size())));
  EXPECT_NE(FileSource(a).describe(), FileSource(b).describe());
  EXPECT_EQ(FileSource(b).contents_digest(), digest);
  bytes[bytes.size() / 2] ^= 1;
  write(b, bytes);
  EXPECT_NE(FileSource(b).contents_digest(), digest);
  EXPECT_EQ(FileSource(b).bytes(), FileSource(a).bytes());
  // A generated source is identified by its description (vocab, seed) alone.
  EXPECT_FALSE(MarkovSource(8, 1).contents_digest().has_value());
  std::remove(a.c_str());
  std::remove(b.c_str());
}

// Each an InputFileError, as FileSource promises for a file it cannot use: a program that
// catches that type for a bad data file gets the empty file's refusal too.
TEST(FileSource, MissingOrTinyFilesAreClearErrors) {
  EXPECT_THROW(FileSource("/nonexistent/conveyor/data.bin"), InputFileError);
  const std::string path = ::testing::TempDir() + "conveyor_one_byte.bin";
  for (const std::string bytes : {"", "x"}) {
    {
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      f << bytes;
    }
    try {
      FileSource source(path);
      ADD_FAILURE() << "a file of " << bytes.size() << " bytes was taken";
    } catch (const InputFileError& e) {
      EXPECT_EQ(std::string(e.what()),
                "data file '" + path + "' has " + (bytes.empty() ? "0 bytes" : "1 byte") +
                    "; at least 2 are needed to form an (input, target) pair");
    }
  }
  std::remove(path.c_str());
}

// A batch is a run of consecutive pairs: the trainer refuses a file with fewer pairs than one
// step's batch, naming both counts, rather than wrap around inside every batch.
TEST(FileSource, AFileShorterThanOneBatchIsRefusedByTheTrainer) {
  const std::string path = ::testing::TempDir() + "conveyor_three_bytes.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "abc";
  }
  TrainConfig config;
  config.data_path = path;
  config.batch_tokens = 4;
  config.microbatches = 1;
  try {
    make_token_source(config, 256);
    ADD_FAILURE() << "a 3-byte file was taken for batches of 4 tokens";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "data file '" + path +
                  "' has 3 bytes, 2 (input, target) pairs, but one step's batch of 4 tokens "
                  "needs 5 bytes; give a larger file or TrainConfig::batch_tokens 2 or fewer");
  }
  config.batch_tokens = 3;
  EXPECT_THROW(make_token_source(config, 256), std::invalid_argument);
  config.batch_tokens = 2;
  EXPECT_EQ(make_token_source(config, 256)->vocab(), 256);
  std::remove(path.c_str());
}

// The held-out walk is the same chain (its transitions are the table's, its cross-entropy
// the chain's entropy) on draws of its own: not the training walk at any offset, and the
// same walk every time it is made.
TEST(MarkovSource, TheHeldOutWalkIsTheSameChainOnOtherDraws) {
  MarkovSource training(32, 5);
  MarkovSource held_out(32, 5, MarkovSource::kDefaultFanout, MarkovSource::Walk::held_out);
  const int64_t n = 400000;
  std::vector<int32_t> in(n), out(n), train_in(n), train_out(n);
  held_out.next(in.data(), out.data(), n);
  training.next(train_in.data(), train_out.data(), n);
  double total = 0.0;
  for (int64_t i = 1000; i < n; ++i) {
    double p = 0.0;
    for (const auto& [s, q] : training.row(in[i]))
      if (s == out[i]) p = q;
    ASSERT_GT(p, 0.0) << "transition " << in[i] << " -> " << out[i] << " not in the table";
    total -= std::log(p);
  }
  EXPECT_NEAR(total / static_cast<double>(n - 1000), *training.entropy(),
              0.01 * *training.entropy());
  EXPECT_EQ(*held_out.entropy(), *training.entropy());
  // Not a stretch of the training walk: 64 tokens of it appear nowhere in the first 400000.
  const std::vector<int32_t> probe(in.begin() + 5000, in.begin() + 5064);
  EXPECT_EQ(std::search(train_in.begin(), train_in.end(), probe.begin(), probe.end()),
            train_in.end());
  MarkovSource again(32, 5, MarkovSource::kDefaultFanout, MarkovSource::Walk::held_out);
  std::vector<int32_t> in2(1000), out2(1000);
  again.next(in2.data(), out2.data(), 1000);
  EXPECT_TRUE(std::equal(in2.begin(), in2.end(), in.begin()));
  // Seek replays the held-out walk, not the training one.
  again.seek(300);
  again.next(in2.data(), out2.data(), 10);
  EXPECT_TRUE(std::equal(in2.begin(), in2.begin() + 10, in.begin() + 300));
  EXPECT_NE(held_out.describe().find("held-out walk"), std::string::npos);
  EXPECT_EQ(training.describe().find("held-out"), std::string::npos);
}

// A run's held-out data: the bytes after its config.steps training batches of a file, the
// held-out walk of the chain; the same each time it is made.
TEST(HeldOutSource, FollowsTheRunsTrainingBatchesOrWalksApart) {
  const std::string path = ::testing::TempDir() + "conveyor_held_out.bin";
  std::string bytes(1000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 % 251);
  {
    std::ofstream f(path, std::ios::binary);
    f << bytes;
  }
  TrainConfig config;
  config.data_path = path;
  config.batch_tokens = 16;
  config.microbatches = 1;
  config.steps = 10;
  auto file = make_held_out_source(config, 256, *make_token_source(config, 256));
  EXPECT_EQ(file->position(), 160u);
  std::vector<int32_t> in(4), out(4);
  file->next(in.data(), out.data(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(in[i], static_cast<uint8_t>(bytes[160 + i]));
    EXPECT_EQ(out[i], static_cast<uint8_t>(bytes[161 + i]));
  }
  std::remove(path.c_str());

  config.data_path.clear();
  auto chain = make_held_out_source(config, 64, *make_token_source(config, 64));
  MarkovSource walk(64, config.seed, MarkovSource::kDefaultFanout, MarkovSource::Walk::held_out);
  std::vector<int32_t> want_in(100), want_out(100), got_in(100), got_out(100);
  walk.next(want_in.data(), want_out.data(), 100);
  chain->next(got_in.data(), got_out.data(), 100);
  EXPECT_EQ(got_in, want_in);
  EXPECT_EQ(got_out, want_out);
}

// A negative count called directly (the trainer never asks for one) wrapped a file source's
// unsigned position round and was a silent no-op for the chain; 0 reads nothing.
TEST(TokenSource, ANegativeCountIsRefusedAndZeroReadsNothing) {
  const std::string path = ::testing::TempDir() + "conveyor_count.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "abcde";
  }
  FileSource file(path);
  MarkovSource chain(16, 1);
  for (TokenSource* source : std::vector<TokenSource*>{&file, &chain}) {
    std::vector<int32_t> in(3), out(3);
    source->next(in.data(), out.data(), 2);
    const std::optional<int32_t> token = source->current_token();
    const std::vector<int32_t> in_before = in, out_before = out;
    for (const int64_t n : {int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
      try {
        source->next(in.data(), out.data(), n);
        ADD_FAILURE() << source->describe() << " took a count of " << n;
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()), "TokenSource::next's count n must be 0 or more, got " +
                                             std::to_string(n) + " (from the source " +
                                             source->describe() + ")");
      }
      EXPECT_EQ(source->position(), 2u) << source->describe();
    }
    source->next(in.data(), out.data(), 0);
    EXPECT_EQ(source->position(), 2u) << source->describe();
    EXPECT_EQ(source->current_token(), token) << source->describe();
    EXPECT_EQ(in, in_before) << source->describe();
    EXPECT_EQ(out, out_before) << source->describe();
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace conveyor
