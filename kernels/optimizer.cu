// Fused optimizer updates on CUDA (multi-tensor apply).
// The tensors of one call are viewed as one virtual concatenation, cut into fixed chunks of
// kChunk elements; each block walks chunks (grid-stride) and, inside a chunk, every tensor
// segment the chunk overlaps. Descriptors travel by value in the kernel parameters (up to
// kMaxTensors per launch, ~10 KB; CUDA >= 12.1 allows 32 KB on sm_70+), so there is no
// host-to-device copy to order and the launch is capture-safe. More tensors -> more launches.
// Each element is updated independently by one thread, so results are deterministic.
#include <cmath>
#include <vector>

#include "kernels/cuda_util.cuh"
#include "kernels/optimizer.h"

namespace conveyor::kernels::cuda {
namespace {

constexpr int kMaxTensors = 256;
constexpr int64_t kChunk = int64_t{1} << 16;
constexpr int kBlock = 512;

struct TensorTable {
  float* param[kMaxTensors];
  const float* grad[kMaxTensors];
  float* state0[kMaxTensors];
  float* state1[kMaxTensors];
  int64_t start[kMaxTensors + 1];  // prefix offsets in the concatenation; start[count] = total
  uint32_t decay_bits[kMaxTensors / 32];
  int count;
};

struct AdamWArgs {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  float bias_correction1, bias_correction2, grad_scale;
};

struct SgdArgs {
  float lr, momentum, weight_decay, grad_scale;
};

struct AdamWOp {
  AdamWArgs a;
  __device__ void operator()(const TensorTable& t, int k, int64_t i, bool decay) const {
    const float g = t.grad[k][i] * a.grad_scale;
    float m = t.state0[k][i];
    float v = t.state1[k][i];
    float p = t.param[k][i];
    m = a.beta1 * m + a.one_minus_beta1 * g;
    v = a.beta2 * v + a.one_minus_beta2 * (g * g);
    const float m_hat = m / a.bias_correction1;
    const float v_hat = v / a.bias_correction2;
    float update = m_hat / (sqrtf(v_hat) + a.eps);
    if (decay) update += a.weight_decay * p;
    p -= a.lr * update;
    t.state0[k][i] = m;
    t.state1[k][i] = v;
    t.param[k][i] = p;
  }
};

struct SgdOp {
  SgdArgs a;
  __device__ void operator()(const TensorTable& t, int k, int64_t i, bool decay) const {
    const float g = t.grad[k][i] * a.grad_scale;
    float buf = g;
    if (t.state0[k] != nullptr) {
      buf = a.momentum * t.state0[k][i] + g;
      t.state0[k][i] = buf;
    }
    const float p = t.param[k][i];
    float update = buf;
    if (decay) update += a.weight_decay * p;
    t.param[k][i] = p - a.lr * update;
  }
};

template <class Op>
__global__ void __launch_bounds__(kBlock)
    multi_tensor_kernel(const __grid_constant__ TensorTable t, Op op) {
  const int64_t total = t.start[t.count];
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    int64_t lo = chunk * kChunk;
    const int64_t hi = min(total, lo + kChunk);
    // Last tensor whose start is <= lo (empty tensors are never in the table).
    int left = 0, right = t.count - 1;
    while (left < right) {
      const int mid = (left + right + 1) / 2;
      if (t.start[mid] <= lo)
        left = mid;
      else
        right = mid - 1;
    }
    for (int k = left; lo < hi; ++k) {
      const int64_t seg_end = min(hi, t.start[k + 1]);
      const int64_t base = t.start[k];
      const bool decay = (t.decay_bits[k / 32] >> (k % 32)) & 1u;
      for (int64_t i = lo - base + threadIdx.x; i < seg_end - base; i += blockDim.x)
        op(t, k, i, decay);
      lo = seg_end;
    }
  }
}

template <class Op>
void apply(const char* who, const CudaContext& ctx, const OptimizerTensor* tensors, int64_t count,
           Op op, bool needs_state0, bool needs_state1) {
  std::vector<const OptimizerTensor*> live;
  for (int64_t i = 0; i < count; ++i) {
    const OptimizerTensor& t = tensors[i];
    const std::string where = std::string(who) + ": tensor " + std::to_string(i);
    detail::require(t.n >= 0, where + " has n = " + std::to_string(t.n) + " < 0");
    if (t.n == 0) continue;
    detail::require(t.param != nullptr && t.grad != nullptr,
                    where + " has a null param or grad pointer");
    detail::require(!needs_state0 || t.state0 != nullptr,
                    where + " has a null state0 (AdamW m / SGD momentum buffer)");
    detail::require(!needs_state1 || t.state1 != nullptr,
                    where + " has a null state1 (AdamW second moment v)");
    live.push_back(&t);
  }
  for (size_t first = 0; first < live.size(); first += kMaxTensors) {
    TensorTable table{};
    table.count = static_cast<int>(std::min<size_t>(kMaxTensors, live.size() - first));
    int64_t offset = 0;
    for (int k = 0; k < table.count; ++k) {
      const OptimizerTensor& t = *live[first + k];
      table.param[k] = t.param;
      table.grad[k] = t.grad;
      table.state0[k] = t.state0;
      table.state1[k] = t.state1;
      table.start[k] = offset;
      if (t.decay) table.decay_bits[k / 32] |= 1u << (k % 32);
      offset += t.n;
    }
    table.start[table.count] = offset;
    const int64_t chunks = (offset + kChunk - 1) / kChunk;
    const unsigned grid =
        static_cast<unsigned>(std::min<int64_t>(chunks, detail::kFixedSmCount * 8));
    multi_tensor_kernel<<<grid, kBlock, 0, ctx.stream>>>(table, op);
    CONVEYOR_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void adamw_update(const CudaContext& ctx, const OptimizerTensor* tensors, int64_t count,
                  const AdamWParams& params) {
  detail::require(params.step >= 1,
                  "adamw_update: step is 1-based, got " + std::to_string(params.step));
  if (count <= 0) return;
  AdamWArgs a{};
  a.lr = params.lr;
  a.beta1 = params.beta1;
  a.beta2 = params.beta2;
  a.one_minus_beta1 = 1.0f - params.beta1;
  a.one_minus_beta2 = 1.0f - params.beta2;
  a.eps = params.eps;
  a.weight_decay = params.weight_decay;
  const double t = static_cast<double>(params.step);
  a.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(params.beta1), t));
  a.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(params.beta2), t));
  a.grad_scale = params.grad_scale;
  apply("adamw_update", ctx, tensors, count, AdamWOp{a}, true, true);
}

void sgd_update(const CudaContext& ctx, const OptimizerTensor* tensors, int64_t count,
                const SgdParams& params) {
  if (count <= 0) return;
  SgdArgs a{params.lr, params.momentum, params.weight_decay, params.grad_scale};
  // With zero momentum the buffer equals the gradient and may be absent (as on the CPU).
  apply("sgd_update", ctx, tensors, count, SgdOp{a}, params.momentum != 0.0f, false);
}

}  // namespace conveyor::kernels::cuda
