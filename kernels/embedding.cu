// Token embedding on CUDA. Forward writes y (`=`); backward accumulates into dtable (`+=`).
//
// Backward is deterministic without atomics: a stable radix sort of (token, position) pairs
// groups the positions of each token in ascending order; then one block per group adds the
// rows of dy into dtable[token] in that order, starting from dtable's current value. That is
// the same sequence of float additions as the CPU loop over positions, so the two backends
// agree bit for bit when each addition is exactly rounded.
// Token ids must lie in [0, vocab) (callers validate); the kernels never read or write out of
// bounds for bad ids: forward writes NaN rows, backward skips them.
#include <climits>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda_util.cuh"
#include "kernels/embedding.h"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kBlock = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

template <bool kVec>
__global__ void embedding_forward_kernel(float* __restrict__ y, const int32_t* __restrict__ tokens,
                                         const float* __restrict__ table, int64_t n, int64_t c,
                                         int64_t vocab) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const int32_t token = tokens[row];
    float* yr = y + row * c;
    if (token < 0 || token >= vocab) {
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) yr[j] = __int_as_float(0x7fc00000);
      continue;
    }
    const float* tr = table + static_cast<int64_t>(token) * c;
    if constexpr (kVec) {
      const float4* t4 = reinterpret_cast<const float4*>(tr);
      float4* y4 = reinterpret_cast<float4*>(yr);
      for (int64_t j = threadIdx.x; j < c / 4; j += blockDim.x) y4[j] = t4[j];
    } else {
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) yr[j] = tr[j];
    }
  }
}

// Sort keys and positions: a token outside [0, vocab) becomes `invalid_key`, a value no
// valid token has. The sort looks only at the low end_bit bits, so a raw bad id (e.g. -1 or
// vocab + 1) could share its low bits with a valid id and land inside that id's run, cutting
// it in two: two blocks would then read-modify-write the same dtable row (a race).
__global__ void prepare_sort_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ positions,
                                    const int32_t* __restrict__ tokens, int64_t n, int64_t vocab,
                                    uint32_t invalid_key) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int32_t token = tokens[i];
    keys[i] = token >= 0 && token < vocab ? static_cast<uint32_t>(token) : invalid_key;
    positions[i] = static_cast<int32_t>(i);
  }
}

// Block b handles sorted index i = b, b + grid, ... when i starts a run of equal tokens.
__global__ void embedding_segment_sum_kernel(float* __restrict__ dtable,
                                             const float* __restrict__ dy,
                                             const uint32_t* __restrict__ keys,
                                             const int32_t* __restrict__ positions, int64_t n,
                                             int64_t c, int64_t vocab, uint32_t invalid_key) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const uint32_t key = keys[i];
    if (i > 0 && keys[i - 1] == key) continue;  // not the start of a run (block-uniform)
    if (key == invalid_key || key >= static_cast<uint64_t>(vocab)) continue;
    int64_t end = i + 1;
    while (end < n && keys[end] == key) ++end;
    float* row = dtable + static_cast<int64_t>(key) * c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      float acc = row[j];
      for (int64_t k = i; k < end; ++k) acc += dy[static_cast<int64_t>(positions[k]) * c + j];
      row[j] = acc;
    }
  }
}

size_t sort_temp_bytes(int n, int end_bit) {
  size_t bytes = 0;
  CONVEYOR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, 0, end_bit));
  return bytes;
}

void check_rows(int64_t n) {
  detail::require(n <= INT_MAX,
                  "embedding_backward: at most 2^31-1 tokens per call, got " + std::to_string(n));
}

}  // namespace

void embedding_forward(const CudaContext& ctx, float* y, const int32_t* tokens, const float* table,
                       int64_t n, int64_t c, int64_t vocab) {
  detail::require_nonnegative("embedding_forward", "n", n);
  detail::require_nonnegative("embedding_forward", "c", c);
  detail::require_nonnegative("embedding_forward", "vocab", vocab);
  if (n == 0 || c == 0) return;
  const unsigned grid = detail::grid_for(n, 1);
  const bool vec = c % 4 == 0 && detail::aligned16(y) && detail::aligned16(table);
  const int block = static_cast<int>(std::min<int64_t>(kBlock, ((vec ? c / 4 : c) + 31) / 32 * 32));
  if (vec)
    embedding_forward_kernel<true><<<grid, block, 0, ctx.stream>>>(y, tokens, table, n, c, vocab);
  else
    embedding_forward_kernel<false><<<grid, block, 0, ctx.stream>>>(y, tokens, table, n, c, vocab);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

size_t embedding_backward_scratch_bytes(int64_t n) {
  detail::require_nonnegative("embedding_backward_scratch_bytes", "n", n);
  if (n == 0) return 0;
  check_rows(n);
  const size_t items = static_cast<size_t>(n);
  return 4 * align_up(items * sizeof(int32_t)) + align_up(sort_temp_bytes(static_cast<int>(n), 32));
}

void embedding_backward(const CudaContext& ctx, float* dtable, const float* dy,
                        const int32_t* tokens, int64_t n, int64_t c, int64_t vocab, void* scratch) {
  detail::require_nonnegative("embedding_backward", "n", n);
  detail::require_nonnegative("embedding_backward", "c", c);
  detail::require_nonnegative("embedding_backward", "vocab", vocab);
  if (n == 0 || c == 0) return;
  check_rows(n);
  detail::require(scratch != nullptr,
                  "embedding_backward: scratch is null; allocate "
                  "embedding_backward_scratch_bytes(n) bytes");
  const int items = static_cast<int>(n);
  const size_t array_bytes = align_up(static_cast<size_t>(n) * sizeof(int32_t));
  char* base = static_cast<char*>(scratch);
  auto* keys_in = reinterpret_cast<uint32_t*>(base);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + array_bytes);
  auto* positions_in = reinterpret_cast<int32_t*>(base + 2 * array_bytes);
  auto* positions_out = reinterpret_cast<int32_t*>(base + 3 * array_bytes);
  void* temp = base + 4 * array_bytes;
  size_t temp_bytes = sort_temp_bytes(items, 32);  // what the scratch was sized for

  // Sort only the bits that ids in [0, vocab] need (fewer radix passes): `vocab` itself is
  // the key of bad ids, so it must fit in end_bit bits too.
  int end_bit = 1;
  while (end_bit < 32 && (uint64_t{1} << end_bit) <= static_cast<uint64_t>(vocab)) ++end_bit;
  if (end_bit < 32 && sort_temp_bytes(items, end_bit) > temp_bytes) end_bit = 32;
  const uint32_t invalid_key =
      end_bit < 32 ? static_cast<uint32_t>(vocab) : 0xffffffffu;  // no valid int32 id has it

  prepare_sort_kernel<<<detail::grid_for(n, kBlock), kBlock, 0, ctx.stream>>>(
      keys_in, positions_in, tokens, n, vocab, invalid_key);
  CONVEYOR_CUDA_CHECK_LAUNCH();
  CONVEYOR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out,
                                                      positions_in, positions_out, items, 0,
                                                      end_bit, ctx.stream));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, detail::kFixedSmCount * 16));
  const int block = static_cast<int>(std::min<int64_t>(kBlock, (c + 31) / 32 * 32));
  embedding_segment_sum_kernel<<<grid, block, 0, ctx.stream>>>(dtable, dy, keys_out, positions_out,
                                                               n, c, vocab, invalid_key);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

}  // namespace conveyor::kernels::cuda
