#pragma once
// Fused softmax + cross-entropy over logits [n, vocab] and targets [n].
// One call computes each row's loss (-log softmax[target], 0 for ignored rows) into
// `losses[n]` and writes dlogits = (softmax - onehot(target)) * grad_scale (0 for ignored
// rows). dlogits may alias logits (written in place); probabilities are never stored.
// `grad_scale` is typically 1 / (valid tokens of the whole optimizer step), so gradients of
// several micro-batches add up to the gradient of the step's mean loss.
#include <cstdint>

#include "kernels/cuda_context.h"

namespace conveyor::kernels::cpu {

class ThreadPool;

// `pool` (may be null: one thread) runs blocks of rows.
void softmax_cross_entropy(float* losses, float* dlogits, const float* logits,
                           const int32_t* targets, int64_t n, int64_t vocab, int32_t ignore_index,
                           float grad_scale, ThreadPool* pool = nullptr);

}  // namespace conveyor::kernels::cpu

#ifdef CONVEYOR_WITH_CUDA
namespace conveyor::kernels::cuda {

void softmax_cross_entropy(const CudaContext& ctx, float* losses, float* dlogits,
                           const float* logits, const int32_t* targets, int64_t n, int64_t vocab,
                           int32_t ignore_index, float grad_scale);

}  // namespace conveyor::kernels::cuda
#endif
