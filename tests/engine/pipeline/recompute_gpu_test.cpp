// Activation recomputation on CUDA: with every rank on cuda:0, recomputing gives the losses
// and weights of keeping the activations (the rebuilt forward runs the same kernels on the
// same input, on the compute stream, before the backward that reads it).
#include <gtest/gtest.h>

#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "support/executor_fixture.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;
using namespace conveyor::testing;

TEST(RecomputeGpu, RecomputingMatchesKeepingTheActivations) {
  CONVEYOR_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  // Deterministic kernels in the same order: the bits are expected to match; the tolerance
  // only keeps a failure readable.
  constexpr double kRtol = 1e-6, kAtol = 1e-7;
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZBH1})
    for (int p : {1, 2}) {
      const int m = 4;
      std::vector<Device> devices(p, gpu);
      const RunRecord want = run_two_steps(
          *make_executor(schedule::generate(kind, p, m), devices, PartitionSpec::uniform(),
                         test_optimizer(), RecomputeSpec::none()),
          m);
      for (const RecomputeSpec& spec :
           {RecomputeSpec::every_unit(), RecomputeSpec::of_units({2, 3, 5})}) {
        SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                     " " + to_string(spec));
        const RunRecord got =
            run_two_steps(*make_executor(schedule::generate(kind, p, m), devices,
                                         PartitionSpec::uniform(), test_optimizer(), spec),
                          m);
        EXPECT_TRUE(all_close(got.losses, want.losses, kRtol, 0.0));
        ASSERT_EQ(got.values.size(), want.values.size());
        for (size_t i = 0; i < got.values.size(); ++i)
          EXPECT_TRUE(all_close(got.values[i], want.values[i], kRtol, kAtol))
              << "value of parameter " << i;
      }
    }
}

}  // namespace
}  // namespace conveyor
