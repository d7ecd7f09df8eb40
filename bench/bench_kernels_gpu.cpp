// CUDA kernel benchmarks: GEMM TFLOP/s (fp32, TF32) at 8192³ and the reference model's
// shapes, LayerNorm, GELU, softmax-cross-entropy, AdamW and the gradient-norm reduction in GB/s,
// each with the percent of the ceilings measured on the H200 (docs/PERF.md, "Ceilings").
// Timing: CUDA events around each call after a warm-up, median over the iterations; inputs
// are fresh random data (init_uniform), far larger than the 60 MB L2.
// Counters are computed from the median event time (not Google Benchmark's rate counters,
// whose time base differs between versions).
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "bench/benchmark_flags.h"
#include "engine/core/device.h"
#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda_check.h"
#include "kernels/init.h"
#include "kernels/layernorm.h"
#include "kernels/linear.h"
#include "kernels/optimizer.h"
#include "kernels/reduce.h"

namespace {

using conveyor::kernels::cuda::CudaContext;

// Ceilings measured on the H200 with PyTorch (docs/PERF.md, "Ceilings", which gives how).
constexpr double kCopyGBs = 4272.0;
constexpr double kTf32TFlops = 399.0;
constexpr double kFp32TFlops = 50.0;

class Bench {
 public:
  explicit Bench(bool tf32 = false) {
    CONVEYOR_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    CONVEYOR_CUBLAS_CHECK(cublasLtCreate(&ctx_.cublaslt));
    ctx_.workspace_bytes = size_t{64} << 20;
    CONVEYOR_CUDA_CHECK(cudaMalloc(&ctx_.workspace, ctx_.workspace_bytes));
    ctx_.allow_tf32 = tf32;
    CONVEYOR_CUDA_CHECK(cudaEventCreate(&start_));
    CONVEYOR_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Bench() {
    cudaStreamSynchronize(ctx_.stream);
    for (void* p : buffers_) cudaFree(p);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaFree(ctx_.workspace);
    cublasLtDestroy(ctx_.cublaslt);
    cudaStreamDestroy(ctx_.stream);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  const CudaContext& ctx() const { return ctx_; }

  // Device floats filled with fresh uniform values in [low, high).
  float* random(size_t n, uint64_t key, float low = -1.0f, float high = 1.0f) {
    float* p = alloc<float>(n);
    conveyor::kernels::cuda::init_uniform(ctx_, p, static_cast<int64_t>(n), 1234, key, low, high);
    return p;
  }
  // Device copy of `host`, on the stream the kernels run on (a pageable cudaMemcpy would go
  // to the legacy default stream, which our non-blocking stream does not wait for), complete
  // when this returns.
  template <class T>
  T* upload(const std::vector<T>& host) {
    T* p = alloc<T>(host.size());
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(p, host.data(), host.size() * sizeof(T),
                                        cudaMemcpyHostToDevice, ctx_.stream));
    CONVEYOR_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    return p;
  }
  template <class T>
  T* alloc(size_t n) {
    void* p = nullptr;
    CONVEYOR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    buffers_.push_back(p);
    return static_cast<T*>(p);
  }

  // Runs `work` once to warm up, then once per iteration between two events; returns the
  // median seconds and sets the manual iteration time.
  double time(benchmark::State& state, const std::function<void()>& work) {
    work();
    CONVEYOR_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    std::vector<double> seconds;
    for (auto _ : state) {
      CONVEYOR_CUDA_CHECK(cudaEventRecord(start_, ctx_.stream));
      work();
      CONVEYOR_CUDA_CHECK(cudaEventRecord(stop_, ctx_.stream));
      CONVEYOR_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0.0f;
      CONVEYOR_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      seconds.push_back(ms * 1e-3);
      state.SetIterationTime(ms * 1e-3);
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds.empty() ? 0.0 : seconds[seconds.size() / 2];
    state.counters["median_ms"] = median * 1e3;
    return median;
  }

 private:
  CudaContext ctx_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::vector<void*> buffers_;
};

void report_bandwidth(benchmark::State& state, double bytes, double seconds,
                      double pytorch_gbs = 0.0) {
  const double gbs = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  state.counters["GB/s"] = gbs;
  state.counters["pct_copy_ceiling"] = 100.0 * gbs / kCopyGBs;
  if (pytorch_gbs > 0) state.counters["pct_pytorch"] = 100.0 * gbs / pytorch_gbs;
}

// args: n (rows), in, out, op (0 forward+bias, 1 backward_input, 2 backward_weight+bias), tf32
void BM_Linear(benchmark::State& state) {
  const int64_t n = state.range(0), in = state.range(1), out = state.range(2);
  const int op = static_cast<int>(state.range(3));
  const bool tf32 = state.range(4) != 0;
  Bench b(tf32);
  float* x = b.random(static_cast<size_t>(n * in), 1);
  float* w = b.random(static_cast<size_t>(out * in), 2, -0.05f, 0.05f);
  float* bias = b.random(static_cast<size_t>(out), 3);
  float* y = b.random(static_cast<size_t>(n * out), 4);
  float* dw = b.random(static_cast<size_t>(out * in), 5);
  float* db = b.random(static_cast<size_t>(out), 6);
  namespace k = conveyor::kernels::cuda;
  const double s = b.time(state, [&] {
    if (op == 0) k::linear_forward(b.ctx(), y, x, w, bias, n, in, out);
    if (op == 1) k::linear_backward_input(b.ctx(), x, y, w, n, in, out);
    if (op == 2) k::linear_backward_weight(b.ctx(), dw, db, y, x, n, in, out);
  });
  const double tflops = s > 0 ? 2.0 * n * in * out / s / 1e12 : 0.0;
  state.counters["TFLOP/s"] = tflops;
  state.counters["pct_ceiling"] = 100.0 * tflops / (tf32 ? kTf32TFlops : kFp32TFlops);
}

// A template so that it fits Apply() whether the library names the type
// benchmark::internal::Benchmark (<= 1.8) or benchmark::Benchmark (newer).
template <class B>
void gemm_args(B* bm) {
  for (int tf32 : {0, 1}) {
    bm->Args({8192, 8192, 8192, 0, tf32});
    for (int64_t d : {1024, 2048}) {  // reference model, 16384 tokens per step
      for (int op : {0, 1, 2}) {
        bm->Args({16384, d, 4 * d, op, tf32});  // fc1
        bm->Args({16384, 4 * d, d, op, tf32});  // fc2
        bm->Args({16384, d, 32768, op, tf32});  // head
      }
    }
  }
  bm->ArgNames({"n", "in", "out", "op", "tf32"});
}
BENCHMARK(BM_Linear)->Apply(gemm_args)->UseManualTime()->Iterations(10)->Unit(
    benchmark::kMillisecond);

// LayerNorm fwd + bwd (input and weight); bytes counted as 5·N·C·4 like the PyTorch figure.
void BM_LayerNormFwdBwd(benchmark::State& state) {
  const int64_t n = state.range(0), c = state.range(1);
  Bench b;
  const size_t nc = static_cast<size_t>(n * c);
  float* x = b.random(nc, 10);
  float* dy = b.random(nc, 11);
  float* y = b.alloc<float>(nc);
  float* dx = b.alloc<float>(nc);
  float* gamma = b.random(static_cast<size_t>(c), 12, 0.5f, 1.5f);
  float* beta = b.random(static_cast<size_t>(c), 13);
  float* dgamma = b.random(static_cast<size_t>(c), 14);
  float* dbeta = b.random(static_cast<size_t>(c), 15);
  float* mean = b.alloc<float>(static_cast<size_t>(n));
  float* rstd = b.alloc<float>(static_cast<size_t>(n));
  namespace k = conveyor::kernels::cuda;
  const double s = b.time(state, [&] {
    k::layernorm_forward(b.ctx(), y, mean, rstd, x, gamma, beta, n, c, 1e-5f);
    k::layernorm_backward_input(b.ctx(), dx, dy, x, mean, rstd, gamma, n, c);
    k::layernorm_backward_weight(b.ctx(), dgamma, dbeta, dy, x, mean, rstd, n, c);
  });
  report_bandwidth(state, 5.0 * n * c * 4, s, c == 1024 ? 1487.0 : 0.0);
}
BENCHMARK(BM_LayerNormFwdBwd)
    ->Args({16384, 1024})
    ->Args({16384, 4096})
    ->UseManualTime()
    ->Iterations(50)
    ->Unit(benchmark::kMillisecond);

// GELU fwd + bwd: reads x, writes y; reads dy and x, writes dx -> 5·N·4 bytes.
void BM_GeluFwdBwd(benchmark::State& state) {
  const int64_t n = state.range(0);
  Bench b;
  float* x = b.random(static_cast<size_t>(n), 20, -4.0f, 4.0f);
  float* dy = b.random(static_cast<size_t>(n), 21);
  float* y = b.alloc<float>(static_cast<size_t>(n));
  namespace k = conveyor::kernels::cuda;
  const double s = b.time(state, [&] {
    k::gelu_forward(b.ctx(), y, x, n);
    k::gelu_backward(b.ctx(), dy, dy, x, n);  // in place, as the layers do
  });
  report_bandwidth(state, 5.0 * n * 4, s);
}
BENCHMARK(BM_GeluFwdBwd)
    ->Arg(int64_t{16384} * 16384)
    ->Arg(int64_t{16384} * 4096)
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMillisecond);

// Softmax-CE in place: reads the logits (twice, the second mostly from L2) and writes
// dlogits; counted as 2·N·V·4 bytes like the PyTorch figure.
void BM_SoftmaxCrossEntropy(benchmark::State& state) {
  const int64_t n = state.range(0), vocab = state.range(1);
  Bench b;
  const size_t nv = static_cast<size_t>(n * vocab);
  float* logits = b.random(nv, 30, -5.0f, 5.0f);
  float* losses = b.alloc<float>(static_cast<size_t>(n));
  std::vector<int32_t> host(static_cast<size_t>(n));
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int32_t>((i * 7919) % vocab);
  const int32_t* targets = b.upload(host);
  namespace k = conveyor::kernels::cuda;
  // In place over the same logits each iteration: the values change, the work does not.
  const double s = b.time(state, [&] {
    k::softmax_cross_entropy(b.ctx(), losses, logits, logits, targets, n, vocab, -100,
                             1.0f / static_cast<float>(n));
  });
  report_bandwidth(state, 2.0 * n * vocab * 4, s, 982.0);
}
BENCHMARK(BM_SoftmaxCrossEntropy)
    ->Args({8192, 32768})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMillisecond);

// AdamW over `params` floats split into tensors of `per_tensor`: 28 bytes per parameter.
void BM_AdamW(benchmark::State& state) {
  const int64_t params = state.range(0), per_tensor = state.range(1);
  Bench b;
  std::vector<conveyor::kernels::OptimizerTensor> tensors;
  for (int64_t done = 0, key = 100; done < params; done += per_tensor, key += 4) {
    const int64_t n = std::min(per_tensor, params - done);
    conveyor::kernels::OptimizerTensor t;
    t.param = b.random(static_cast<size_t>(n), key);
    t.grad = b.random(static_cast<size_t>(n), key + 1);
    t.state0 = b.random(static_cast<size_t>(n), key + 2, -0.01f, 0.01f);
    t.state1 = b.random(static_cast<size_t>(n), key + 3, 0.0f, 1e-4f);
    t.n = n;
    t.decay = (key / 4) % 2 == 0;
    tensors.push_back(t);
  }
  conveyor::kernels::AdamWParams p;
  p.weight_decay = 0.1f;
  p.step = 10;
  const double s = b.time(state, [&] {
    conveyor::kernels::cuda::adamw_update(b.ctx(), tensors.data(),
                                          static_cast<int64_t>(tensors.size()), p);
  });
  report_bandwidth(state, 28.0 * params, s, 3397.0);
}
BENCHMARK(BM_AdamW)
    ->Args({400'000'000, 4'194'304})
    ->Args({400'000'000, 1'000'003})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMillisecond);

// Σx² (gradient norm) over n floats: 4 bytes per element.
void BM_SumSquares(benchmark::State& state) {
  const int64_t n = state.range(0);
  Bench b;
  float* x = b.random(static_cast<size_t>(n), 40);
  double* out = b.alloc<double>(1);
  void* scratch = b.alloc<char>(conveyor::kernels::cuda::reduce_scratch_bytes(n));
  const double s =
      b.time(state, [&] { conveyor::kernels::cuda::sum_squares(b.ctx(), out, x, n, scratch); });
  report_bandwidth(state, 4.0 * n, s);
}
BENCHMARK(BM_SumSquares)
    ->Arg(400'000'000)
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  if (const auto status = conveyor::bench::take_benchmark_flags(&argc, argv)) return *status;
  if (conveyor::cuda_device_count() == 0) {
    if (conveyor::bench::gpu_expected()) {
      std::fprintf(stderr, "bench_kernels_gpu: %s\n", conveyor::bench::kExpectedGpuMissing);
      return 1;
    }
    // On stderr: stdout may be the --benchmark_format=json document a script reads.
    std::fprintf(stderr, "bench_kernels_gpu: no CUDA device; nothing to measure.\n");
    return 0;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
