// Executor overhead on the CPU: host time per action when the compute is (nearly) empty.
// The model is as small as the model allows (d_model = 1, hidden = 1, vocab = 2, one block per
// stage, one token per micro-batch), so what is left of a step is the executor itself: rank
// threads, action dispatch, hand-offs between actions, the in-process transport, the
// end-of-step all-reduce and a (tiny) optimizer step.
//
// Counters (per step, from the wall time of PipelineExecutor::run_step):
//   actions          actions over all ranks (compute and transfers)
//   busiest          actions of the rank with the most
//   us/action        step wall time / actions over all ranks
//   us/action_rank   step wall time / actions of the busiest rank (the per-rank cost, since
//                    ranks run concurrently)
//   launch_us        mean over ranks of the first action's start: waking the rank's
//                    thread (rank 0 runs on the caller's), zeroing the gradients and
//                    uploading the token ids
//   tail_us          step wall time minus the last action's end: all-reduce, optimizer, and
//                    the wait for every rank to finish
//   in_action_us     mean host time inside one action (a receive includes its wait)
// The rank threads live across steps (RankThreads: started once, woken by each run_step), so
// the wall time of a step holds their wake-up, not their start. With
// --benchmark_repetitions=N the "min" row (besides mean/median) is the best repetition, the
// least disturbed figure on a shared machine.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "engine/pipeline/executor.h"
#include "engine/pipeline/partition.h"
#include "engine/schedule/generators.h"

namespace {

namespace sc = conveyor::schedule;
using Clock = std::chrono::steady_clock;

conveyor::ModelConfig minimal_model(int stages) {
  conveyor::ModelConfig model;
  model.preset = "minimal";
  model.d_model = 1;
  model.hidden = 1;
  model.vocab = 2;
  model.n_layers = stages;
  return model;
}

void BM_ExecutorStep(benchmark::State& state, sc::ScheduleKind kind) {
  const int p = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  const auto model = conveyor::reference_model(minimal_model(p));
  sc::Schedule schedule = sc::generate(kind, p, m);
  size_t actions = 0, busiest = 0;
  for (const auto& list : schedule.ranks) {
    actions += list.size();
    busiest = std::max(busiest, list.size());
  }
  const auto ranges = conveyor::stage_ranges(
      model, conveyor::partition_blocks(model, p, conveyor::PartitionSpec::uniform()));
  conveyor::PipelineExecutor executor(model, std::move(schedule), ranges,
                                      std::vector<conveyor::Device>(p, conveyor::Device::cpu()),
                                      conveyor::OptimizerConfig{}, /*seed=*/1);
  // One token per micro-batch, alternating ids so no two micro-batches are the same.
  std::vector<conveyor::MicroBatchData> microbatches(m);
  for (int i = 0; i < m; ++i) microbatches[i] = {{i % 2}, {(i + 1) % 2}};
  const float loss_scale = 1.0f / static_cast<float>(m);

  int64_t step = 1;
  for (; step <= 3; ++step) executor.run_step(microbatches, loss_scale, step, 1e-3);

  double wall = 0, launch = 0, tail = 0, inside = 0;
  int64_t steps = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    const auto result = executor.run_step(microbatches, loss_scale, step++, 1e-3);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(seconds);
    wall += seconds;
    double last_end = 0;
    for (const auto& rank : result.timing) {
      if (!rank.empty()) launch += rank.front().start;
      for (const auto& t : rank) {
        inside += t.end - t.start;
        last_end = std::max(last_end, t.end);
      }
    }
    tail += result.seconds * 1e6 - last_end;
    ++steps;
  }
  const double n = static_cast<double>(steps);
  state.counters["actions"] = static_cast<double>(actions);
  state.counters["busiest"] = static_cast<double>(busiest);
  state.counters["us/action"] = wall * 1e6 / (n * static_cast<double>(actions));
  state.counters["us/action_rank"] = wall * 1e6 / (n * static_cast<double>(busiest));
  state.counters["launch_us"] = launch / (n * p);
  state.counters["tail_us"] = tail / n;
  state.counters["in_action_us"] = inside / (n * static_cast<double>(actions));
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int p : {1, 2, 4})
    for (int m : {4, 16, 64}) b->Args({p, m});
  b->ArgNames({"p", "m"})->UseManualTime()->MinTime(0.2)->Unit(benchmark::kMicrosecond);
  b->ComputeStatistics("min", [](const std::vector<double>& v) {
    return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
  });
}

BENCHMARK_CAPTURE(BM_ExecutorStep, one_f_one_b, sc::ScheduleKind::k1F1B)->Apply(sizes);
BENCHMARK_CAPTURE(BM_ExecutorStep, zbh1, sc::ScheduleKind::kZBH1)->Apply(sizes);

}  // namespace
