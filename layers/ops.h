#pragma once
// Tensor-level entry points to the kernels: check shapes, dtypes and devices, then call the
// CPU or CUDA kernel of the same name. Layers call these, never the backends directly.
// Convention as in kernels/: outputs and input gradients are written (`=`), parameter
// gradients accumulate (`+=`).
// Every op checks its tensor operands before it runs: an operand that is undefined, or has
// the wrong dtype, shape (or rank) or device, throws std::invalid_argument with a sentence
// naming the operand (e.g. "linear weight", "layernorm rstd"), what was expected and what
// was seen. The linear ops (GEMMs, which read their inputs while they write) also refuse an
// output that shares memory with an input. The activation ops refuse an ActivationKind cast from
// outside the enum, and layernorm_forward an eps that is not a finite number above 0.
#include <cstdint>
#include <string_view>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/core/tensor.h"
#include "kernels/optimizer.h"

namespace conveyor::ops {

// x [n, in], weight [out, in], bias [out] or undefined -> y [n, out]
void linear_forward(DeviceContext& ctx, const Tensor& y, const Tensor& x, const Tensor& weight,
                    const Tensor& bias);
void linear_backward_input(DeviceContext& ctx, const Tensor& dx, const Tensor& dy,
                           const Tensor& weight);
void linear_backward_weight(DeviceContext& ctx, const Tensor& dweight, const Tensor& dbias,
                            const Tensor& dy, const Tensor& x);

enum class ActivationKind { kGelu, kRelu };
ActivationKind parse_activation(std::string_view name);  // "gelu" | "relu"
const char* activation_name(ActivationKind kind);
void activation_forward(DeviceContext& ctx, ActivationKind kind, const Tensor& y, const Tensor& x);
void activation_backward(DeviceContext& ctx, ActivationKind kind, const Tensor& dx,
                         const Tensor& dy, const Tensor& x);

// x [n, c] -> y [n, c], mean [n], rstd [n]
void layernorm_forward(DeviceContext& ctx, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                       const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps);
void layernorm_backward_input(DeviceContext& ctx, const Tensor& dx, const Tensor& dy,
                              const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& gamma);
void layernorm_backward_weight(DeviceContext& ctx, const Tensor& dgamma, const Tensor& dbeta,
                               const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& rstd);

// tokens [n] (i32), table [vocab, c] -> y [n, c]
void embedding_forward(DeviceContext& ctx, const Tensor& y, const Tensor& tokens,
                       const Tensor& table);
void embedding_backward(DeviceContext& ctx, const Tensor& dtable, const Tensor& dy,
                        const Tensor& tokens);

// logits [n, vocab], targets [n] (i32) -> losses [n], dlogits [n, vocab] (may be logits)
void softmax_cross_entropy(DeviceContext& ctx, const Tensor& losses, const Tensor& dlogits,
                           const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                           float grad_scale);

// Σ x and Σ x² over a float tensor, in double, deterministic. These synchronise.
double sum(DeviceContext& ctx, const Tensor& x);
double sum_squares(DeviceContext& ctx, const Tensor& x);
// The same over many tensors, with one synchronisation for all (on CUDA the results gather
// in one device buffer and come back in one copy). Each result equals the one-tensor call.
std::vector<double> sum_each(DeviceContext& ctx, const std::vector<Tensor>& xs);
std::vector<double> sum_squares_each(DeviceContext& ctx, const std::vector<Tensor>& xs);
void add_(DeviceContext& ctx, const Tensor& y, const Tensor& x);  // y += x (same shape)

void adamw_update(DeviceContext& ctx, const std::vector<kernels::OptimizerTensor>& tensors,
                  const kernels::AdamWParams& params);
void sgd_update(DeviceContext& ctx, const std::vector<kernels::OptimizerTensor>& tensors,
                const kernels::SgdParams& params);

void init_uniform(DeviceContext& ctx, const Tensor& out, uint64_t seed, uint64_t key, float low,
                  float high);
void fill(DeviceContext& ctx, const Tensor& out, float value);

}  // namespace conveyor::ops
