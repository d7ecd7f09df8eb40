// CPU kernel throughput: linear GEMMs in FLOP/s, memory-bound kernels in bytes/s (the
// minimum traffic each kernel must move) and as a percent of the measured memcpy bandwidth.
// Working sets are several times the L2 cache so the memory-bound numbers mean DRAM/L3.
// Every rate, the ceiling's included, is per CPU second of the benchmark thread (the kernels
// run on it alone, with no pool), as Google Benchmark's rate counters are: on a shared
// machine wall time counts other processes' time too, and a percent whose time base differed
// from its rate's would not be the rate divided by the printed ceiling.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

#include "bench/benchmark_flags.h"
#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/layernorm.h"
#include "kernels/linear.h"
#include "kernels/optimizer.h"

namespace {

namespace k = conveyor::kernels;

// CPU time of the calling thread, the clock Google Benchmark divides rate counters by.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Cheap deterministic inputs in [low, high): generating 10^7 values with std::mt19937 would
// take longer than the benchmarks themselves.
std::vector<float> inputs(size_t n, uint32_t seed, float low = -1.0f, float high = 1.0f) {
  std::vector<float> out(n);
  uint32_t state = seed * 2654435761u + 1u;
  for (auto& v : out) {
    state = state * 1664525u + 1013904223u;
    v = low + (high - low) * static_cast<float>(state >> 8) * (1.0f / 16777216.0f);
  }
  return out;
}

// Best-of-five memcpy bandwidth over 64 MiB, counting read + write bytes: the ceiling that
// memory-bound kernels are compared to. Measured once per process, and printed with the
// run's context (copy_ceiling).
double copy_ceiling_bytes_per_s() {
  static const double ceiling = [] {
    const size_t n = size_t{16} << 20;
    std::vector<float> src(n, 1.0f), dst(n, 0.0f);
    double best = 0.0;
    for (int rep = 0; rep < 5; ++rep) {
      const double t0 = thread_cpu_seconds();
      std::memcpy(dst.data(), src.data(), n * sizeof(float));
      benchmark::ClobberMemory();
      const double s = thread_cpu_seconds() - t0;
      best = std::max(best, 2.0 * n * sizeof(float) / s);
    }
    return best;
  }();
  return ceiling;
}

// Runs `body` in the benchmark loop and reports FLOP/s or bytes/s (and % of the copy ceiling).
template <class F>
void run_loop(benchmark::State& state, double flops, double bytes, F body) {
  const double t0 = thread_cpu_seconds();
  for (auto _ : state) {
    body();
    benchmark::ClobberMemory();
  }
  const double seconds = thread_cpu_seconds() - t0;
  using C = benchmark::Counter;
  if (flops > 0) state.counters["FLOP/s"] = C(flops, C::kIsIterationInvariantRate, C::kIs1000);
  if (bytes > 0) {
    state.counters["B/s"] = C(bytes, C::kIsIterationInvariantRate, C::kIs1000);
    const double rate = bytes * static_cast<double>(state.iterations()) / seconds;
    state.counters["pct_copy_bw"] = 100.0 * rate / copy_ceiling_bytes_per_s();
  }
}

void BM_memcpy(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto src = inputs(n, 1);
  std::vector<float> dst(n);
  run_loop(state, 0, 2.0 * n * sizeof(float),
           [&] { std::memcpy(dst.data(), src.data(), n * sizeof(float)); });
}
BENCHMARK(BM_memcpy)->Arg(16 << 20)->Unit(benchmark::kMillisecond)->MinTime(0.2);

// Linear: 2·n·in·out FLOP per GEMM.
void BM_linear_forward(benchmark::State& state) {
  const int64_t n = state.range(0), in = state.range(1), out = state.range(2);
  const auto x = inputs(n * in, 1), w = inputs(out * in, 2), b = inputs(out, 3);
  std::vector<float> y(n * out);
  run_loop(state, 2.0 * n * in * out, 0,
           [&] { k::cpu::linear_forward(y.data(), x.data(), w.data(), b.data(), n, in, out); });
}
void BM_linear_backward_input(benchmark::State& state) {
  const int64_t n = state.range(0), in = state.range(1), out = state.range(2);
  const auto dy = inputs(n * out, 1), w = inputs(out * in, 2);
  std::vector<float> dx(n * in);
  run_loop(state, 2.0 * n * in * out, 0,
           [&] { k::cpu::linear_backward_input(dx.data(), dy.data(), w.data(), n, in, out); });
}
void BM_linear_backward_weight(benchmark::State& state) {
  const int64_t n = state.range(0), in = state.range(1), out = state.range(2);
  const auto dy = inputs(n * out, 1), x = inputs(n * in, 2);
  std::vector<float> dw(out * in, 0.0f), db(out, 0.0f);
  run_loop(state, 2.0 * n * in * out, 0, [&] {
    k::cpu::linear_backward_weight(dw.data(), db.data(), dy.data(), x.data(), n, in, out);
  });
}
#define LINEAR_SIZES ->Args({512, 768, 768})->Args({256, 768, 3072})->Unit(benchmark::kMillisecond)
BENCHMARK(BM_linear_forward) LINEAR_SIZES;
BENCHMARK(BM_linear_backward_input) LINEAR_SIZES;
BENCHMARK(BM_linear_backward_weight) LINEAR_SIZES;
#undef LINEAR_SIZES

// LayerNorm: forward reads x, writes y; backward_input reads dy and x, writes dx.
void BM_layernorm_forward(benchmark::State& state) {
  const int64_t n = state.range(0), c = state.range(1);
  const auto x = inputs(n * c, 1), g = inputs(c, 2, 0.5f, 1.5f), b = inputs(c, 3);
  std::vector<float> y(n * c), mean(n), rstd(n);
  run_loop(state, 0, 2.0 * n * c * sizeof(float), [&] {
    k::cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), n,
                              c, 1e-5f);
  });
}
void BM_layernorm_backward(benchmark::State& state) {
  const int64_t n = state.range(0), c = state.range(1);
  const auto x = inputs(n * c, 1), g = inputs(c, 2, 0.5f, 1.5f), b = inputs(c, 3);
  const auto dy = inputs(n * c, 4);
  std::vector<float> y(n * c), mean(n), rstd(n), dx(n * c), dg(c, 0.0f), db(c, 0.0f);
  k::cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), n, c,
                            1e-5f);
  // Input and weight gradients: at least dy and x read and dx written once each (the two
  // kernels read dy and x again, which a fused kernel would not; counted is the minimum).
  run_loop(state, 0, 3.0 * n * c * sizeof(float), [&] {
    k::cpu::layernorm_backward_input(dx.data(), dy.data(), x.data(), mean.data(), rstd.data(),
                                     g.data(), n, c);
    k::cpu::layernorm_backward_weight(dg.data(), db.data(), dy.data(), x.data(), mean.data(),
                                      rstd.data(), n, c);
  });
}
BENCHMARK(BM_layernorm_forward)->Args({4096, 768})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_layernorm_backward)->Args({4096, 768})->Unit(benchmark::kMillisecond);

void BM_gelu_forward(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto x = inputs(n, 1, -4.0f, 4.0f);
  std::vector<float> y(n);
  run_loop(state, 0, 2.0 * n * sizeof(float), [&] { k::cpu::gelu_forward(y.data(), x.data(), n); });
}
void BM_gelu_backward(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto x = inputs(n, 1, -4.0f, 4.0f), dy = inputs(n, 2);
  std::vector<float> dx(n);
  run_loop(state, 0, 3.0 * n * sizeof(float),
           [&] { k::cpu::gelu_backward(dx.data(), dy.data(), x.data(), n); });
}
BENCHMARK(BM_gelu_forward)->Arg(4 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gelu_backward)->Arg(4 << 20)->Unit(benchmark::kMillisecond);

// Softmax cross-entropy into a gradient buffer of its own: reads the logits and writes their
// gradient, n·vocab floats each.
void BM_softmax_cross_entropy(benchmark::State& state) {
  const int64_t n = state.range(0), vocab = state.range(1);
  const auto logits = inputs(n * vocab, 1, -4.0f, 4.0f);
  std::vector<float> dlogits(n * vocab), losses(n);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 7919) % vocab);
  run_loop(state, 0, 2.0 * n * vocab * sizeof(float), [&] {
    k::cpu::softmax_cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), n,
                                  vocab, -100, 1.0f / static_cast<float>(n));
  });
}
BENCHMARK(BM_softmax_cross_entropy)->Args({128, 32768})->Unit(benchmark::kMillisecond);

// AdamW reads p, g, m, v and writes p, m, v: 7 floats per parameter.
void BM_adamw(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = inputs(n, 1), m = inputs(n, 2, -0.1f, 0.1f), v = inputs(n, 3, 0.0f, 0.1f);
  const auto g = inputs(n, 4);
  k::OptimizerTensor t{p.data(), g.data(), m.data(), v.data(), n, true};
  k::AdamWParams params;
  params.weight_decay = 0.1f;
  run_loop(state, 0, 7.0 * n * sizeof(float), [&] {
    k::cpu::adamw_update(&t, 1, params);
    ++params.step;
  });
}
BENCHMARK(BM_adamw)->Arg(4 << 20)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  if (const auto status = conveyor::bench::take_benchmark_flags(&argc, argv)) return *status;
  char ceiling[160];
  std::snprintf(ceiling, sizeof ceiling,
                "%.2f GB/s (memcpy of 64 MiB, read + write counted, best of 5, per CPU second of "
                "the benchmark thread)",
                copy_ceiling_bytes_per_s() / 1e9);
  benchmark::AddCustomContext("copy_ceiling", ceiling);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
