// CPU linear layer through Eigen GEMMs on row-major maps, deterministic: the output is cut
// into tiles whose bounds depend only on the shapes, each tile is one single-threaded Eigen
// GEMM over the whole reduction (Eigen's blocking depends only on the tile's shape and the
// machine's cache sizes), and tiles run on the context's pool. Work is split by output ranges
// only, never by reduction order, so every thread count gives the same bits.
// Gradient convention: y and dx are written (`=`), dW and db accumulate (`+=`).
#define EIGEN_DONT_PARALLELIZE
#include <Eigen/Core>
#include <algorithm>
#include <vector>

#include "kernels/cpu_check.h"
#include "kernels/linear.h"
#include "kernels/thread_pool.h"

namespace conveyor::kernels::cpu {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;
using ConstMatrixMap = Eigen::Map<const Matrix>;
using ConstRowVectorMap = Eigen::Map<const Eigen::RowVectorXf>;

// Tiles of the output. Every tile packs its own operand panels, so the weights of a forward
// tile are packed again for each row tile: rows 512 tall keep packing near a seventh of the
// GEMM time at one thread (128-row tiles spent a quarter of it there on a d=256, 1024-token
// micro-batch), while a 1024-token micro-batch still splits into two or more tiles.
constexpr int64_t kTileRows = 512;
constexpr int64_t kTileCols = 512;
// Below this many multiply-adds a GEMM is one tile: handing it to the pool costs more.
constexpr int64_t kMinSplitMacs = int64_t{1} << 20;

struct Tiling {
  int64_t rows, cols;            // output extent
  int64_t tile_rows, tile_cols;  // tile extent
  int64_t row_tiles, col_tiles;

  int64_t count() const { return row_tiles * col_tiles; }
};

Tiling tile_output(int64_t rows, int64_t cols, int64_t reduction) {
  Tiling t{rows, cols, rows, cols, 1, 1};
  if (rows * cols * reduction < kMinSplitMacs) return t;
  t.tile_rows = std::min(rows, kTileRows);
  t.tile_cols = std::min(cols, kTileCols);
  t.row_tiles = (rows + t.tile_rows - 1) / t.tile_rows;
  t.col_tiles = (cols + t.tile_cols - 1) / t.tile_cols;
  return t;
}

// f(r0, rn, c0, cn) for every tile, across the pool.
template <class F>
void for_each_tile(ThreadPool* pool, const Tiling& t, F&& f) {
  parallel_for(pool, t.count(), [&](int64_t i) {
    const int64_t r0 = (i / t.col_tiles) * t.tile_rows;
    const int64_t c0 = (i % t.col_tiles) * t.tile_cols;
    f(r0, std::min(t.tile_rows, t.rows - r0), c0, std::min(t.tile_cols, t.cols - c0));
  });
}

}  // namespace

void linear_forward(float* y, const float* x, const float* weight, const float* bias, int64_t n,
                    int64_t in, int64_t out, ThreadPool* pool) {
  detail::require_at_least("linear_forward", "n", n, 0);
  detail::require_at_least("linear_forward", "in", in, 0);
  detail::require_at_least("linear_forward", "out", out, 0);
  ConstMatrixMap X(x, n, in);
  ConstMatrixMap W(weight, out, in);
  MatrixMap Y(y, n, out);
  for_each_tile(pool, tile_output(n, out, in), [&](int64_t r0, int64_t rn, int64_t c0, int64_t cn) {
    auto tile = Y.block(r0, c0, rn, cn);
    const auto product = X.middleRows(r0, rn) * W.middleRows(c0, cn).transpose();
    if (bias == nullptr) {
      tile.noalias() = product;
      return;
    }
    // The bias first, then the product accumulated onto it: the pass that `=` would spend
    // zeroing the tile, and a second pass adding the bias, become one.
    tile.rowwise() = ConstRowVectorMap(bias + c0, cn);
    tile.noalias() += product;
  });
}

void linear_backward_input(float* dx, const float* dy, const float* weight, int64_t n, int64_t in,
                           int64_t out, ThreadPool* pool) {
  detail::require_at_least("linear_backward_input", "n", n, 0);
  detail::require_at_least("linear_backward_input", "in", in, 0);
  detail::require_at_least("linear_backward_input", "out", out, 0);
  ConstMatrixMap dY(dy, n, out);
  ConstMatrixMap W(weight, out, in);
  MatrixMap dX(dx, n, in);
  for_each_tile(pool, tile_output(n, in, out), [&](int64_t r0, int64_t rn, int64_t c0, int64_t cn) {
    dX.block(r0, c0, rn, cn).noalias() = dY.middleRows(r0, rn) * W.middleCols(c0, cn);
  });
}

void linear_backward_weight(float* dweight, float* dbias, const float* dy, const float* x,
                            int64_t n, int64_t in, int64_t out, ThreadPool* pool) {
  detail::require_at_least("linear_backward_weight", "n", n, 0);
  detail::require_at_least("linear_backward_weight", "in", in, 0);
  detail::require_at_least("linear_backward_weight", "out", out, 0);
  ConstMatrixMap dY(dy, n, out);
  ConstMatrixMap X(x, n, in);
  MatrixMap dW(dweight, out, in);
  const Tiling tiling = tile_output(out, in, n);
  for_each_tile(pool, tiling, [&](int64_t r0, int64_t rn, int64_t c0, int64_t cn) {
    dW.block(r0, c0, rn, cn).noalias() += dY.middleCols(r0, rn).transpose() * X.middleCols(c0, cn);
    // The bias gradient of output rows [r0, r0 + rn) goes with their first column tile.
    if (dbias == nullptr || c0 != 0) return;
    // Column sums in double, rows in ascending order, added once to the float gradient.
    double acc[kTileRows];
    std::vector<double> wide;  // only for an untiled GEMM wider than a tile
    double* sums = acc;
    if (rn > kTileRows) {
      wide.assign(static_cast<size_t>(rn), 0.0);
      sums = wide.data();
    } else {
      std::fill(acc, acc + rn, 0.0);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* row = dy + i * out + r0;
      for (int64_t j = 0; j < rn; ++j) sums[j] += static_cast<double>(row[j]);
    }
    for (int64_t j = 0; j < rn; ++j) dbias[r0 + j] += static_cast<float>(sums[j]);
  });
}

}  // namespace conveyor::kernels::cpu
