// The executor on CUDA: every generated schedule, with all its ranks sharing cuda:0 (own
// streams and contexts, in-process transport), gives the losses and weights of the
// one-stage CUDA run; and the one-stage CUDA run agrees with the CPU reference.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>

#include "comm/nccl.h"
#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "support/executor_fixture.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;
using namespace conveyor::testing;

void expect_matches(const RunRecord& got, const RunRecord& want, double rtol, double atol) {
  EXPECT_TRUE(testing::all_close(got.losses, want.losses, rtol, 0.0));
  EXPECT_TRUE(testing::all_close(got.norms, want.norms, rtol, 0.0));
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t i = 0; i < got.values.size(); ++i)
    EXPECT_TRUE(testing::all_close(got.values[i], want.values[i], rtol, atol))
        << "value of parameter " << i;
}

TEST(ExecutorGpu, EveryScheduleOnOneGpuMatchesTheOneStageRun) {
  CONVEYOR_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  constexpr double kRtol = 1e-6;  // fp32; the same kernels run in the same order
  constexpr double kAtol = 1e-7;  // for weights that pass near zero
  const std::vector<int> ms = {1, 4, 8};
  std::map<int, RunRecord> reference;
  for (int m : ms) {
    auto one = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), gpu);
    reference[m] = run_two_steps(*one, m);
  }
  int configurations = 0;
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1, ScheduleKind::kInterleaved})
    for (int p : {1, 2, 4})
      for (int m : ms) {
        const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
        schedule::Schedule sched;
        try {
          sched = schedule::generate(kind, p, m, v);
        } catch (const schedule::ScheduleError&) {
          continue;  // not defined for these values (interleaved needs m % p == 0)
        }
        SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                     " m=" + std::to_string(m));
        auto ex = make_executor(std::move(sched), gpu);
        const RunRecord got = run_two_steps(*ex, m);
        expect_matches(got, reference[m], kRtol, kAtol);
        ++configurations;
      }
  // 3 x 3 x 3 for GPipe, 1F1B, ZB-H1, and interleaved wherever m % p == 0.
  EXPECT_GE(configurations, 30);
}

TEST(ExecutorGpu, OneStageCudaRunAgreesWithTheCpuRun) {
  CONVEYOR_REQUIRE_GPU();
  for (int m : {1, 4}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    auto cpu = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), Device::cpu());
    auto gpu = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), Device::cuda(0));
    const RunRecord want = run_two_steps(*cpu, m);
    const RunRecord got = run_two_steps(*gpu, m);
    // Different kernels and summation orders (cuBLAS, Eigen): a loose bound. Weights are
    // not compared: AdamW's first steps move each weight by about +-lr whatever the size of
    // its gradient, so a near-zero gradient of the other sign is a large, legitimate gap.
    EXPECT_TRUE(testing::all_close(got.losses, want.losses, 1e-4, 0.0));
    EXPECT_TRUE(testing::all_close(got.norms, want.norms, 1e-3, 0.0));
  }
}

// Gradients and weights, not only losses and norms: a layout slip in a CUDA backward (dW
// transposed, dx from the wrong operand) can keep the norm and still train wrongly. SGD is
// linear in the gradients, so GPU-vs-CPU differences stay at rounding size (AdamW would turn
// a rounding-size gradient into a full-size update).
TEST(ExecutorGpu, OneStageGradientsAndWeightsMatchTheCpu) {
  CONVEYOR_REQUIRE_GPU();
  constexpr int m = 4;
  OptimizerConfig sgd;
  sgd.kind = "sgd";
  sgd.lr = 5e-2;
  sgd.clip_norm = 0.5;
  auto on = [&](Device device) {
    auto ex = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), {device},
                            PartitionSpec::uniform(), sgd);
    return run_two_steps(*ex, m, sgd.lr);
  };
  const RunRecord cpu = on(Device::cpu());
  const RunRecord gpu = on(Device::cuda(0));
  ASSERT_EQ(gpu.grads.size(), cpu.grads.size());
  for (size_t s = 0; s < cpu.losses.size(); ++s) {
    EXPECT_NEAR(gpu.losses[s], cpu.losses[s], 1e-4 * std::abs(cpu.losses[s])) << "step " << s;
    EXPECT_NEAR(gpu.norms[s], cpu.norms[s], 1e-3 * std::abs(cpu.norms[s])) << "step " << s;
  }
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    EXPECT_TRUE(testing::all_close(gpu.grads[i], cpu.grads[i], 1e-3, 1e-6))
        << "gradient of parameter " << i;
    EXPECT_TRUE(testing::all_close(gpu.values[i], cpu.values[i], 1e-4, 1e-6))
        << "value of parameter " << i;
  }
}

#ifdef CONVEYOR_WITH_CUDA
// The NCCL transport under the executor, set through set_transports (on one GPU the
// automatic choice is the in-process transport). One GPU: a one-rank clique, whose all-reduce must
// be the identity.
TEST(ExecutorGpu, NcclTransportOnOneRankGivesTheInProcessResultBitwise) {
  CONVEYOR_REQUIRE_GPU();
  for (int m : {1, 4}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    auto plain = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), Device::cuda(0));
    auto nccl = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), Device::cuda(0));
    nccl->set_transports(comm::make_nccl_transports({0}, std::chrono::milliseconds(60000)));
    const RunRecord want = run_two_steps(*plain, m);
    const RunRecord got = run_two_steps(*nccl, m);
    EXPECT_EQ(got.losses, want.losses);
    EXPECT_EQ(got.norms, want.norms);
    EXPECT_EQ(got.values, want.values);
  }
}

// Several GPUs, one rank each, transfers through NCCL: the one-stage result on cuda:0.
TEST(ExecutorGpu, NcclTransportAcrossGpusMatchesTheOneStageRun) {
  CONVEYOR_REQUIRE_GPU();
  const int gpus = cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "needs two CUDA devices";
  const int m = 4;
  auto one = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m), Device::cuda(0));
  const RunRecord want = run_two_steps(*one, m);
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1, ScheduleKind::kInterleaved})
    for (int p : {2, 4}) {
      if (p > gpus) continue;
      const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
      SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p));
      std::vector<Device> devices;
      std::vector<int> indices;
      for (int r = 0; r < p; ++r) devices.push_back(Device::cuda(r)), indices.push_back(r);
      schedule::Schedule sched;
      try {
        sched = schedule::generate(kind, p, m, v);
      } catch (const schedule::ScheduleError&) {
        continue;  // not defined for these values
      }
      auto ex = make_executor(std::move(sched), devices);
      ex->set_transports(comm::make_nccl_transports(indices, std::chrono::milliseconds(60000)));
      expect_matches(run_two_steps(*ex, m), want, 1e-6, 1e-7);
    }
}
#endif

}  // namespace
}  // namespace conveyor
