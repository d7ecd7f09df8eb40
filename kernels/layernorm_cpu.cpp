// CPU LayerNorm over the last dimension. Row statistics and the backward reductions are
// accumulated in double, in ascending index order, so they are accurate and reproducible.
// dx is written (`=`); dgamma and dbeta accumulate (`+=`).
#include <cmath>
#include <vector>

#include "kernels/cpu_check.h"
#include "kernels/layernorm.h"

namespace conveyor::kernels::cpu {

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* gamma,
                       const float* beta, int64_t n, int64_t c, float eps) {
  detail::require_at_least("layernorm_forward", "n", n, 0);
  detail::require_at_least("layernorm_forward", "c", c, 1);
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * c;
    float* yr = y + i * c;
    // Two passes (mean, then squared deviations) avoid the cancellation of E[x²] - E[x]².
    double s = 0.0;
    for (int64_t j = 0; j < c; ++j) s += xr[j];
    const double mu = s / static_cast<double>(c);
    double ss = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      const double d = xr[j] - mu;
      ss += d * d;
    }
    const double var = ss / static_cast<double>(c);
    const float m = static_cast<float>(mu);
    const float r = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(eps)));
    for (int64_t j = 0; j < c; ++j) yr[j] = (xr[j] - m) * r * gamma[j] + beta[j];
    mean[i] = m;
    rstd[i] = r;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * gamma.
void layernorm_backward_input(float* dx, const float* dy, const float* x, const float* mean,
                              const float* rstd, const float* gamma, int64_t n, int64_t c) {
  detail::require_at_least("layernorm_backward_input", "n", n, 0);
  detail::require_at_least("layernorm_backward_input", "c", c, 1);
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * c;
    const float* dyr = dy + i * c;
    float* dxr = dx + i * c;
    const float m = mean[i];
    const float r = rstd[i];
    double sum_g = 0.0;
    double sum_gx = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (xr[j] - m) * r;
      const float g = dyr[j] * gamma[j];
      sum_g += g;
      sum_gx += static_cast<double>(g) * xhat;
    }
    const float mean_g = static_cast<float>(sum_g / static_cast<double>(c));
    const float mean_gx = static_cast<float>(sum_gx / static_cast<double>(c));
    // dx may not alias dy or x here, but each element is read before it is written anyway.
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (xr[j] - m) * r;
      const float g = dyr[j] * gamma[j];
      dxr[j] = r * (g - mean_g - xhat * mean_gx);
    }
  }
}

void layernorm_backward_weight(float* dgamma, float* dbeta, const float* dy, const float* x,
                               const float* mean, const float* rstd, int64_t n, int64_t c) {
  detail::require_at_least("layernorm_backward_weight", "n", n, 0);
  detail::require_at_least("layernorm_backward_weight", "c", c, 1);
  std::vector<double> acc_gamma(static_cast<size_t>(c), 0.0);
  std::vector<double> acc_beta(static_cast<size_t>(c), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * c;
    const float* dyr = dy + i * c;
    const float m = mean[i];
    const float r = rstd[i];
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (xr[j] - m) * r;
      acc_gamma[j] += static_cast<double>(dyr[j]) * xhat;
      acc_beta[j] += dyr[j];
    }
  }
  for (int64_t j = 0; j < c; ++j) {
    dgamma[j] += static_cast<float>(acc_gamma[j]);
    dbeta[j] += static_cast<float>(acc_beta[j]);
  }
}

}  // namespace conveyor::kernels::cpu
