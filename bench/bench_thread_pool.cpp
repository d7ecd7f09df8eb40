// The CPU kernels' thread pool: what one parallel_for costs beyond its tasks, and a kernel of
// the tiny model's size (a GELU over one micro-batch's hidden activations, 1024 x 256) on one
// thread and on two. Wall time (UseRealTime): the cost is the hand-over between threads,
// which CPU time of the calling thread does not see. A training step runs thousands of such
// jobs, a few microseconds apart, so the per-job figure multiplies.
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/activation.h"
#include "kernels/thread_pool.h"

namespace {

namespace cpu = conveyor::kernels::cpu;

// Pool of range(0) threads (1: no workers, tasks inline), jobs of range(1) empty tasks.
void BM_PoolEmptyJob(benchmark::State& state) {
  cpu::ThreadPool pool(static_cast<int>(state.range(0)));
  const int64_t tasks = state.range(1);
  std::atomic<int64_t> ran{0};
  for (auto _ : state) pool.parallel_for(tasks, [&](int64_t) { ran.fetch_add(1); });
  benchmark::DoNotOptimize(ran.load());
  state.counters["jobs/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PoolEmptyJob)
    ->ArgNames({"threads", "tasks"})
    ->Args({1, 16})
    ->Args({2, 2})
    ->Args({2, 16})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// GELU forward and backward over `elements` floats (16 tasks of 16384) on a pool of
// range(0) threads, back to back, as a step runs them.
void BM_PoolGelu(benchmark::State& state) {
  cpu::ThreadPool pool(static_cast<int>(state.range(0)));
  const int64_t n = state.range(1);
  std::vector<float> x(static_cast<size_t>(n)), y(x.size()), dy(x.size()), dx(x.size());
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 97) * 0.05f - 2.0f;
    dy[i] = static_cast<float>(i % 89) * 0.01f - 0.4f;
  }
  for (auto _ : state) {
    cpu::gelu_forward(y.data(), x.data(), n, &pool);
    cpu::gelu_backward(dx.data(), dy.data(), x.data(), n, &pool);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_PoolGelu)
    ->ArgNames({"threads", "elements"})
    ->Args({1, 1024 * 256})
    ->Args({2, 1024 * 256})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
