// CPU fused softmax + cross-entropy. Per row: the max, then exp(x - max) written into the
// dlogits row while Σ accumulates in double, the loss logsumexp - x[target], and a last pass
// that turns the row into (softmax - onehot) * grad_scale. Each element is read before it is
// written and x[target] is kept aside first, so dlogits may alias logits; no separate buffer
// of probabilities exists.
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cpu_check.h"
#include "kernels/cross_entropy.h"

namespace conveyor::kernels::cpu {

void softmax_cross_entropy(float* losses, float* dlogits, const float* logits,
                           const int32_t* targets, int64_t n, int64_t vocab, int32_t ignore_index,
                           float grad_scale) {
  detail::require_at_least("softmax_cross_entropy", "n", n, 0);
  detail::require_at_least("softmax_cross_entropy", "vocab", vocab, 1);
  // Validate first so that a bad target leaves every output untouched.
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = targets[i];
    if (t != ignore_index && (t < 0 || t >= vocab))
      throw std::out_of_range("softmax_cross_entropy: target " + std::to_string(t) + " at row " +
                              std::to_string(i) + " is outside [0, " + std::to_string(vocab) +
                              ") and is not the ignore_index " + std::to_string(ignore_index));
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits + i * vocab;
    float* drow = dlogits + i * vocab;
    const int32_t t = targets[i];
    if (t == ignore_index) {
      losses[i] = 0.0f;
      for (int64_t j = 0; j < vocab; ++j) drow[j] = 0.0f;
      continue;
    }
    const float target_logit = row[t];  // read before the row may be overwritten
    float mx = row[0];
    for (int64_t j = 1; j < vocab; ++j) mx = row[j] > mx ? row[j] : mx;
    // The exponentials go straight into dlogits (one expf per element), then get normalised.
    double s = 0.0;
    for (int64_t j = 0; j < vocab; ++j) {
      const float e = std::exp(row[j] - mx);
      drow[j] = e;
      s += e;
    }
    losses[i] = static_cast<float>(std::log(s) + mx - static_cast<double>(target_logit));
    const float inv_s = static_cast<float>(1.0 / s);
    for (int64_t j = 0; j < vocab; ++j)
      drow[j] = (drow[j] * inv_s - (j == t ? 1.0f : 0.0f)) * grad_scale;
  }
}

}  // namespace conveyor::kernels::cpu
