#pragma once
// Token embedding: y[i, :] = table[tokens[i], :], table [vocab, c]. Backward accumulates
// (`+=`) into dtable in a fixed order per vocabulary row (ascending token position), with no
// floating-point atomics, so it is deterministic. Token ids must lie in [0, vocab); callers
// validate them (the data sources do), the CPU kernels also check and throw.
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

void embedding_forward(float* y, const int32_t* tokens, const float* table, int64_t n, int64_t c,
                       int64_t vocab);
void embedding_backward(float* dtable, const float* dy, const int32_t* tokens, int64_t n, int64_t c,
                        int64_t vocab);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void embedding_forward(const CudaContext& ctx, float* y, const int32_t* tokens, const float* table,
                       int64_t n, int64_t c, int64_t vocab);
// `scratch` is device memory of at least embedding_backward_scratch_bytes(n) bytes.
size_t embedding_backward_scratch_bytes(int64_t n);
void embedding_backward(const CudaContext& ctx, float* dtable, const float* dy,
                        const int32_t* tokens, int64_t n, int64_t c, int64_t vocab, void* scratch);

}  // namespace conveyor::kernels::cuda
#endif
