// CPU LayerNorm over the last dimension. Row statistics and the backward reductions are
// accumulated in double, in a fixed order, so they are accurate and reproducible. Row sums
// use kLanes independent partial sums (lane j mod kLanes, then the lanes in order): a single
// double accumulator is a serial chain of dependent adds that the compiler may not reorder,
// and it made the forward the slowest pass of the block. Rows run in fixed blocks on the
// pool; the column reductions of the weight gradient run in fixed column blocks, each over
// all rows in ascending order, so the bits do not depend on the thread count.
// dx is written (`=`); dgamma and dbeta accumulate (`+=`).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu_check.h"
#include "kernels/cpu_packet.h"
#include "kernels/layernorm.h"
#include "kernels/thread_pool.h"

namespace conveyor::kernels::cpu {
namespace {

using detail::for_each_group;
using detail::Group;
using detail::load_group;
using detail::store_group;

constexpr int64_t kLanes = detail::kGroup;
using Lanes = Eigen::Array<double, kLanes, 1>;
constexpr int64_t kRowsPerTask = 64;
constexpr int64_t kColsPerTask = 64;

double add_lanes(const double* lanes) {
  double s = 0.0;
  for (int64_t l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

// f(first, count) over [0, total) in blocks of `block`, across the pool.
template <class F>
void for_each_block(ThreadPool* pool, int64_t total, int64_t block, F&& f) {
  const int64_t blocks = (total + block - 1) / block;
  parallel_for(pool, blocks, [&](int64_t b) {
    const int64_t first = b * block;
    f(first, std::min(block, total - first));
  });
}

void forward_row(float* yr, float* mean, float* rstd, const float* xr, const float* gamma,
                 const float* beta, int64_t c, float eps) {
  // Two passes (mean, then squared deviations) avoid the cancellation of E[x²] - E[x]².
  double s[kLanes] = {};
  const int64_t whole = c - c % kLanes;
  for (int64_t j = 0; j < whole; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) s[l] += xr[j + l];
  for (int64_t j = whole; j < c; ++j) s[j - whole] += xr[j];
  const double mu = add_lanes(s) / static_cast<double>(c);
  double ss[kLanes] = {};
  for (int64_t j = 0; j < whole; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const double d = xr[j + l] - mu;
      ss[l] += d * d;
    }
  for (int64_t j = whole; j < c; ++j) {
    const double d = xr[j] - mu;
    ss[j - whole] += d * d;
  }
  const double var = add_lanes(ss) / static_cast<double>(c);
  const float m = static_cast<float>(mu);
  const float r = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(eps)));
  for (int64_t j = 0; j < c; ++j) yr[j] = (xr[j] - m) * r * gamma[j] + beta[j];
  *mean = m;
  *rstd = r;
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * gamma. In packets of
// eight (cpu_packet.h), the sums in eight double lanes; padding (dy = 0) adds nothing.
void backward_input_row(float* dxr, const float* dyr, const float* xr, float m, float r,
                        const float* gamma, int64_t c) {
  Lanes sum_g = Lanes::Zero();
  Lanes sum_gx = Lanes::Zero();
  for_each_group(0, c, [&](int64_t j, int64_t count) CONVEYOR_INLINE {
    const Group xhat = (load_group(xr + j, count) - m) * r;
    const Group g = load_group(dyr + j, count) * load_group(gamma + j, count);
    sum_g += g.cast<double>();
    sum_gx += g.cast<double>() * xhat.cast<double>();
  });
  const float mean_g = static_cast<float>(add_lanes(sum_g.data()) / static_cast<double>(c));
  const float mean_gx = static_cast<float>(add_lanes(sum_gx.data()) / static_cast<double>(c));
  // dx may not alias dy or x here, but each element is read before it is written anyway.
  for_each_group(0, c, [&](int64_t j, int64_t count) CONVEYOR_INLINE {
    const Group xhat = (load_group(xr + j, count) - m) * r;
    const Group g = load_group(dyr + j, count) * load_group(gamma + j, count);
    store_group(dxr + j, r * (g - mean_g - xhat * mean_gx), count);
  });
}

}  // namespace

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* gamma,
                       const float* beta, int64_t n, int64_t c, float eps, ThreadPool* pool) {
  detail::require_at_least("layernorm_forward", "n", n, 0);
  detail::require_at_least("layernorm_forward", "c", c, 1);
  for_each_block(pool, n, kRowsPerTask, [&](int64_t first, int64_t rows) {
    for (int64_t i = first; i < first + rows; ++i)
      forward_row(y + i * c, mean + i, rstd + i, x + i * c, gamma, beta, c, eps);
  });
}

void layernorm_backward_input(float* dx, const float* dy, const float* x, const float* mean,
                              const float* rstd, const float* gamma, int64_t n, int64_t c,
                              ThreadPool* pool) {
  detail::require_at_least("layernorm_backward_input", "n", n, 0);
  detail::require_at_least("layernorm_backward_input", "c", c, 1);
  for_each_block(pool, n, kRowsPerTask, [&](int64_t first, int64_t rows) {
    for (int64_t i = first; i < first + rows; ++i)
      backward_input_row(dx + i * c, dy + i * c, x + i * c, mean[i], rstd[i], gamma, c);
  });
}

void layernorm_backward_weight(float* dgamma, float* dbeta, const float* dy, const float* x,
                               const float* mean, const float* rstd, int64_t n, int64_t c,
                               ThreadPool* pool) {
  detail::require_at_least("layernorm_backward_weight", "n", n, 0);
  detail::require_at_least("layernorm_backward_weight", "c", c, 1);
  for_each_block(pool, c, kColsPerTask, [&](int64_t first, int64_t cols) {
    // Each column's sums over all rows in ascending order, whatever the column block.
    double acc_gamma[kColsPerTask] = {};
    double acc_beta[kColsPerTask] = {};
    for (int64_t i = 0; i < n; ++i) {
      const float* xr = x + i * c + first;
      const float* dyr = dy + i * c + first;
      const float m = mean[i];
      const float r = rstd[i];
      for (int64_t j = 0; j < cols; ++j) {
        const float xhat = (xr[j] - m) * r;
        acc_gamma[j] += static_cast<double>(dyr[j]) * xhat;
        acc_beta[j] += dyr[j];
      }
    }
    for (int64_t j = 0; j < cols; ++j) {
      dgamma[first + j] += static_cast<float>(acc_gamma[j]);
      dbeta[first + j] += static_cast<float>(acc_beta[j]);
    }
  });
}

}  // namespace conveyor::kernels::cpu
