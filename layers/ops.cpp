#include "layers/ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/core/enum_value.h"
#include "engine/core/number_text.h"
#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/init.h"
#include "kernels/layernorm.h"
#include "kernels/linear.h"
#include "kernels/optimizer.h"
#include "kernels/reduce.h"
#ifdef CONVEYOR_WITH_CUDA
#include "kernels/cuda_check.h"
#endif

namespace conveyor::ops {
namespace {

// Every tensor an op touches must live on the context's device and hold the expected dtype.
void check_operand(DeviceContext& ctx, const Tensor& t, DType dtype, std::string_view what) {
  check_defined(t, what);
  check_dtype(t, dtype, what);
  check_device(t, ctx.device(), what);
}

// The common case: a float operand of a known shape.
void check_f32(DeviceContext& ctx, const Tensor& t, const Shape& shape, std::string_view what) {
  check_operand(ctx, t, DType::kF32, what);
  check_shape(t, shape, what);
}

// The per-row statistics a layernorm forward saves and its backward reads.
void check_statistics(DeviceContext& ctx, const Tensor& mean, const Tensor& rstd, int64_t n) {
  check_f32(ctx, mean, {n}, "layernorm mean");
  check_f32(ctx, rstd, {n}, "layernorm rstd");
}

// A float operand whose dimensions the op reads, so its rank is checked before any dim().
void check_f32_rank(DeviceContext& ctx, const Tensor& t, int rank, std::string_view what) {
  check_operand(ctx, t, DType::kF32, what);
  if (t.rank() != rank)
    throw std::invalid_argument(std::string(what) + ": expected a " + std::to_string(rank) +
                                "-d tensor, got " + t.describe());
}

// A GEMM reads its inputs while it writes its output, on either backend: an output over an
// input (y = x W written in place) would give wrong values without a word.
void check_apart(const Tensor& out, std::string_view out_what, const Tensor& in,
                 std::string_view in_what) {
  if (!out.defined() || !in.defined()) return;
  const auto begin = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw()); };
  if (begin(out) < begin(in) + in.nbytes() && begin(in) < begin(out) + out.nbytes())
    throw std::invalid_argument(std::string(out_what) + ": shares memory with the " +
                                std::string(in_what) + " " + in.describe() +
                                ", which the op reads while it writes; give the output a tensor "
                                "of its own");
}

// A kind cast from outside the enum would run as ReLU: the kernels test for GELU only.
void check_activation_kind(ActivationKind kind) {
  check_enum_value(kind, {ActivationKind::kGelu, ActivationKind::kRelu}, "activation kind",
                   "ops::ActivationKind::kGelu or kRelu");
}

float* f32(const Tensor& t) { return t.data<float>(); }
const int32_t* i32(const Tensor& t) { return t.data<int32_t>(); }

[[noreturn]] void throw_no_cuda_backend() {
  throw std::logic_error("CUDA context in a build without the CUDA backend");
}

}  // namespace

// Each op names its kernel and writes the kernel's arguments once: on a CPU context this runs
// kernels::cpu::KERNEL(args...), on a CUDA context kernels::cuda::KERNEL(cu, args...). A macro,
// because the two kernels are found by name in two namespaces and, without the CUDA backend,
// the CUDA call must not be compiled at all (a CUDA context cannot exist there).
#ifdef CONVEYOR_WITH_CUDA
#define CONVEYOR_CUDA_CALL(ctx, kernel, ...) \
  ::conveyor::kernels::cuda::kernel((ctx).cuda(), __VA_ARGS__)
#else
#define CONVEYOR_CUDA_CALL(ctx, kernel, ...) throw_no_cuda_backend()
#endif

#define CONVEYOR_DISPATCH(ctx, kernel, ...)          \
  do {                                               \
    if ((ctx).is_cuda())                             \
      CONVEYOR_CUDA_CALL(ctx, kernel, __VA_ARGS__);  \
    else                                             \
      ::conveyor::kernels::cpu::kernel(__VA_ARGS__); \
  } while (0)

// The same for a kernel whose CPU form also takes the context's thread pool last.
#define CONVEYOR_DISPATCH_WITH_POOL(ctx, kernel, ...)                  \
  do {                                                                 \
    if ((ctx).is_cuda())                                               \
      CONVEYOR_CUDA_CALL(ctx, kernel, __VA_ARGS__);                    \
    else                                                               \
      ::conveyor::kernels::cpu::kernel(__VA_ARGS__, (ctx).cpu_pool()); \
  } while (0)

// The same for a kernel whose CUDA form also takes device scratch memory after the shared
// arguments; `scratch_bytes` (an expression of the CUDA backend) is compiled only with it.
#define CONVEYOR_DISPATCH_WITH_SCRATCH(ctx, kernel, scratch_bytes, ...)           \
  do {                                                                            \
    if ((ctx).is_cuda())                                                          \
      CONVEYOR_CUDA_CALL(ctx, kernel, __VA_ARGS__, (ctx).scratch(scratch_bytes)); \
    else                                                                          \
      ::conveyor::kernels::cpu::kernel(__VA_ARGS__);                              \
  } while (0)

void linear_forward(DeviceContext& ctx, const Tensor& y, const Tensor& x, const Tensor& weight,
                    const Tensor& bias) {
  check_f32_rank(ctx, x, 2, "linear input");
  check_f32_rank(ctx, weight, 2, "linear weight");
  const int64_t n = x.dim(0), in = x.dim(1), out = weight.dim(0);
  check_shape(weight, {out, in}, "linear weight");
  check_f32(ctx, y, {n, out}, "linear output");
  const float* b = nullptr;
  if (bias.defined()) {
    check_f32(ctx, bias, {out}, "linear bias");
    b = f32(bias);
  }
  check_apart(y, "linear output", x, "linear input");
  check_apart(y, "linear output", weight, "linear weight");
  check_apart(y, "linear output", bias, "linear bias");
  CONVEYOR_DISPATCH_WITH_POOL(ctx, linear_forward, f32(y), f32(x), f32(weight), b, n, in, out);
}

void linear_backward_input(DeviceContext& ctx, const Tensor& dx, const Tensor& dy,
                           const Tensor& weight) {
  check_f32_rank(ctx, weight, 2, "linear weight");
  const int64_t out = weight.dim(0), in = weight.dim(1);
  check_f32_rank(ctx, dy, 2, "linear output gradient");
  const int64_t n = dy.dim(0);
  check_shape(dy, {n, out}, "linear output gradient");
  check_f32(ctx, dx, {n, in}, "linear input gradient");
  check_apart(dx, "linear input gradient", dy, "linear output gradient");
  check_apart(dx, "linear input gradient", weight, "linear weight");
  CONVEYOR_DISPATCH_WITH_POOL(ctx, linear_backward_input, f32(dx), f32(dy), f32(weight), n, in,
                              out);
}

void linear_backward_weight(DeviceContext& ctx, const Tensor& dweight, const Tensor& dbias,
                            const Tensor& dy, const Tensor& x) {
  check_f32_rank(ctx, dweight, 2, "linear weight gradient");
  const int64_t out = dweight.dim(0), in = dweight.dim(1);
  check_f32_rank(ctx, x, 2, "linear input");
  const int64_t n = x.dim(0);
  check_shape(x, {n, in}, "linear input");
  check_f32(ctx, dy, {n, out}, "linear output gradient");
  float* db = nullptr;
  if (dbias.defined()) {
    check_f32(ctx, dbias, {out}, "linear bias gradient");
    db = f32(dbias);
  }
  for (const auto& [grad, what] :
       {std::pair{dweight, "linear weight gradient"}, std::pair{dbias, "linear bias gradient"}}) {
    check_apart(grad, what, dy, "linear output gradient");
    check_apart(grad, what, x, "linear input");
  }
  CONVEYOR_DISPATCH_WITH_POOL(ctx, linear_backward_weight, f32(dweight), db, f32(dy), f32(x), n, in,
                              out);
}

ActivationKind parse_activation(std::string_view name) {
  if (name == "gelu") return ActivationKind::kGelu;
  if (name == "relu") return ActivationKind::kRelu;
  throw std::invalid_argument("unknown activation '" + std::string(name) +
                              "', expected gelu or relu");
}

const char* activation_name(ActivationKind kind) {
  return kind == ActivationKind::kGelu ? "gelu" : "relu";
}

void activation_forward(DeviceContext& ctx, ActivationKind kind, const Tensor& y, const Tensor& x) {
  check_activation_kind(kind);
  check_operand(ctx, x, DType::kF32, "activation input");
  check_f32(ctx, y, x.shape(), "activation output");
  const int64_t n = x.numel();
  if (kind == ActivationKind::kGelu)
    CONVEYOR_DISPATCH_WITH_POOL(ctx, gelu_forward, f32(y), f32(x), n);
  else
    CONVEYOR_DISPATCH_WITH_POOL(ctx, relu_forward, f32(y), f32(x), n);
}

void activation_backward(DeviceContext& ctx, ActivationKind kind, const Tensor& dx,
                         const Tensor& dy, const Tensor& x) {
  check_activation_kind(kind);
  check_operand(ctx, x, DType::kF32, "activation input");
  check_operand(ctx, dy, DType::kF32, "activation output gradient");
  check_operand(ctx, dx, DType::kF32, "activation input gradient");
  check_shape(dy, x.shape(), "activation output gradient");
  check_shape(dx, x.shape(), "activation input gradient");
  const int64_t n = x.numel();
  if (kind == ActivationKind::kGelu)
    CONVEYOR_DISPATCH_WITH_POOL(ctx, gelu_backward, f32(dx), f32(dy), f32(x), n);
  else
    CONVEYOR_DISPATCH_WITH_POOL(ctx, relu_backward, f32(dx), f32(dy), f32(x), n);
}

void layernorm_forward(DeviceContext& ctx, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                       const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) {
  check_f32_rank(ctx, x, 2, "layernorm input");
  const int64_t n = x.dim(0), c = x.dim(1);
  check_f32(ctx, y, {n, c}, "layernorm output");
  check_statistics(ctx, mean, rstd, n);
  check_f32(ctx, gamma, {c}, "layernorm weight");
  check_f32(ctx, beta, {c}, "layernorm bias");
  // A negative, zero or NaN epsilon gives NaN rows (a constant row divides by 0); an infinite
  // one rows of 0 that learn nothing. The LayerNorm layer refuses it when built; a layer of
  // one's own passes it here.
  if (!(eps > 0.0f) || !std::isfinite(eps))
    throw std::invalid_argument("layernorm eps: expected a finite number above 0, got " +
                                number_text(eps));
  CONVEYOR_DISPATCH_WITH_POOL(ctx, layernorm_forward, f32(y), f32(mean), f32(rstd), f32(x),
                              f32(gamma), f32(beta), n, c, eps);
}

void layernorm_backward_input(DeviceContext& ctx, const Tensor& dx, const Tensor& dy,
                              const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& gamma) {
  check_f32_rank(ctx, x, 2, "layernorm input");
  const int64_t n = x.dim(0), c = x.dim(1);
  check_f32(ctx, dy, {n, c}, "layernorm output gradient");
  check_f32(ctx, dx, {n, c}, "layernorm input gradient");
  check_f32(ctx, gamma, {c}, "layernorm weight");
  check_statistics(ctx, mean, rstd, n);
  CONVEYOR_DISPATCH_WITH_POOL(ctx, layernorm_backward_input, f32(dx), f32(dy), f32(x), f32(mean),
                              f32(rstd), f32(gamma), n, c);
}

void layernorm_backward_weight(DeviceContext& ctx, const Tensor& dgamma, const Tensor& dbeta,
                               const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& rstd) {
  check_f32_rank(ctx, x, 2, "layernorm input");
  const int64_t n = x.dim(0), c = x.dim(1);
  check_f32(ctx, dy, {n, c}, "layernorm output gradient");
  check_f32(ctx, dgamma, {c}, "layernorm weight gradient");
  check_f32(ctx, dbeta, {c}, "layernorm bias gradient");
  check_statistics(ctx, mean, rstd, n);
  CONVEYOR_DISPATCH_WITH_POOL(ctx, layernorm_backward_weight, f32(dgamma), f32(dbeta), f32(dy),
                              f32(x), f32(mean), f32(rstd), n, c);
}

void embedding_forward(DeviceContext& ctx, const Tensor& y, const Tensor& tokens,
                       const Tensor& table) {
  check_operand(ctx, tokens, DType::kI32, "embedding tokens");
  check_f32_rank(ctx, table, 2, "embedding table");
  const int64_t n = tokens.numel(), vocab = table.dim(0), c = table.dim(1);
  check_f32(ctx, y, {n, c}, "embedding output");
  CONVEYOR_DISPATCH(ctx, embedding_forward, f32(y), i32(tokens), f32(table), n, c, vocab);
}

void embedding_backward(DeviceContext& ctx, const Tensor& dtable, const Tensor& dy,
                        const Tensor& tokens) {
  check_operand(ctx, tokens, DType::kI32, "embedding tokens");
  check_f32_rank(ctx, dtable, 2, "embedding table gradient");
  const int64_t n = tokens.numel(), vocab = dtable.dim(0), c = dtable.dim(1);
  check_f32(ctx, dy, {n, c}, "embedding output gradient");
  CONVEYOR_DISPATCH_WITH_SCRATCH(ctx, embedding_backward,
                                 kernels::cuda::embedding_backward_scratch_bytes(n), f32(dtable),
                                 f32(dy), i32(tokens), n, c, vocab);
}

void softmax_cross_entropy(DeviceContext& ctx, const Tensor& losses, const Tensor& dlogits,
                           const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                           float grad_scale) {
  check_f32_rank(ctx, logits, 2, "cross-entropy logits");
  const int64_t n = logits.dim(0), vocab = logits.dim(1);
  check_operand(ctx, targets, DType::kI32, "cross-entropy targets");
  check_shape(targets, {n}, "cross-entropy targets");
  check_f32(ctx, losses, {n}, "cross-entropy losses");
  check_f32(ctx, dlogits, {n, vocab}, "cross-entropy logit gradient");
  // Every gradient is scaled by it: a NaN or infinite one gives a step of NaN, found only at
  // the gradient norm.
  if (!std::isfinite(grad_scale))
    throw std::invalid_argument("cross-entropy grad_scale: expected a finite number, got " +
                                number_text(grad_scale));
  CONVEYOR_DISPATCH_WITH_POOL(ctx, softmax_cross_entropy, f32(losses), f32(dlogits), f32(logits),
                              i32(targets), n, vocab, ignore_index, grad_scale);
}

namespace {
enum class Reduction { Sum, SumSquares };

// The device results of a CUDA reduction back to the host, ordered after the kernels on the
// compute stream: the one synchronisation of the call.
void copy_results_to_host(DeviceContext& ctx, std::vector<double>& results,
                          const Tensor& device_results) {
#ifdef CONVEYOR_WITH_CUDA
  const cudaStream_t stream = ctx.cuda().stream;
  CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(results.data(), device_results.raw(),
                                      results.size() * sizeof(double), cudaMemcpyDeviceToHost,
                                      stream));
  CONVEYOR_CUDA_CHECK(cudaStreamSynchronize(stream));
#else
  throw_no_cuda_backend();
#endif
}

std::vector<double> reduce_each(DeviceContext& ctx, const std::vector<Tensor>& xs,
                                Reduction reduction) {
  const char* what = reduction == Reduction::Sum ? "sum input" : "norm input";
  int64_t largest = 0;
  for (const Tensor& x : xs) {
    check_operand(ctx, x, DType::kF32, what);
    largest = std::max(largest, x.numel());
  }
  std::vector<double> results(xs.size(), 0.0);
  if (xs.empty()) return results;
  // The CPU kernels write the host results directly; the CUDA ones write one double per
  // tensor into one device buffer (the allocator knows no f64: twice as many f32), which
  // comes back in one copy. The launches share one scratch, which the stream orders.
  Tensor device_results;
  double* out = results.data();
  if (ctx.is_cuda()) {
    device_results = ctx.empty({static_cast<int64_t>(2 * xs.size())}, DType::kF32);
    out = static_cast<double*>(device_results.raw());
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    if (reduction == Reduction::Sum)
      CONVEYOR_DISPATCH_WITH_SCRATCH(ctx, sum, kernels::cuda::reduce_scratch_bytes(largest),
                                     out + i, f32(xs[i]), xs[i].numel());
    else
      CONVEYOR_DISPATCH_WITH_SCRATCH(ctx, sum_squares, kernels::cuda::reduce_scratch_bytes(largest),
                                     out + i, f32(xs[i]), xs[i].numel());
  }
  if (ctx.is_cuda()) copy_results_to_host(ctx, results, device_results);
  return results;
}
}  // namespace

double sum(DeviceContext& ctx, const Tensor& x) { return reduce_each(ctx, {x}, Reduction::Sum)[0]; }

double sum_squares(DeviceContext& ctx, const Tensor& x) {
  return reduce_each(ctx, {x}, Reduction::SumSquares)[0];
}

std::vector<double> sum_each(DeviceContext& ctx, const std::vector<Tensor>& xs) {
  return reduce_each(ctx, xs, Reduction::Sum);
}

std::vector<double> sum_squares_each(DeviceContext& ctx, const std::vector<Tensor>& xs) {
  return reduce_each(ctx, xs, Reduction::SumSquares);
}

void add_(DeviceContext& ctx, const Tensor& y, const Tensor& x) {
  check_operand(ctx, y, DType::kF32, "add destination");
  check_f32(ctx, x, y.shape(), "add source");
  CONVEYOR_DISPATCH(ctx, add_inplace, f32(y), f32(x), y.numel());
}

void adamw_update(DeviceContext& ctx, const std::vector<kernels::OptimizerTensor>& tensors,
                  const kernels::AdamWParams& params) {
  const auto count = static_cast<int64_t>(tensors.size());
  CONVEYOR_DISPATCH(ctx, adamw_update, tensors.data(), count, params);
}

void sgd_update(DeviceContext& ctx, const std::vector<kernels::OptimizerTensor>& tensors,
                const kernels::SgdParams& params) {
  const auto count = static_cast<int64_t>(tensors.size());
  CONVEYOR_DISPATCH(ctx, sgd_update, tensors.data(), count, params);
}

void init_uniform(DeviceContext& ctx, const Tensor& out, uint64_t seed, uint64_t key, float low,
                  float high) {
  check_operand(ctx, out, DType::kF32, "initialised tensor");
  CONVEYOR_DISPATCH(ctx, init_uniform, f32(out), out.numel(), seed, key, low, high);
}

void fill(DeviceContext& ctx, const Tensor& out, float value) {
  check_operand(ctx, out, DType::kF32, "filled tensor");
  CONVEYOR_DISPATCH(ctx, fill, f32(out), out.numel(), value);
}

}  // namespace conveyor::ops
