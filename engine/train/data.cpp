#include "engine/train/data.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>

#include "engine/core/number_text.h"
#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_io.h"
#include "kernels/init.h"

namespace conveyor {
namespace {

// The counter-based generator's four words for counters [4 block, 4 block + 4).
kernels::Philox4 philox_block(uint64_t seed, uint64_t stream, uint64_t block) {
  return kernels::philox4x32_10(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                                static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32));
}

// Uniform in [0, 1) from one word: its top 24 bits.
float unit_float(uint32_t word) { return static_cast<float>(word >> 8) * (1.0f / 16777216.0f); }

float uniform01(uint64_t seed, uint64_t stream, uint64_t counter) {
  return unit_float(philox_block(seed, stream, counter / 4).v[counter % 4]);
}

constexpr uint64_t kTableStream = 0x7461626c65ULL;  // draws that build the transition table
constexpr uint64_t kChainStream = 0x636861696eULL;  // draws that walk the chain
constexpr uint64_t kHeldOutStream = 0x68656c64ULL;  // draws of the held-out walk

uint64_t walk_stream(MarkovSource::Walk walk) {
  return walk == MarkovSource::Walk::held_out ? kHeldOutStream : kChainStream;
}

}  // namespace

void TokenSource::check_count(int64_t n) const {
  if (n < 0)
    throw std::invalid_argument("TokenSource::next's count n must be 0 or more, got " +
                                std::to_string(n) + " (from the source " + describe() + ")");
}

MarkovSource::MarkovSource(int64_t vocab, uint64_t seed, int fanout, Walk walk)
    : vocab_(vocab), seed_(seed), fanout_(fanout), walk_(walk) {
  if (vocab < 2 || vocab > kMaxVocab)
    throw std::invalid_argument(
        "Markov source vocab must be in [2, " + std::to_string(kMaxVocab) +
        "] (its set-up grows with the vocab and takes seconds at the "
        "top), got " +
        std::to_string(vocab) +
        (vocab < 2 ? "; a chain needs 2 states, so a model of fewer token ids needs a data source "
                     "of one's own (a TokenSource given to the trainer)"
                   : "; a larger model vocab needs another data source, such as a file's bytes "
                     "(TrainConfig::data_path)"));
  if (fanout < 1 || fanout > max_fanout(vocab))
    throw std::invalid_argument(
        "Markov source fanout must be from 1 to " + std::to_string(max_fanout(vocab)) +
        " for vocab " + std::to_string(vocab) + " (its set-up draws vocab x fanout successors, " +
        "at most " + std::to_string(kMaxTableDraws) + "), got " + std::to_string(fanout));
  rows_.resize(vocab);
  cdf_.resize(vocab);
  uint64_t draw = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    std::map<int32_t, double> weights;
    for (int j = 0; j < fanout; ++j) {
      const int32_t successor =
          j == 0 ? static_cast<int32_t>((i + 1) % vocab)
                 : static_cast<int32_t>(uniform01(seed, kTableStream, draw++) * vocab) %
                       static_cast<int32_t>(vocab);
      // Weights in [0.25, 4.25) give rows of clearly different probabilities.
      weights[successor] += 0.25 + 4.0 * uniform01(seed, kTableStream, draw++);
    }
    double total = 0.0;
    for (const auto& [s, w] : weights) total += w;
    float cumulative = 0.0f;
    for (const auto& [s, w] : weights) {
      rows_[i].emplace_back(s, w / total);
      cumulative += static_cast<float>(w / total);
      cdf_[i].push_back(cumulative);
    }
    cdf_[i].back() = 1.0f;  // guard against rounding: the last successor takes the rest
  }
  compute_entropy();
}

const std::vector<std::pair<int32_t, double>>& MarkovSource::row(int32_t state) const {
  if (state < 0 || static_cast<size_t>(state) >= rows_.size())
    throw std::out_of_range("Markov state " + std::to_string(state) + " is outside [0, " +
                            std::to_string(rows_.size()) + "), the source's vocabulary");
  return rows_[static_cast<size_t>(state)];
}

void MarkovSource::compute_entropy() {
  // Stationary distribution by power iteration on the sparse rows, damped by averaging with
  // the previous iterate so that periodic chains converge too (same fixed point).
  std::vector<double> pi(vocab_, 1.0 / static_cast<double>(vocab_)), next(vocab_);
  for (int iter = 0; iter < 100000; ++iter) {
    std::fill(next.begin(), next.end(), 0.0);
    for (int64_t i = 0; i < vocab_; ++i)
      for (const auto& [s, p] : rows_[i]) next[s] += pi[i] * p;
    double change = 0.0;
    for (int64_t i = 0; i < vocab_; ++i) {
      const double updated = 0.5 * (pi[i] + next[i]);
      change += std::abs(updated - pi[i]);
      pi[i] = updated;
    }
    if (change < 1e-13) break;
  }
  double h = 0.0;
  for (int64_t i = 0; i < vocab_; ++i) {
    double row_entropy = 0.0;
    for (const auto& [s, p] : rows_[i]) row_entropy -= p * std::log(p);
    h += pi[i] * row_entropy;
  }
  entropy_ = h;
}

int32_t MarkovSource::step_from(int32_t state, uint64_t t) const {
  return step_with(state, uniform01(seed_, walk_stream(walk_), t));
}

int32_t MarkovSource::step_with(int32_t state, float u) const {
  const auto& cdf = cdf_[state];
  const size_t k = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
  return rows_[state][std::min(k, cdf.size() - 1)].first;
}

void MarkovSource::next(int32_t* inputs, int32_t* targets, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t following = step_from(current_, position_);
    inputs[i] = current_;
    targets[i] = following;
    current_ = following;
    ++position_;
  }
}

void MarkovSource::seek(uint64_t position) {
  // The draws of step_from, a generator call per four positions rather than per position.
  int32_t state = 0;
  for (uint64_t block = 0; block * 4 < position; ++block) {
    const kernels::Philox4 words = philox_block(seed_, walk_stream(walk_), block);
    const uint64_t in_block = std::min<uint64_t>(4, position - block * 4);
    for (uint64_t k = 0; k < in_block; ++k) state = step_with(state, unit_float(words.v[k]));
  }
  position_ = position;
  current_ = state;
}

void MarkovSource::restore(uint64_t position, std::optional<int32_t> token) {
  if (!token) return seek(position);
  if (*token < 0 || *token >= vocab_)
    throw std::invalid_argument("Markov source token " + std::to_string(*token) +
                                " is not in [0, " + std::to_string(vocab_) + ")");
  // The draw at each position is keyed by the position, so the chain from here on is
  // a function of (position, token) alone: the same tokens as a replay that reached them.
  position_ = position;
  current_ = *token;
}

std::string MarkovSource::describe() const {
  std::ostringstream out;
  out << "Markov chain (vocab " << vocab_ << ", fanout " << fanout_ << ", seed " << seed_
      << (walk_ == Walk::held_out ? ", held-out walk" : "") << "), entropy " << entropy_
      << " nats/token";
  return out.str();
}

FileSource::FileSource(const std::string& path) : path_(path) {
  bytes_ = std::make_shared<const std::string>(read_input_file(
      path, {"data file " + quoted_file_name(path), "a regular file whose bytes are the text",
             kMaxBytes, "are read into memory"}));
  const std::string& text = *bytes_;
  if (text.size() < 2)
    throw InputFileError("data file " + quoted_file_name(path) + " has " +
                         counted(text.size(), "byte") +
                         "; at least 2 are needed to form an (input, target) pair");
  contents_digest_ = checkpoint_io::xxh3_64_text(text.data(), text.size());
  std::array<uint64_t, 256> counts{};
  for (const char b : text) ++counts[static_cast<uint8_t>(b)];
  for (const uint64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(text.size());
    unigram_entropy_ -= p * std::log(p);
  }
}

void FileSource::next(int32_t* inputs, int32_t* targets, int64_t n) {
  check_count(n);
  // The file holds size - 1 pairs, each byte followed by the next; wrapping after the last
  // one never pairs the file's last byte with its first, which no text has.
  const std::string& text = *bytes_;
  const uint64_t pairs = text.size() - 1;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t at = (position_ + static_cast<uint64_t>(i)) % pairs;
    inputs[i] = static_cast<uint8_t>(text[at]);
    targets[i] = static_cast<uint8_t>(text[at + 1]);
  }
  position_ += static_cast<uint64_t>(n);
}

std::string FileSource::describe() const {
  return "bytes of " + quoted_file_name(path_) + " (" + std::to_string(bytes_->size()) +
         " tokens, vocab 256)";
}

}  // namespace conveyor
