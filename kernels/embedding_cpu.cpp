// CPU token embedding. Every token id is checked before anything is written, so a bad id
// throws std::out_of_range and leaves y / dtable untouched. Backward adds rows in ascending
// token position, which fixes the summation order for repeated tokens.
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu_check.h"
#include "kernels/embedding.h"

namespace conveyor::kernels::cpu {
namespace {

void check_tokens(const char* who, const int32_t* tokens, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw std::out_of_range(std::string(who) + ": token id " + std::to_string(tokens[i]) +
                              " at position " + std::to_string(i) + " is outside [0, " +
                              std::to_string(vocab) + "); check the data's vocabulary size");
  }
}

}  // namespace

void embedding_forward(float* y, const int32_t* tokens, const float* table, int64_t n, int64_t c,
                       int64_t vocab) {
  detail::require_at_least("embedding_forward", "n", n, 0);
  detail::require_at_least("embedding_forward", "c", c, 0);
  detail::require_at_least("embedding_forward", "vocab", vocab, 0);
  check_tokens("embedding_forward", tokens, n, vocab);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(y + i * c, table + static_cast<int64_t>(tokens[i]) * c,
                static_cast<size_t>(c) * sizeof(float));
}

void embedding_backward(float* dtable, const float* dy, const int32_t* tokens, int64_t n, int64_t c,
                        int64_t vocab) {
  detail::require_at_least("embedding_backward", "n", n, 0);
  detail::require_at_least("embedding_backward", "c", c, 0);
  detail::require_at_least("embedding_backward", "vocab", vocab, 0);
  check_tokens("embedding_backward", tokens, n, vocab);
  for (int64_t i = 0; i < n; ++i) {
    float* row = dtable + static_cast<int64_t>(tokens[i]) * c;
    const float* g = dy + i * c;
    for (int64_t j = 0; j < c; ++j) row[j] += g[j];
  }
}

}  // namespace conveyor::kernels::cpu
