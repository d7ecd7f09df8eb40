#pragma once
// Token sources for training: next-token prediction pairs (input x_t, target x_{t+1}) read in
// order, so batch k is always the k-th consecutive block of n tokens: runs are reproducible
// and comparable with other tools, and a source can be repositioned to resume.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace conveyor {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Tokens lie in [0, vocab()).
  virtual int64_t vocab() const = 0;
  // Next n (input, target) pairs; advances the position by n. All n of each must be written:
  // a source that has run out throws (Trainer::step then puts it back where the step began,
  // and refuses an id left unwritten). n = 0 gives nothing and stays where it is; the sources
  // here refuse a negative n (check_count).
  virtual void next(int32_t* inputs, int32_t* targets, int64_t n) = 0;
  // Tokens consumed so far, and moving there (for resuming).
  virtual uint64_t position() const = 0;
  virtual void seek(uint64_t position) = 0;
  // The token at position(), the next pair's input, from a source whose later tokens depend
  // only on it and the position: with it restore() moves there at once, where seek() may
  // have to replay the stream. Sources whose seek is already cheap return nothing.
  virtual std::optional<int32_t> current_token() const { return std::nullopt; }
  // Moves to `position` given the current_token() a source of this kind had there, or seeks
  // when there is none (a checkpoint written before tokens were recorded).
  virtual void restore(uint64_t position, std::optional<int32_t> /*token*/) { seek(position); }
  virtual std::string describe() const = 0;
  // What the tokens are, independent of how the source was named: "xxh3_64:" and 16 hex digits
  // of a digest of its contents for a source read from a file, so that a checkpoint can tell
  // the same bytes under another path from other bytes under the same one. Sources that
  // describe() identifies completely (a generator and its seed) return nothing.
  virtual std::optional<std::string> contents_digest() const { return std::nullopt; }
  // The best achievable mean loss (nats/token) of a model that sees one token, when known.
  virtual std::optional<double> entropy() const { return std::nullopt; }

 protected:
  // For next(): throws std::invalid_argument, naming the source, for a negative n, which would
  // otherwise move an unsigned position back by wrapping it, or do nothing without a word.
  void check_count(int64_t n) const;
};

// A stationary Markov chain over `vocab` states generated from `seed`: each state moves to
// `fanout` successors (one of them state+1, which keeps the chain irreducible) with random
// probabilities. Successive tokens are drawn with a counter-based generator, so token t
// depends only on (seed, t, token t-1). Its exact conditional entropy
// H = Σ_i π_i Σ_j -P_ij log P_ij (π the stationary distribution) is the loss floor.
class MarkovSource : public TokenSource {
 public:
  // The table and its stationary distribution take about 2 s to build at this vocab on one
  // core; larger ones would stay silent for minutes before the first step.
  static constexpr int64_t kMaxVocab = int64_t{1} << 18;
  // The table draws vocab x fanout successors: at most what the largest vocab draws at the
  // default fanout, so that a large fanout cannot stall the set-up either.
  static constexpr int64_t kMaxTableDraws = kMaxVocab * 4;
  // The largest fanout for `vocab`: kMaxTableDraws / vocab (many more than vocab successors
  // merely draw the same ones again).
  static int64_t max_fanout(int64_t vocab) { return kMaxTableDraws / vocab; }
  // The draws that walk the chain: the training walk's, or those of a stream of their own for
  // held-out data: the same chain (table, stationary distribution, entropy), another walk, so
  // no stretch of training tokens is evaluated on however long the run.
  enum class Walk { training, held_out };
  // Throws std::invalid_argument for a vocab outside [2, kMaxVocab] or a fanout outside
  // [1, max_fanout(vocab)].
  static constexpr int kDefaultFanout = 4;
  MarkovSource(int64_t vocab, uint64_t seed, int fanout = kDefaultFanout,
               Walk walk = Walk::training);
  int64_t vocab() const override { return vocab_; }
  void next(int32_t* inputs, int32_t* targets, int64_t n) override;
  uint64_t position() const override { return position_; }
  void seek(uint64_t position) override;  // replays the chain from the start: O(position)
  std::optional<int32_t> current_token() const override { return current_; }
  // O(1) with a token; throws std::invalid_argument if it is not in [0, vocab).
  void restore(uint64_t position, std::optional<int32_t> token) override;
  std::string describe() const override;
  std::optional<double> entropy() const override { return entropy_; }

  // Successors of `state` and their probabilities (duplicates merged).
  // Throws std::out_of_range for a state outside the vocabulary.
  const std::vector<std::pair<int32_t, double>>& row(int32_t state) const;

 private:
  int32_t step_from(int32_t state, uint64_t t) const;  // with the draw of position t
  int32_t step_with(int32_t state, float u) const;     // with the uniform draw u
  void compute_entropy();

  int64_t vocab_;
  uint64_t seed_;
  int fanout_;
  Walk walk_;
  std::vector<std::vector<std::pair<int32_t, double>>> rows_;
  std::vector<std::vector<float>> cdf_;  // per row, cumulative probabilities in row order
  double entropy_ = 0.0;
  uint64_t position_ = 0;
  int32_t current_ = 0;
};

// Byte-level tokens (vocab 256) of a file, read in order as (byte, next byte) pairs, from the
// first pair again after the last (a position counts pairs). The file
// must be a regular file of at most kMaxBytes (it is held in memory, once: a copy of the source
// shares the bytes read, and draws them whatever the file holds since).
class FileSource : public TokenSource {
 public:
  static constexpr uint64_t kMaxBytes = uint64_t{1} << 30;
  // Throws InputFileError (engine/schedule/input_file.h) naming the file if it is unusable.
  explicit FileSource(const std::string& path);
  int64_t vocab() const override { return 256; }
  void next(int32_t* inputs, int32_t* targets, int64_t n) override;
  uint64_t position() const override { return position_; }
  void seek(uint64_t position) override { position_ = position; }
  std::string describe() const override;
  // XXH3-64 (seed 0) of the file's bytes, taken once when it is read (a 1 GiB file in about a
  // tenth of a second).
  std::optional<std::string> contents_digest() const override { return contents_digest_; }
  // Entropy (nats/byte) of the file's byte frequencies: what a model that ignores context
  // reaches, a reference for the loss.
  double unigram_entropy() const { return unigram_entropy_; }
  // The file's length: its tokens, the last of which is only a target.
  uint64_t bytes() const { return bytes_->size(); }

 private:
  std::string path_;
  std::string contents_digest_;
  double unigram_entropy_ = 0.0;
  std::shared_ptr<const std::string> bytes_;
  uint64_t position_ = 0;
};

}  // namespace conveyor
