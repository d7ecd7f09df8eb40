// Checks made before any work starts: the per-rank memory estimate and its refusal, and the
// built-in data sources' bounds on what they read and build.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint_fixture.h"
#include "comm/in_process.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"
#include "engine/train/data.h"
#include "engine/train/trainer.h"

namespace conveyor {
namespace {

using testing::TempDir;

ModelConfig small_model() {
  ModelConfig m;
  m.d_model = 24;
  m.n_layers = 4;
  m.vocab = 40;
  m.hidden = 56;
  return m;
}

TEST(MemoryEstimate, ParametersGradientsAndStateMatchTheModel) {
  const ModelConfig config = small_model();
  const ModelDescription model = reference_model(config);
  const schedule::Schedule sched = schedule::generate(schedule::ScheduleKind::k1F1B, 2, 4, 1);
  const auto ranges = stage_ranges(model, partition_blocks(model, 2, PartitionSpec::uniform()));
  const auto adamw = estimate_rank_memory(model, ranges, sched, "adamw", 64);
  const auto sgd = estimate_rank_memory(model, ranges, sched, "sgd", 64);
  ASSERT_EQ(adamw.size(), 2u);
  // Each parameter tensor as the allocator gives it: its f32 bytes rounded up.
  double allocated = 0, params = 0;
  for (int64_t u = 0; u < model.num_units; ++u) {
    const std::unique_ptr<Layer> unit = model.unit(u);
    for (Parameter* p : unit->parameters())
      allocated += allocated_bytes(p->shape), params += static_cast<double>(shape_numel(p->shape));
  }
  EXPECT_EQ(params, static_cast<double>(count_parameters(config)));
  double bytes = 0;
  for (const auto& r : adamw) {
    bytes += r.parameter_bytes;
    EXPECT_EQ(r.gradient_bytes, r.parameter_bytes);
    EXPECT_EQ(r.optimizer_bytes, 2 * r.parameter_bytes);
    EXPECT_GT(r.activation_bytes, 0.0);
    EXPECT_TRUE(r.complete);
  }
  EXPECT_EQ(bytes, allocated);
  // The token ids live with the first stage, the targets and losses with the last.
  const StepInputBytes step = step_input_bytes(64, 4);
  EXPECT_EQ(adamw[0].batch_bytes, step.first_unit);
  EXPECT_EQ(adamw[1].batch_bytes, step.last_unit);
  EXPECT_EQ(sgd[0].optimizer_bytes, sgd[0].parameter_bytes);
  // 1F1B keeps p - r micro-batches in flight on rank r: rank 0 holds more than rank 1.
  const auto gpipe = estimate_rank_memory(
      model, ranges, schedule::generate(schedule::ScheduleKind::kGPipe, 2, 4, 1), "adamw", 64);
  EXPECT_GT(gpipe[0].activation_bytes, adamw[0].activation_bytes);
}

TEST(MemoryEstimate, TrainerRefusesARunOverTheLimitBeforeAllocating) {
  TrainConfig c;
  c.model = small_model();
  c.device = Device::cpu();
  c.steps = 1;
  c.batch_tokens = 64;
  c.microbatches = 2;
  c.memory_limit_bytes = 1024;
  try {
    Trainer trainer(c);
    FAIL() << "a 1 KiB limit was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("but the memory limit is"), std::string::npos) << what;
    // Every unit of the reference model says what it keeps: the estimate is no lower bound.
    EXPECT_EQ(what.find("at least"), std::string::npos) << what;
  }
  c.memory_limit_bytes = size_t{64} << 20;
  EXPECT_NO_THROW(Trainer trainer(c));
}

// The small reference model as two uniform 1F1B ranks of two 32-token micro-batches, with
// each rank's estimate: the layout the CUDA workspace tests hold against a cap.
struct TwoRanksOfOneF1B {
  ModelDescription model = reference_model(small_model());
  schedule::Schedule schedule = schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1);
  std::vector<StageRange> ranges =
      stage_ranges(model, partition_blocks(model, 2, PartitionSpec::uniform()));
  std::vector<RankMemoryEstimate> estimate =
      estimate_rank_memory(model, ranges, schedule, "adamw", 32);
  TrainConfig config = [] {
    TrainConfig c;
    c.model = small_model();
    c.batch_tokens = 64;
    c.microbatches = 2;
    return c;
  }();
};

// The step's token ids, targets and losses grow with the tokens per step, whatever the
// micro-batch: a run refused for them is told that fewer tokens per step would fit (fewer per
// micro-batch, at the most micro-batches, would not).
TEST(MemoryEstimate, ARefusalForTheStepsTokenIdsNamesFewerTokensPerStep) {
  const TwoRanksOfOneF1B run;
  TrainConfig c = run.config;
  c.batch_tokens = int64_t{1} << 24;  // ids and losses of 2^24 tokens: hundreds of MiB
  c.memory_limit_bytes = size_t{64} << 20;
  try {
    check_memory_fits(run.model, run.ranges, run.schedule, {Device::cpu(), Device::cpu()}, c);
    FAIL() << "the ids of 2^24 tokens fit in 64 MiB";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fewer tokens per micro-batch or per step"),
              std::string::npos)
        << e.what();
  }
}

// GPipe holds every micro-batch's activations where 1F1B holds at most p: a GPipe run refused
// where 1F1B on the same stages would fit is told so; one where 1F1B would not fit either, or
// a 1F1B run, is not.
TEST(MemoryEstimate, ARefusalThat1F1BWouldFitNamesIt) {
  const TwoRanksOfOneF1B run;
  TrainConfig c = run.config;
  c.microbatches = 8;
  c.batch_tokens = 8 * 32;
  const auto both = [&](schedule::ScheduleKind kind) {
    const schedule::Schedule s = schedule::generate(kind, 2, 8, 1);
    const auto e = estimate_rank_memory(run.model, run.ranges, s, "adamw", 32);
    return e[0].total() + e[1].total();
  };
  const double gpipe = both(schedule::ScheduleKind::kGPipe);
  const double one_f_one_b = both(schedule::ScheduleKind::k1F1B);
  ASSERT_LT(one_f_one_b, gpipe);
  const std::vector<Device> cpu = {Device::cpu(), Device::cpu()};
  const auto refusal = [&](schedule::ScheduleKind kind, double cap) {
    c.memory_limit_bytes = static_cast<size_t>(cap);
    try {
      check_memory_fits(run.model, run.ranges, schedule::generate(kind, 2, 8, 1), cpu, c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no refusal");
  };
  const std::string hint =
      "more stages, a schedule that holds fewer activations at once (1f1b "
      "fits), or sgd";
  const double between = (gpipe + one_f_one_b) / 2;
  EXPECT_NE(refusal(schedule::ScheduleKind::kGPipe, between).find(hint), std::string::npos)
      << refusal(schedule::ScheduleKind::kGPipe, between);
  EXPECT_EQ(refusal(schedule::ScheduleKind::k1F1B, between), "no refusal");
  const std::string below = refusal(schedule::ScheduleKind::kGPipe, one_f_one_b / 2);
  EXPECT_NE(below.find("more stages, or sgd"), std::string::npos) << below;
  const std::string under_1f1b = refusal(schedule::ScheduleKind::k1F1B, one_f_one_b / 2);
  EXPECT_NE(under_1f1b.find("more stages, or sgd"), std::string::npos) << under_1f1b;
}

// Replicas that each keep the whole AdamW state are told they can share it, and that sharing
// alone fits where it does; sharded replicas, and a single pipeline, are not.
TEST(MemoryEstimate, ARefusalOfReplicasNamesTheShardedOptimizerState) {
  const TwoRanksOfOneF1B run;
  TrainConfig c = run.config;
  c.data_parallel = 2;
  c.microbatches = 4;
  const schedule::Schedule s =
      schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, c.data_parallel);
  const std::vector<Device> cpu(4, Device::cpu());
  const auto refusal = [&](bool shard, double cap) {
    c.shard_optimizer = shard;
    c.memory_limit_bytes = static_cast<size_t>(cap);
    try {
      check_memory_fits(run.model, run.ranges, s, cpu, c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no refusal");
  };
  // The least cap each layout fits, to a byte: sharded, each rank keeps half its moments.
  const auto least_cap = [&](bool shard) {
    double fits = 1 << 30, refused = 1;
    while (fits - refused > 1) {
      const double mid = std::floor((fits + refused) / 2);
      (refusal(shard, mid) == "no refusal" ? fits : refused) = mid;
    }
    return fits;
  };
  const double whole = least_cap(false), shared = least_cap(true);
  ASSERT_LT(shared, whole);
  const double between = (whole + shared) / 2;
  EXPECT_EQ(refusal(true, between), "no refusal");
  const std::string hint =
      "the optimizer state shared by the replicas (TrainConfig::shard_optimizer, which fits), "
      "or sgd";
  EXPECT_NE(refusal(false, between).find(hint), std::string::npos) << refusal(false, between);
  const std::string below = refusal(false, shared / 2);
  EXPECT_NE(below.find("the optimizer state shared by the replicas "
                       "(TrainConfig::shard_optimizer), or sgd"),
            std::string::npos)
      << below;
  EXPECT_EQ(refusal(true, shared / 2).find("shard_optimizer"), std::string::npos);
}

// On a CUDA device each rank's context takes its cuBLASLt workspace from the capped allocator
// before the first step, so a cap that holds the CPU's estimate but not that workspace too
// refuses the CUDA run up front. No GPU is needed: the check refuses before any context exists,
// and without a device only the cap bounds it.
TEST(MemoryEstimate, CudaRanksCountTheirCublasWorkspace) {
  const TwoRanksOfOneF1B run;
  const auto& model = run.model;
  const auto& schedule = run.schedule;
  const auto& ranges = run.ranges;
  const auto& estimate = run.estimate;
  TrainConfig c = run.config;
  const double workspace = static_cast<double>(DeviceContextOptions{}.cublas_workspace_bytes);
  // Both ranks on one device, with room for their estimates and one workspace, not two.
  c.memory_limit_bytes =
      static_cast<size_t>(estimate[0].total() + estimate[1].total() + 1.5 * workspace);
  EXPECT_NO_THROW(check_memory_fits(model, ranges, schedule, {Device::cpu(), Device::cpu()}, c));
  try {
    check_memory_fits(model, ranges, schedule, {Device::cuda(0), Device::cuda(0)}, c);
    FAIL() << "two cuBLASLt workspaces fit a cap with room for one";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on cuda:0 (2 rank(s)"), std::string::npos) << e.what();
  }
  // A process per GPU: each rank alone with its workspace fits.
  EXPECT_NO_THROW(check_memory_fits(model, ranges, schedule, {Device::cuda(0), Device::cuda(0)}, c,
                                    /*one_device_per_process=*/true));
}

// CPU ranks as MPI processes: each process's allocators hold the cap for its one rank, so a
// cap that holds the larger rank but not both is no reason to refuse the run there, while in
// one process, where both ranks draw from it, it is.
TEST(MemoryEstimate, CpuRanksAsProcessesEachHoldTheCapAlone) {
  const TwoRanksOfOneF1B run;
  TrainConfig c = run.config;
  const double larger = std::max(run.estimate[0].total(), run.estimate[1].total());
  c.memory_limit_bytes = static_cast<size_t>(larger + 1024);
  const std::vector<Device> cpu = {Device::cpu(), Device::cpu()};
  try {
    check_memory_fits(run.model, run.ranges, run.schedule, cpu, c);
    FAIL() << "two ranks in one process fit a cap with room for one";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on cpu (2 rank(s)"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(check_memory_fits(run.model, run.ranges, run.schedule, cpu, c,
                                    /*one_device_per_process=*/false,
                                    /*one_rank_per_process=*/true));
  // Below the larger rank, the process holding it is refused, naming that rank alone.
  c.memory_limit_bytes = static_cast<size_t>(larger - 1024);
  try {
    check_memory_fits(run.model, run.ranges, run.schedule, cpu, c, false, true);
    FAIL() << "a cap below the larger rank was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on cpu (1 rank(s)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("but the memory limit is"), std::string::npos) << e.what();
  }
}

// A planner plans each rank's stages in rank_memory_share: on CUDA the equal share of the
// memory less each rank's cuBLASLt workspace, so that what it plans the check before the run
// takes. Where the equal share alone would let a layout through that the check refuses (room
// for the ranks and one workspace, not two), the share is below what the larger rank needs.
TEST(MemoryEstimate, CudaRankShareLeavesOutEachRanksWorkspace) {
  const TwoRanksOfOneF1B run;
  const auto& model = run.model;
  const auto& schedule = run.schedule;
  const auto& ranges = run.ranges;
  const auto& estimate = run.estimate;
  TrainConfig c = run.config;
  const double workspace = rank_context_bytes(Device::cuda(0));
  EXPECT_EQ(workspace, static_cast<double>(DeviceContextOptions{}.cublas_workspace_bytes));
  EXPECT_EQ(rank_context_bytes(Device::cpu()), 0.0);
  const double largest = std::max(estimate[0].total(), estimate[1].total());
  const std::vector<Device> gpu = {Device::cuda(0), Device::cuda(0)};

  // Room for the larger rank twice and both workspaces: planned, and the check agrees.
  double memory = std::ceil(2 * (largest + workspace));
  RankMemoryShare share = rank_memory_share(memory, 2, Device::cuda(0), "the cap");
  EXPECT_GE(share.bytes, largest);
  EXPECT_EQ(share.source, "the cap, less each rank's cuBLASLt workspace (32.0 MiB)");
  c.memory_limit_bytes = static_cast<size_t>(memory);
  EXPECT_NO_THROW(check_memory_fits(model, ranges, schedule, gpu, c));

  // A byte short of both ranks and both workspaces: the check refuses, so the share must not
  // hold the larger rank (the equal share alone, half the memory, would).
  memory = std::floor(estimate[0].total() + estimate[1].total() + 2 * workspace) - 1;
  share = rank_memory_share(memory, 2, Device::cuda(0), "the cap");
  EXPECT_LT(share.bytes, largest);
  EXPECT_GE(memory / 2, largest);
  c.memory_limit_bytes = static_cast<size_t>(memory);
  EXPECT_THROW(check_memory_fits(model, ranges, schedule, gpu, c), std::invalid_argument);

  // On the CPU a rank's context takes nothing: the equal share, said as given.
  share = rank_memory_share(memory, 2, Device::cpu(), "the cap");
  EXPECT_DOUBLE_EQ(share.bytes, memory / 2);
  EXPECT_EQ(share.source, "the cap");
  // A rank alone on its GPU still gives its workspace.
  share = rank_memory_share(memory, 1, Device::cuda(1), "the cap");
  EXPECT_DOUBLE_EQ(share.bytes, memory - workspace);
  EXPECT_EQ(share.source, "the cap, less the rank's cuBLASLt workspace (32.0 MiB)");
}

// GPU ranks as processes (NCCL over MPI) each hold the cap on the GPU of their own process,
// however many GPUs one process sees: the planner must not divide the cap among them, or it
// plans against half of what the check before the run then holds each rank to.
TEST(MemoryEstimate, GpuRanksAsProcessesArePlannedAgainstTheWholeCap) {
  const TwoRanksOfOneF1B run;
  TrainConfig c = run.config;
  const double workspace = rank_context_bytes(Device::cuda(0));
  const double largest = std::max(run.estimate[0].total(), run.estimate[1].total());
  const double smallest = std::min(run.estimate[0].total(), run.estimate[1].total());
  // Room for the larger rank and its workspace, not for the two ranks: each process's check
  // takes it, one process holding both ranks on one GPU refuses it.
  const double cap = std::ceil(largest + workspace);
  ASSERT_LT(cap, smallest + largest + 2 * workspace);
  c.memory_limit_bytes = static_cast<size_t>(cap);
  const std::vector<Device> one_gpu = {Device::cuda(0), Device::cuda(0)};
  EXPECT_NO_THROW(check_memory_fits(run.model, run.ranges, run.schedule, one_gpu, c,
                                    /*one_device_per_process=*/true,
                                    /*one_rank_per_process=*/true));
  EXPECT_THROW(check_memory_fits(run.model, run.ranges, run.schedule, one_gpu, c),
               std::invalid_argument);

  // Two processes that each see one GPU (one node each, or one GPU for both): 1, so the
  // planner's share holds the larger rank, as the check does.
  const int sharing = ranks_sharing_device_memory(Device::cuda(0), 2, /*cuda_devices=*/1,
                                                  /*one_rank_per_process=*/true);
  EXPECT_EQ(sharing, 1);
  EXPECT_GE(rank_memory_share(cap, sharing, Device::cuda(0), "the cap").bytes, largest);
  // Zero GPUs seen (a build or node without them) changes nothing.
  EXPECT_EQ(ranks_sharing_device_memory(Device::cuda(0), 4, 0, true), 1);

  // One process holding every rank: they share the GPU unless there is one per rank.
  EXPECT_EQ(ranks_sharing_device_memory(Device::cuda(0), 2, 1, false), 2);
  EXPECT_EQ(ranks_sharing_device_memory(Device::cuda(0), 2, 2, false), 1);
  // CPU ranks share the machine's memory, as processes too (their cap is planned apart).
  EXPECT_EQ(ranks_sharing_device_memory(Device::cpu(), 2, 8, false), 2);
  EXPECT_EQ(ranks_sharing_device_memory(Device::cpu(), 2, 8, true), 2);
}

// Memory whose equal share cannot hold a rank's workspace (or only exactly, which would leave
// a share of 0, read by the planner as no cap) is refused with the figures; the CPU's is not.
TEST(MemoryEstimate, CudaRankShareRefusesMemoryThatHoldsNoMoreThanTheWorkspaces) {
  const double mib = 1024.0 * 1024.0;
  const double workspace = rank_context_bytes(Device::cuda(0));
  auto refusal = [](double memory, int sharing, const std::string& source) {
    try {
      rank_memory_share(memory, sharing, Device::cuda(0), source);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no refusal");
  };
  EXPECT_EQ(refusal(48 * mib, 2, "the memory limit given (48.0 MiB) shared by 2 ranks"),
            "the memory limit given (48.0 MiB) shared by 2 ranks leaves each rank 24.0 MiB, no "
            "more than the cuBLASLt workspace (32.0 MiB) that each rank's context on cuda:0 takes "
            "from it before its stages hold anything; give more than 64.0 MiB, or fewer ranks on "
            "cuda:0");
  EXPECT_EQ(refusal(2 * workspace, 2, "two workspaces")
                .find("two workspaces leaves each rank "
                      "32.0 MiB, no more than"),
            0u);
  EXPECT_EQ(refusal(workspace, 1, "the memory limit given"),
            "the memory limit given is 32.0 MiB, no more than the cuBLASLt workspace (32.0 MiB) "
            "that the rank's context on cuda:0 takes from it before its stages hold anything; "
            "give more than 32.0 MiB");
  EXPECT_GT(rank_memory_share(2 * workspace + 2, 2, Device::cuda(0), "a little more").bytes, 0.0);
  EXPECT_DOUBLE_EQ(rank_memory_share(48 * mib, 2, Device::cpu(), "the cap").bytes, 24 * mib);
}

// The runs whose allocator peaks the estimate is held to: d=32, L=6, V=512, hidden 128,
// 1024 tokens in 8 micro-batches, 2 steps on the CPU.
TrainConfig peak_test_config(schedule::ScheduleKind kind, int stages, int chunks) {
  TrainConfig c;
  c.model = small_model();
  c.model.d_model = 32;
  c.model.hidden = 128;
  c.model.vocab = 512;
  c.model.n_layers = 6;
  c.device = Device::cpu();
  c.steps = 2;
  c.batch_tokens = 1024;
  c.microbatches = 8;
  c.stages = stages;
  c.chunks = chunks;
  c.schedule = kind;
  return c;
}

// The estimate of `trainer`'s run, on its own config, schedule and partition.
std::vector<RankMemoryEstimate> estimate_of(Trainer& trainer) {
  const TrainConfig& c = trainer.config();
  return estimate_rank_memory(trainer.model(), trainer.stage_ranges(),
                              trainer.executor().schedule(), c.optimizer.kind,
                              c.batch_tokens / c.microbatches, c.recompute);
}

// Each pipeline rank's allocator peak over the configured steps of `trainer`.
std::vector<size_t> peaks_of_steps(Trainer& trainer) {
  const TrainConfig& c = trainer.config();
  std::vector<size_t> peak(static_cast<size_t>(c.stages), 0);
  for (int step = 0; step < c.steps; ++step) {
    const StepStats stats = trainer.step();
    for (size_t r = 0; r < peak.size(); ++r)
      peak[r] = std::max(peak[r], stats.pipeline.peak_allocated_bytes[r]);
  }
  return peak;
}

// The estimate against real runs on the CPU: every rank's allocator peak over two steps, for
// every kind of schedule, keeping or recomputing activations, is at most the estimate and at
// least 1/1.25 of it. No allowance: the executor takes at most one message per stage and
// direction ahead of its list, which the estimate counts beside those its list order holds
// (BoundsTheAllocatorPeakWhenARankFallsBehind holds it to that when messages pile up).
TEST(MemoryEstimate, BoundsTheAllocatorPeakOfARun) {
  struct Layout {
    schedule::ScheduleKind kind;
    int stages, chunks;
  };
  const std::vector<Layout> layouts = {
      {schedule::ScheduleKind::kGPipe, 2, 1}, {schedule::ScheduleKind::k1F1B, 2, 1},
      {schedule::ScheduleKind::k1F1B, 4, 1},  {schedule::ScheduleKind::kInterleaved, 2, 2},
      {schedule::ScheduleKind::kZBH1, 2, 1},  {schedule::ScheduleKind::kZBV, 2, 2}};
  for (const RecomputeSpec& recompute : {RecomputeSpec::none(), RecomputeSpec::every_unit()})
    for (const Layout& layout : layouts) {
      TrainConfig c = peak_test_config(layout.kind, layout.stages, layout.chunks);
      c.recompute = recompute;
      Trainer trainer(c);
      const auto estimate = estimate_of(trainer);
      const std::vector<size_t> peak = peaks_of_steps(trainer);
      for (int r = 0; r < layout.stages; ++r) {
        SCOPED_TRACE(std::string(schedule::schedule_kind_name(layout.kind)) +
                     " p=" + std::to_string(layout.stages) + " recompute " + to_string(recompute) +
                     ", rank " + std::to_string(r));
        const double measured = static_cast<double>(peak[static_cast<size_t>(r)]);
        // Kept in the XML report (--gtest_output=xml:FILE): estimate / measured peak.
        ::testing::Test::RecordProperty(std::string(schedule::schedule_kind_name(layout.kind)) +
                                            "_p" + std::to_string(layout.stages) + "_" +
                                            to_string(recompute) + "_rank" + std::to_string(r),
                                        std::to_string(estimate[r].total() / measured));
        EXPECT_TRUE(estimate[r].complete);
        EXPECT_LE(measured, estimate[r].total());
        EXPECT_LE(estimate[r].total(), 1.25 * measured);
      }
    }
}

// The estimate against replica runs on the CPU, whose state outweighs their activations (64
// tokens a step on a model of d=24): every rank's allocator peak over two steps, each replica
// keeping the whole optimizer state or its pieces of every parameter (most of them biases and
// norms of 24 elements, which the allocator rounds up on their own), with one bucket a stage or
// many, is at most the estimate and at least 1/1.25 of it; the optimizer state is exact.
TEST(MemoryEstimate, BoundsTheAllocatorPeakOfReplicas) {
  for (const char* optimizer : {"adamw", "sgd"})
    for (const int stages : {1, 2})
      for (const int replicas : {2, 4})
        for (const bool shard : {false, true})
          for (const double bucket_mib : {0.0, 0.01}) {
            const std::string name = std::string(optimizer) + "_p" + std::to_string(stages) +
                                     "_dp" + std::to_string(replicas) + (shard ? "_sharded" : "") +
                                     (bucket_mib > 0 ? "_buckets" : "");
            TrainConfig c = peak_test_config(schedule::ScheduleKind::k1F1B, stages, 1);
            c.model = small_model();
            c.batch_tokens = 64;
            c.optimizer.kind = optimizer;
            c.data_parallel = replicas;
            c.shard_optimizer = shard;
            c.gradient_bucket_mib = bucket_mib;
            Trainer trainer(c);
            const auto estimate = estimate_replica_memory(
                trainer.model(), trainer.stage_ranges(), trainer.executor().schedule(),
                c.optimizer.kind, c.batch_tokens / c.microbatches, replicas, shard, c.recompute);
            std::vector<size_t> peak(estimate.size(), 0);
            for (int step = 0; step < c.steps; ++step) {
              const StepStats stats = trainer.step();
              ASSERT_EQ(stats.pipeline.peak_allocated_bytes.size(), peak.size());
              for (size_t r = 0; r < peak.size(); ++r)
                peak[r] = std::max(peak[r], stats.pipeline.peak_allocated_bytes[r]);
            }
            for (size_t r = 0; r < peak.size(); ++r) {
              SCOPED_TRACE(name + ", rank " + std::to_string(r));
              const double measured = static_cast<double>(peak[r]);
              // Kept in the XML report (--gtest_output=xml:FILE): estimate / measured peak.
              ::testing::Test::RecordProperty(name + "_rank" + std::to_string(r),
                                              std::to_string(estimate[r].total() / measured));
              // The optimizer state to a byte: what the rank's optimizer allocated.
              EXPECT_EQ(estimate[r].optimizer_bytes,
                        static_cast<double>(
                            trainer.executor().optimizer_state_bytes(static_cast<int>(r))));
              EXPECT_LE(measured, estimate[r].total());
              EXPECT_LE(estimate[r].total(), 1.25 * measured);
            }
          }
}

// Messages sent and received per link (source, destination) of a run, and the most seen
// still waiting in the transport right after a receive (a lower bound of that moment's).
struct LinkMessages {
  std::mutex mutex;
  std::map<std::pair<int, int>, int> sent, received, most_waiting;
};

// An in-process endpoint that sleeps `lag` before every send and receive it is asked for, and
// counts them in `messages`. With a lag its rank falls behind its peers: its executor asks at
// least once between two computes while the rank has sends or receives left, so the peers
// run ahead and their messages arrive long before its list reaches them.
class LaggingTransport : public comm::Transport {
 public:
  LaggingTransport(std::unique_ptr<comm::Transport> inner, std::chrono::microseconds lag,
                   std::shared_ptr<LinkMessages> messages)
      : inner_(std::move(inner)), lag_(lag), messages_(std::move(messages)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void send(const Tensor& t, int peer, const Stream& s) override {
    std::this_thread::sleep_for(lag_);
    inner_->send(t, peer, s);
    std::lock_guard lock(messages_->mutex);
    ++messages_->sent[{rank(), peer}];
  }
  void recv(const Tensor& t, int peer, const Stream& s) override {
    std::this_thread::sleep_for(lag_);
    inner_->recv(t, peer, s);
    count_received(peer);
  }
  bool try_recv(const Tensor& t, int peer, const Stream& s) override {
    std::this_thread::sleep_for(lag_);
    if (!inner_->try_recv(t, peer, s)) return false;
    count_received(peer);
    return true;
  }
  void all_reduce_sum(std::vector<double>& v) override { inner_->all_reduce_sum(v); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  void count_received(int peer) {
    // The sender counts a message after it is queued: at most this many still are.
    std::lock_guard lock(messages_->mutex);
    const std::pair<int, int> link{peer, rank()};
    const int waiting = messages_->sent[link] - ++messages_->received[link];
    messages_->most_waiting[link] = std::max(messages_->most_waiting[link], waiting);
  }

  std::unique_ptr<comm::Transport> inner_;
  std::chrono::microseconds lag_;
  std::shared_ptr<LinkMessages> messages_;
};

// The estimate bounds the allocator peak whatever the timing: with the first or the last
// rank lagging behind the other, so that messages arrive long before the lagging rank's list
// reaches them (with GPipe all m = 8 gradients of a step can reach the first rank before its
// first backward), every rank's peak is still at most the estimate, with no allowance beyond
// what the model counts: one message per stage and direction taken ahead of the list, the
// others left waiting in the transport.
TEST(MemoryEstimate, BoundsTheAllocatorPeakWhenARankFallsBehind) {
  struct Layout {
    schedule::ScheduleKind kind;
    int chunks;
  };
  const std::vector<Layout> layouts = {{schedule::ScheduleKind::kGPipe, 1},
                                       {schedule::ScheduleKind::k1F1B, 1},
                                       {schedule::ScheduleKind::kInterleaved, 2},
                                       {schedule::ScheduleKind::kZBV, 2}};
  const int ranks = 2;
  for (const Layout& layout : layouts)
    for (int lagging = 0; lagging < ranks; ++lagging) {
      const std::string name = std::string(schedule::schedule_kind_name(layout.kind)) + ", rank " +
                               std::to_string(lagging) + " lagging";
      const TrainConfig c = peak_test_config(layout.kind, ranks, layout.chunks);
      Trainer trainer(c);
      auto hub = comm::InProcessHub::create(ranks, std::chrono::milliseconds(60000));
      auto messages = std::make_shared<LinkMessages>();
      std::vector<std::unique_ptr<comm::Transport>> transports;
      for (int r = 0; r < ranks; ++r)
        transports.push_back(std::make_unique<LaggingTransport>(
            hub->endpoint(r), std::chrono::milliseconds(r == lagging ? 3 : 0), messages));
      trainer.executor().set_transports(std::move(transports));
      const auto estimate = estimate_of(trainer);
      const std::vector<size_t> peak = peaks_of_steps(trainer);
      const double boundary = allocated_bytes({c.batch_tokens / c.microbatches, c.model.d_model});
      for (int r = 0; r < ranks; ++r) {
        SCOPED_TRACE(name + ", rank " + std::to_string(r));
        const double measured = static_cast<double>(peak[static_cast<size_t>(r)]);
        EXPECT_LE(measured, estimate[r].total())
            << "over by " << (measured - estimate[r].total()) / boundary << " boundary tensors";
      }
      // The lag does what it is for: GPipe's gradients pile up for the lagging first rank,
      // more than the one it may take ahead of its list and the one its list has reached.
      if (layout.kind == schedule::ScheduleKind::kGPipe && lagging == 0)
        EXPECT_GE((messages->most_waiting[{1, 0}]), 3) << name;
    }
}

TEST(MemoryEstimate, ModelOfTensOfGigabytesIsRefusedAtOnce) {
  TrainConfig c;
  c.model = small_model();
  c.model.d_model = 16384;
  c.model.hidden = 65536;
  c.model.n_layers = 32;
  c.device = Device::cpu();
  c.memory_limit_bytes = size_t{8} << 30;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(Trainer trainer(c), std::invalid_argument);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
}

TEST(TrainConfigChecks, NegativeOrNonFiniteClipIsRefused) {
  for (const double clip : {-1.0, -1e-9, std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN()}) {
    TrainConfig c;
    c.optimizer.clip_norm = clip;
    EXPECT_THROW(c.validate(), std::invalid_argument) << clip;
  }
  TrainConfig off;
  off.optimizer.clip_norm = 0.0;
  EXPECT_NO_THROW(off.validate());
}

// What TrainConfig::validate says of a default configuration changed by `set`, or "accepted".
std::string refusal(const std::function<void(TrainConfig&)>& set) {
  TrainConfig c;
  set(c);
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "accepted";
}

// A program sets fields, so a count that cannot be is refused naming the field (the command
// line shows each as its flag).
TEST(TrainConfigChecks, CountsBelowOneAreRefusedNamingTheField) {
  EXPECT_EQ(refusal([](TrainConfig& c) { c.steps = 0; }),
            "TrainConfig::steps must be at least 1, got 0");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.batch_tokens = -1; }),
            "TrainConfig::batch_tokens must be at least 1, got -1");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.microbatches = 0; }),
            "TrainConfig::microbatches must be at least 1, got 0");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.stages = 0; }),
            "TrainConfig::stages must be at least 1, got 0");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.chunks = 0; }),
            "TrainConfig::chunks must be at least 1, got 0");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.data_parallel = 0; }),
            "TrainConfig::data_parallel must be at least 1, got 0");
  EXPECT_EQ(
      refusal([](TrainConfig& c) { c.cpu_threads = -1; }).rfind("TrainConfig::cpu_threads", 0), 0u);
}

// A program can set an enum field to any number by a cast: a placement of 9 ran as kShared
// without a word, a partition kind of 9 said "partition  has 0 stages".
TEST(TrainConfigChecks, EnumValuesOutsideTheirEnumsAreRefusedNamingTheField) {
  EXPECT_EQ(refusal([](TrainConfig& c) { c.placement = static_cast<RankPlacement>(9); }),
            "TrainConfig::placement must be RankPlacement::kAuto or kShared, got the value 9");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.partition.kind = static_cast<PartitionSpec::Kind>(9); }),
            "TrainConfig::partition.kind must be PartitionSpec::Kind::kUniform, kParameters or "
            "kBlocks, got the value 9");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.schedule = static_cast<schedule::ScheduleKind>(99); }),
            "TrainConfig::schedule must be schedule::ScheduleKind::kGPipe, k1F1B, kInterleaved, "
            "kZBH1 or kZBV, got the value 99");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.transport = static_cast<TransportKind>(9); }),
            "TrainConfig::transport must be TransportKind::kAuto, kInProcess, kNccl, kMpi or "
            "kNcclOverMpi, got the value 9");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.recompute.kind = static_cast<RecomputeSpec::Kind>(9); }),
            "TrainConfig::recompute.kind must be RecomputeSpec::Kind::kNone, kStage or kUnits, got "
            "the value 9");
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.device = Device{static_cast<DeviceKind>(9), 0};
            }),
            "TrainConfig::device.kind must be DeviceKind::kCpu or kCuda, got the value 9");
  // The optimizer's kind is a string, refused by OptimizerConfig::validate.
  EXPECT_EQ(refusal([](TrainConfig& c) { c.optimizer.kind = "adam"; }),
            "TrainConfig::optimizer.kind must be adamw or sgd, got 'adam'");
  // Every value of each enum is taken.
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.placement = RankPlacement::kShared;
              c.partition = PartitionSpec::by_parameters();
              c.schedule = schedule::ScheduleKind::kZBV;
              c.transport = TransportKind::kNcclOverMpi;
              c.recompute = RecomputeSpec::every_unit();
              c.device = Device::cpu();
            }),
            "accepted");
}

// 0 ranks shared the cores as one rank would, and -1 threads meant all cores.
TEST(TrainConfigChecks, CpuThreadsForFewerThanOneRankAreRefused) {
  for (const int ranks : {0, -1}) {
    try {
      cpu_threads_per_rank(0, ranks);
      ADD_FAILURE() << ranks << " ranks were given threads";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(
          std::string(e.what()),
          "cpu_threads_per_rank needs a rank count of 1 or more, got " + std::to_string(ranks));
    }
  }
  try {
    cpu_threads_per_rank(-1, 2);
    ADD_FAILURE() << "-1 threads were taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "cpu_threads_per_rank needs a thread count of 1 or more (or 0: the cores shared), "
              "got -1");
  }
  EXPECT_EQ(cpu_threads_per_rank(3, 2), 3);
  EXPECT_GE(cpu_threads_per_rank(0, 1), 1);
  EXPECT_EQ(cpu_threads_per_rank(0, 1 << 20), 1);
}

// A checkpoint records the layout and its manifest takes no larger counts than the command
// line does: a run with more is refused before it starts, not at its first save.
TEST(TrainConfigChecks, LayoutCountsPastTheCheckpointsRangeAreRefused) {
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.microbatches = kMaxMicrobatches * 2;
              c.batch_tokens = c.microbatches;
            }),
            "TrainConfig::microbatches must be at most 65536, got 131072");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.stages = 1025; }),
            "TrainConfig::stages must be at most 1024, got 1025");
  // The command line's bound: past it, 2^62 tokens were refused only by a tensor shape of the
  // memory estimate that named no setting.
  EXPECT_EQ(refusal([](TrainConfig& c) { c.batch_tokens = int64_t{1} << 62; }),
            "TrainConfig::batch_tokens must be at most 2147483648, got 4611686018427387904");
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.batch_tokens = kMaxBatchTokens;
              c.microbatches = 1;
            }),
            "accepted");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.chunks = 65; }),
            "TrainConfig::chunks must be at most 64, got 65");
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.data_parallel = 2048;
              c.microbatches = 2048;
            }),
            "TrainConfig::data_parallel must be at most 1024, got 2048");
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.stages = 1024;
              c.chunks = 64;
              c.microbatches = kMaxMicrobatches;
              c.batch_tokens = kMaxMicrobatches;
            }),
            "accepted");
}

// Deadlines are now() + timeout: "wait forever" as milliseconds::max() overflowed the clock
// and timed out at once.
TEST(TrainConfigChecks, ATransportTimeoutPastTheLargestIsRefused) {
  EXPECT_EQ(refusal([](TrainConfig& c) { c.transport_timeout = std::chrono::milliseconds::max(); }),
            "TrainConfig::transport_timeout must be from 1 ms to 1000000000 ms (10^6 s), got " +
                std::to_string(std::chrono::milliseconds::max().count()) + " ms");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.transport_timeout = std::chrono::milliseconds(0); }),
            "TrainConfig::transport_timeout must be from 1 ms to 1000000000 ms (10^6 s), got 0 ms");
  EXPECT_EQ(refusal([](TrainConfig& c) {
              c.transport_timeout = std::chrono::milliseconds(TrainConfig::kMaxTransportTimeoutMs);
            }),
            "accepted");
}

// A schedule file decides the ranks, chunks and kind: a config asking for others was run
// under the file's without a word.
TEST(TrainConfigChecks, AScheduleFileRefusesOtherStagesChunksOrKind) {
  TempDir dir;
  TrainConfig c;
  c.microbatches = 4;
  c.batch_tokens = 64;
  c.schedule_file = (dir.path() / "gpipe.txt").string();
  schedule::save_schedule(c.schedule_file,
                          schedule::generate(schedule::ScheduleKind::kGPipe, 2, 4, 1));
  EXPECT_EQ(make_schedule(c).num_ranks(), 2);  // the defaults ask for nothing
  c.stages = 2;
  c.schedule = schedule::ScheduleKind::kGPipe;
  EXPECT_EQ(make_schedule(c).num_ranks(), 2);  // the file's own
  const std::string file = "schedule file '" + c.schedule_file + "' has ";
  const auto error_of = [](const TrainConfig& config) {
    try {
      make_schedule(config);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  TrainConfig other = c;
  other.stages = 4;
  EXPECT_EQ(error_of(other), file +
                                 "2 rank(s) but TrainConfig::stages is 4; leave it at its default "
                                 "or give the file's");
  other = c;
  other.chunks = 2;
  EXPECT_EQ(error_of(other), file +
                                 "1 chunk(s) per rank but TrainConfig::chunks is 2; leave it at "
                                 "its default or give the file's");
  other = c;
  other.schedule = schedule::ScheduleKind::kZBH1;
  EXPECT_EQ(error_of(other), file +
                                 "the schedule 'gpipe' but TrainConfig::schedule is zbh1; leave it "
                                 "at its default or give the file's");
}

TEST(DataSources, FileSourceRefusesDevicesAndDirectories) {
  for (const char* path : {"/dev/zero", "/dev/null", "/"}) {
    try {
      FileSource source(path);
      FAIL() << path << " was accepted";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("not a regular file") != std::string::npos ||
                  what.find("is a directory") != std::string::npos)
          << what;
    }
  }
}

TEST(DataSources, MarkovVocabAboveTheCapIsRefusedAtOnce) {
  for (const int64_t vocab : {MarkovSource::kMaxVocab + 1, int64_t{1} << 30}) {
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(MarkovSource(vocab, 7), std::invalid_argument);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.1);
  }
}

}  // namespace
}  // namespace conveyor
