// Whole training steps through conveyor::Trainer (data, forward, backward, all-reduce of loss
// and gradient norms, clipping, AdamW): tokens per second and achieved TFLOP/s.
//   CPU: the tiny preset, one stage and 4-stage 1F1B.
//   GPU: the small preset (d=1024, L=8, V=32768; the model of docs/PERF.md's PyTorch
//        reference step), 16384 tokens per step in m = 16 micro-batches, fp32 and TF32, one
//        stage and p = 4 stages sharing one GPU under 1F1B. Skipped (with an error line) when no
//        CUDA device is usable.
// Timing: a few warm-up steps, then the wall time of each Trainer::step() (it returns after
// the optimizer step has finished on every rank); counters use the median step.
//   tokens/s      tokens per step / median step time
//   TFLOP/s       6 · parameters · tokens / median step time (all parameters, the usual
//                 estimate; the embedding's V·d parameters do no matmul work)
//   TFLOP/s_mm    the same without the embedding: 6 · (parameters − V·d) · tokens / time
//   vs_1stage     pipeline tokens/s ÷ one-stage tokens/s of the same model and precision,
//                 when the one-stage case ran earlier in the same process
//   bubble        measured idle fraction of the last timed step (pipeline cases)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/benchmark_flags.h"
#include "engine/core/device.h"
#include "engine/schedule/measured_timing.h"
#include "engine/train/trainer.h"

namespace {

using Clock = std::chrono::steady_clock;

// tokens/s of the one-stage runs, by "preset/precision", for the vs_1stage counter.
std::map<std::string, double>& one_stage_rates() {
  static std::map<std::string, double> rates;
  return rates;
}

void run_training(benchmark::State& state, const conveyor::TrainConfig& config,
                  conveyor::Device device, int warmup) {
  // A failure (out of memory, divergence) marks this case and lets the others run.
  std::unique_ptr<conveyor::Trainer> trainer;
  try {
    conveyor::TrainConfig on_device = config;
    on_device.device = device;
    trainer = std::make_unique<conveyor::Trainer>(on_device);
    for (int i = 0; i < warmup; ++i) trainer->step();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  std::vector<double> seconds;
  conveyor::StepStats last;
  for (auto _ : state) {
    try {
      const auto t0 = Clock::now();
      last = trainer->step();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      state.SetIterationTime(s);
      seconds.push_back(s);
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      break;
    }
  }
  if (seconds.empty() || state.error_occurred()) return;
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double tokens = static_cast<double>(config.batch_tokens);
  const auto& model = config.model;
  const double params = static_cast<double>(conveyor::count_parameters(model));
  const double embedding = static_cast<double>(model.vocab * model.d_model);
  const double rate = tokens / median;
  state.counters["tokens/s"] = rate;
  state.counters["TFLOP/s"] = 6.0 * params * tokens / median / 1e12;
  state.counters["TFLOP/s_mm"] = 6.0 * (params - embedding) * tokens / median / 1e12;
  state.counters["step_ms"] = median * 1e3;
  state.counters["loss"] = last.loss;
  const std::string key = model.preset + (config.allow_tf32 ? "/tf32" : "/fp32");
  if (config.stages == 1) {
    one_stage_rates()[key] = rate;
  } else {
    const auto sim =
        conveyor::schedule::summarize_timing(trainer->executor().schedule(), last.pipeline.timing);
    state.counters["bubble"] = sim.bubble_fraction;
    const auto it = one_stage_rates().find(key);
    if (it != one_stage_rates().end()) state.counters["vs_1stage"] = rate / it->second;
  }
}

conveyor::TrainConfig make_config(const std::string& preset, int64_t batch_tokens,
                                  int64_t microbatches, int stages, bool tf32) {
  conveyor::TrainConfig config;
  config.model = conveyor::model_preset(preset);
  config.batch_tokens = batch_tokens;
  config.microbatches = microbatches;
  config.stages = stages;
  config.schedule = conveyor::schedule::ScheduleKind::k1F1B;
  config.allow_tf32 = tf32;
  config.placement =
      conveyor::RankPlacement::kShared;  // several ranks on one GPU (no effect on the CPU)
  config.steps = 1000000;                // keeps the learning-rate schedule out of its tail
  return config;
}

// CPU: tiny preset, 4096 tokens per step in 16 micro-batches of 256 tokens.
void BM_TrainCpu(benchmark::State& state) {
  const int stages = static_cast<int>(state.range(0));
  run_training(state, make_config("tiny", 4096, 16, stages, false), conveyor::Device::cpu(),
               /*warmup=*/2);
}
BENCHMARK(BM_TrainCpu)
    ->ArgName("stages")
    ->Arg(1)
    ->Arg(4)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

// GPU: small preset, 16384 tokens per step in 16 micro-batches of 1024 tokens.
void BM_TrainGpu(benchmark::State& state, bool tf32) {
  if (conveyor::cuda_device_count() == 0) {
    // An error row would leave the exit status 0, and tools/gpu_check.sh would say "ok".
    if (conveyor::bench::gpu_expected()) {
      std::fprintf(stderr, "bench_train: %s\n", conveyor::bench::kExpectedGpuMissing);
      std::exit(1);
    }
    state.SkipWithError("no CUDA device");
    return;
  }
  const int stages = static_cast<int>(state.range(0));
  run_training(state, make_config("small", 16384, 16, stages, tf32), conveyor::Device::cuda(0),
               /*warmup=*/3);
}
BENCHMARK_CAPTURE(BM_TrainGpu, fp32, false)
    ->ArgName("stages")
    ->Arg(1)
    ->Arg(4)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TrainGpu, tf32, true)
    ->ArgName("stages")
    ->Arg(1)
    ->Arg(4)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

}  // namespace
