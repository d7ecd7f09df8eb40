// CPU linear layer through Eigen GEMMs on row-major maps. Single-threaded (Eigen is built
// without OpenMP here) and deterministic: Eigen's blocking depends only on the shapes and
// the cache sizes of the machine, so the same inputs give the same bits on every run.
// Gradient convention: y and dx are written (`=`), dW and db accumulate (`+=`).
#include <Eigen/Core>
#include <vector>

#include "kernels/cpu_check.h"
#include "kernels/linear.h"

namespace conveyor::kernels::cpu {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;
using ConstMatrixMap = Eigen::Map<const Matrix>;
using ConstRowVectorMap = Eigen::Map<const Eigen::RowVectorXf>;

}  // namespace

void linear_forward(float* y, const float* x, const float* weight, const float* bias, int64_t n,
                    int64_t in, int64_t out) {
  detail::require_at_least("linear_forward", "n", n, 0);
  detail::require_at_least("linear_forward", "in", in, 0);
  detail::require_at_least("linear_forward", "out", out, 0);
  ConstMatrixMap X(x, n, in);
  ConstMatrixMap W(weight, out, in);
  MatrixMap Y(y, n, out);
  Y.noalias() = X * W.transpose();
  if (bias != nullptr) Y.rowwise() += ConstRowVectorMap(bias, out);
}

void linear_backward_input(float* dx, const float* dy, const float* weight, int64_t n, int64_t in,
                           int64_t out) {
  detail::require_at_least("linear_backward_input", "n", n, 0);
  detail::require_at_least("linear_backward_input", "in", in, 0);
  detail::require_at_least("linear_backward_input", "out", out, 0);
  ConstMatrixMap dY(dy, n, out);
  ConstMatrixMap W(weight, out, in);
  MatrixMap dX(dx, n, in);
  dX.noalias() = dY * W;
}

void linear_backward_weight(float* dweight, float* dbias, const float* dy, const float* x,
                            int64_t n, int64_t in, int64_t out) {
  detail::require_at_least("linear_backward_weight", "n", n, 0);
  detail::require_at_least("linear_backward_weight", "in", in, 0);
  detail::require_at_least("linear_backward_weight", "out", out, 0);
  ConstMatrixMap dY(dy, n, out);
  ConstMatrixMap X(x, n, in);
  MatrixMap dW(dweight, out, in);
  dW.noalias() += dY.transpose() * X;
  if (dbias != nullptr) {
    // Column sums in double, rows in ascending order, added once to the float gradient.
    std::vector<double> acc(static_cast<size_t>(out), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const float* row = dy + i * out;
      for (int64_t j = 0; j < out; ++j) acc[j] += static_cast<double>(row[j]);
    }
    for (int64_t j = 0; j < out; ++j) dbias[j] += static_cast<float>(acc[j]);
  }
}

}  // namespace conveyor::kernels::cpu
