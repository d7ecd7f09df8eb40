// CPU element-wise activations. Backward writes dx (`=`); dx may alias dy because each
// element is read before it is written.
#include <algorithm>
#include <cmath>

#include "kernels/activation.h"
#include "kernels/cpu_check.h"
#include "kernels/cpu_packet.h"
#include "kernels/thread_pool.h"

namespace conveyor::kernels::cpu {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
// Element-wise work in blocks of this many elements on the pool (element-wise: any split
// gives the same bits).
constexpr int64_t kElementsPerTask = 16384;

template <class F>
void for_each_block(ThreadPool* pool, int64_t n, F&& f) {
  const int64_t blocks = (n + kElementsPerTask - 1) / kElementsPerTask;
  parallel_for(pool, blocks, [&](int64_t b) {
    const int64_t first = b * kElementsPerTask;
    f(first, std::min(n, first + kElementsPerTask));
  });
}

}  // namespace

// GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Evaluated through the exact identity 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + e^(-2u)):
// one exp instead of tanh and no cancellation in 1 + tanh for negative x. The exponent is
// clamped so that e^(-2u) stays finite (no inf * 0 below). Packet math (cpu_packet.h): one
// vectorized exp per eight elements.
namespace {

using detail::for_each_group;
using detail::Group;
using detail::load_group;
using detail::store_group;

// sigmoid(2u) = 0.5 (1 + tanh u), for the forward and for the slope.
[[gnu::always_inline]] inline Group gelu_gate(const Group& v, Group* e) {
  const Group u = kSqrt2OverPi * (v + kGeluCubic * v * v * v);
  *e = (-2.0f * u).min(80.0f).exp();
  return (1.0f + *e).inverse();
}

}  // namespace

void gelu_forward(float* y, const float* x, int64_t n, ThreadPool* pool) {
  detail::require_at_least("gelu_forward", "n", n, 0);
  for_each_block(pool, n, [&](int64_t first, int64_t last) {
    for_each_group(first, last, [&](int64_t i, int64_t count) CONVEYOR_INLINE {
      const Group v = load_group(x + i, count);
      Group e;
      store_group(y + i, v * gelu_gate(v, &e), count);
    });
  });
}

// d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x) with t = tanh u, u' = sqrt(2/pi) (1 + 3 * 0.044715
// x^2); in sigmoid form 0.5 (1 + t) = s and 0.5 (1 - t^2) = 2 s (1 - s), where 1 - s = e s
// (e = e^(-2u)) without cancellation.
void gelu_backward(float* dx, const float* dy, const float* x, int64_t n, ThreadPool* pool) {
  detail::require_at_least("gelu_backward", "n", n, 0);
  for_each_block(pool, n, [&](int64_t first, int64_t last) {
    for_each_group(first, last, [&](int64_t i, int64_t count) CONVEYOR_INLINE {
      const Group v = load_group(x + i, count);
      Group e;
      const Group s = gelu_gate(v, &e);
      const Group du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v);
      const Group slope = s + 2.0f * v * s * (e * s) * du;
      store_group(dx + i, load_group(dy + i, count) * slope, count);
    });
  });
}

void relu_forward(float* y, const float* x, int64_t n, ThreadPool* pool) {
  detail::require_at_least("relu_forward", "n", n, 0);
  for_each_block(pool, n, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  });
}

// The subgradient at 0 is taken as 0.
void relu_backward(float* dx, const float* dy, const float* x, int64_t n, ThreadPool* pool) {
  detail::require_at_least("relu_backward", "n", n, 0);
  for_each_block(pool, n, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
  });
}

}  // namespace conveyor::kernels::cpu
