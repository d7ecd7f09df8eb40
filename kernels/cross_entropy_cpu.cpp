// CPU fused softmax + cross-entropy. Per row: the max, then exp(x - max) written into the
// dlogits row while Σ accumulates in double, the loss logsumexp - x[target], and a last pass
// that turns the row into (softmax - onehot) * grad_scale. Each element is read before it is
// written and x[target] is kept aside first, so dlogits may alias logits; no separate buffer
// of probabilities exists.
//
// Rows are independent tasks on the pool. Within a row the exponentials are packets of eight
// (cpu_packet.h) and Σ has eight double lanes added in a fixed order at the end: the bits
// depend on the row alone, never on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/cpu_check.h"
#include "kernels/cpu_packet.h"
#include "kernels/cross_entropy.h"
#include "kernels/thread_pool.h"

namespace conveyor::kernels::cpu {
namespace {

using detail::for_each_group;
using detail::Group;
using detail::kGroup;
using detail::load_group;
using detail::store_group;
using Lanes = Eigen::Array<double, kGroup, 1>;

// Rows per pool task: enough work per task to outweigh handing it out.
constexpr int64_t kElementsPerTask = 16384;

float row_max(const float* row, int64_t vocab) {
  Group mx = Group::Constant(-std::numeric_limits<float>::infinity());
  for_each_group(0, vocab, [&](int64_t j, int64_t count) CONVEYOR_INLINE {
    mx = mx.max(load_group(row + j, count, -std::numeric_limits<float>::infinity()));
  });
  return mx.maxCoeff();
}

// One row: returns the loss and leaves (softmax - onehot) * grad_scale in drow.
float softmax_row(float* drow, const float* row, int32_t target, int64_t vocab, float grad_scale) {
  const float target_logit = row[target];  // read before the row may be overwritten
  const float mx = row_max(row, vocab);
  // The exponentials go straight into dlogits, then get normalised.
  Lanes lanes = Lanes::Zero();
  for_each_group(0, vocab, [&](int64_t j, int64_t count) CONVEYOR_INLINE {
    Group e = (load_group(row + j, count) - mx).exp();
    for (int64_t l = count; l < kGroup; ++l) e[l] = 0.0f;  // the padding adds nothing
    lanes += e.cast<double>();
    store_group(drow + j, e, count);
  });
  double s = 0.0;
  for (int64_t l = 0; l < kGroup; ++l) s += lanes[l];
  const float inv_s = static_cast<float>(1.0 / s);
  const float e_target = drow[target];
  for_each_group(0, vocab, [&](int64_t j, int64_t count) CONVEYOR_INLINE {
    store_group(drow + j, load_group(drow + j, count) * inv_s * grad_scale, count);
  });
  drow[target] = (e_target * inv_s - 1.0f) * grad_scale;
  return static_cast<float>(std::log(s) + mx - static_cast<double>(target_logit));
}

}  // namespace

void softmax_cross_entropy(float* losses, float* dlogits, const float* logits,
                           const int32_t* targets, int64_t n, int64_t vocab, int32_t ignore_index,
                           float grad_scale, ThreadPool* pool) {
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
  const int64_t rows_per_task = std::max<int64_t>(1, kElementsPerTask / vocab);
  parallel_for(pool, (n + rows_per_task - 1) / rows_per_task, [&](int64_t task) {
    const int64_t last = std::min(n, (task + 1) * rows_per_task);
    for (int64_t i = task * rows_per_task; i < last; ++i) {
      float* drow = dlogits + i * vocab;
      if (targets[i] == ignore_index) {
        losses[i] = 0.0f;
        std::fill(drow, drow + vocab, 0.0f);
        continue;
      }
      losses[i] = softmax_row(drow, logits + i * vocab, targets[i], vocab, grad_scale);
    }
  });
}

}  // namespace conveyor::kernels::cpu
