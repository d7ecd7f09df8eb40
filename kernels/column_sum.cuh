#pragma once
// Deterministic column sums of a row-major [n, c] matrix, without atomics (not a public header:
// shared by the .cu files of this folder that accumulate bias-like gradients).
//
// A two-stage reduction over a fixed partition of the rows into chunks. Stage 1 gives each
// block (32, 8) a 32-column tile of one chunk: thread (tx, ty) adds the rows ty, ty + 8, ...
// of the chunk in order, then thread row k of the block adds the 8 thread rows of sum k in
// order and writes one partial per (chunk, column). Stage 2 adds the partials of each column
// in chunk order and accumulates them into the outputs (`+=`). The partition depends only on
// (n, c), never on the device, so the bits depend only on the shape and the data.
//
// A term functor says what is summed: `void operator()(float (&acc)[K], int64_t row,
// int64_t col) const` adds the K terms of element (row, col) to acc[0..K).
#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda_util.cuh"

namespace conveyor::kernels::cuda::detail {

constexpr int kColumnTileCols = 32;
constexpr int kColumnTileRows = 8;

struct ColumnPartition {
  int64_t col_tiles = 0;
  int64_t chunks = 0;
  int64_t rows_per_chunk = 0;
};

// Chunks fill about four waves of an H200; a chunk keeps at least 8 rows per thread row.
inline ColumnPartition column_partition(int64_t n, int64_t c) {
  ColumnPartition p;
  p.col_tiles = (c + kColumnTileCols - 1) / kColumnTileCols;
  int64_t chunks = (4 * kFixedSmCount + p.col_tiles - 1) / p.col_tiles;
  chunks = std::min<int64_t>(chunks, (n + 8 * kColumnTileRows - 1) / (8 * kColumnTileRows));
  chunks = std::max<int64_t>(chunks, 1);
  p.rows_per_chunk = (n + chunks - 1) / chunks;
  p.chunks = (n + p.rows_per_chunk - 1) / p.rows_per_chunk;  // no empty trailing chunk
  return p;
}

// Partials of sum k, chunk `by`, column `col` at partials[(k · chunks + by) · c + col].
template <int K, class Term>
__global__ void column_partials_kernel(float* __restrict__ partials, int64_t n, int64_t c,
                                       int64_t rows_per_chunk, Term term) {
  static_assert(K >= 1 && K <= kColumnTileRows, "one thread row of the tile per sum");
  __shared__ float tile[K][kColumnTileRows][kColumnTileCols + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnTileCols + tx;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(n, r0 + rows_per_chunk);
  float acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.0f;
  if (col < c)
    for (int64_t row = r0 + ty; row < r1; row += kColumnTileRows) term(acc, row, col);
#pragma unroll
  for (int k = 0; k < K; ++k) tile[k][ty][tx] = acc[k];
  __syncthreads();
  if (ty < K && col < c) {
    float s = 0.0f;
    for (int r = 0; r < kColumnTileRows; ++r) s += tile[ty][r][tx];
    partials[(static_cast<int64_t>(ty) * gridDim.y + blockIdx.y) * c + col] = s;
  }
}

template <int K>
struct ColumnOutputs {
  float* out[K];
};

// out[k][col] += Σ_chunks partials of sum k, in chunk order.
template <int K>
__global__ void column_final_kernel(ColumnOutputs<K> outputs, const float* __restrict__ partials,
                                    int64_t c, int chunks) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= c) return;
  float s[K];
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = 0.0f;
  for (int chunk = 0; chunk < chunks; ++chunk) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      s[k] += partials[(static_cast<int64_t>(k) * chunks + chunk) * c + col];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) outputs.out[k][col] += s[k];
}

// outputs.out[k][col] += Σ_rows (term k of (row, col)) for the K sums of `term` over [n, c].
// `kernel` and `width` name the caller and its column count in errors. The partials may take
// ctx's workspace, which stream order makes safe after a GEMM on the same stream.
template <int K, class Term>
void accumulate_column_sums(const CudaContext& ctx, const char* kernel, const char* width,
                            ColumnOutputs<K> outputs, int64_t n, int64_t c, Term term) {
  if (n <= 0 || c <= 0) return;
  const ColumnPartition p = column_partition(n, c);
  require(p.col_tiles <= 0x7fffffff, std::string(kernel) + ": " + width + " must be at most " +
                                         std::to_string(int64_t{0x7fffffff} * kColumnTileCols) +
                                         ", got " + std::to_string(c));
  StreamScratch scratch(ctx, static_cast<size_t>(K * p.chunks * c) * sizeof(float));
  float* partials = scratch.as<float>();
  const dim3 grid1(static_cast<unsigned>(p.col_tiles), static_cast<unsigned>(p.chunks));
  column_partials_kernel<K><<<grid1, dim3(kColumnTileCols, kColumnTileRows), 0, ctx.stream>>>(
      partials, n, c, p.rows_per_chunk, term);
  CONVEYOR_CUDA_CHECK_LAUNCH();
  const unsigned grid2 = static_cast<unsigned>((c + 255) / 256);
  column_final_kernel<K>
      <<<grid2, 256, 0, ctx.stream>>>(outputs, partials, c, static_cast<int>(p.chunks));
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda::detail
