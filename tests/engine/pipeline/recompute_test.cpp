// Activation recomputation: the same bits as keeping the activations, for every kind of
// schedule (the zero-bubble split included), and less memory held between forward and
// backward.
#include "engine/pipeline/recompute.h"

#include <gtest/gtest.h>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/profile.h"
#include "engine/pipeline/stage.h"
#include "engine/schedule/generators.h"
#include "support/executor_fixture.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;
using namespace conveyor::testing;

std::unique_ptr<PipelineExecutor> make(ScheduleKind kind, int p, int m,
                                       const RecomputeSpec& recompute) {
  const int v = kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
  return make_executor(schedule::generate(kind, p, m, v), std::vector<Device>(p, Device::cpu()),
                       PartitionSpec::uniform(), test_optimizer(), recompute);
}

void expect_same_run(const RunRecord& got, const RunRecord& want) {
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_EQ(got.norms, want.norms);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    EXPECT_EQ(got.grads[i], want.grads[i]) << "gradient of parameter " << i;
    EXPECT_EQ(got.values[i], want.values[i]) << "value of parameter " << i;
  }
}

TEST(Recompute, GradientsAndLossesAreBitwiseThoseOfKeepingTheActivations) {
  // The test model has 8 units: embedding, 6 blocks, loss head.
  const std::vector<RecomputeSpec> specs = {
      RecomputeSpec::every_unit(), RecomputeSpec::of_units({2, 3, 5}), RecomputeSpec::of_units({0}),
      RecomputeSpec::of_units({7}), RecomputeSpec::of_units({1, 2, 3, 4, 5, 6})};
  int configurations = 0;
  for (const schedule::NamedScheduleKind& named : schedule::schedule_kinds())
    for (int p : {1, 2, 4})
      for (int m : {1, 4}) {
        const ScheduleKind kind = named.kind;
        // Two chunks per rank need 2p stages of the 8 units.
        if (kind == ScheduleKind::kInterleaved && (m % p != 0 || p * 2 > 8)) continue;
        if (kind == ScheduleKind::kZBV && p * 2 > 8) continue;
        const RunRecord want = run_two_steps(*make(kind, p, m, RecomputeSpec::none()), m);
        for (const RecomputeSpec& spec : specs) {
          SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                       " m=" + std::to_string(m) + " " + to_string(spec));
          expect_same_run(run_two_steps(*make(kind, p, m, spec), m), want);
          ++configurations;
        }
      }
  EXPECT_GE(configurations, 140);
}

// The allocator's peak falls by what the estimate predicts: the units' saved bytes of every
// micro-batch in flight, less the kept inputs and one micro-batch's rebuild. Per-unit saved
// bytes are the profile's, measured on the same allocator.
TEST(Recompute, AllocatorPeakDropsByTheEstimatedBytes) {
  const int m = 4, n = 64;
  const ModelDescription model = reference_model(test_model());
  DeviceContext ctx(Device::cpu());
  ProfileOptions profile;
  profile.microbatch_tokens = n;
  profile.warmup = 0;
  profile.repetitions = 1;
  const UnitCosts costs = profile_units(model, ctx, profile);
  std::vector<double> saved, input;
  for (const UnitCost& u : costs.units)
    saved.push_back(u.activation_bytes), input.push_back(u.input_bytes);
  const std::vector<bool> every(costs.units.size(), true);
  // Tolerance: the transients of a step (a received tensor not yet taken, the gradient passed
  // between two units, a unit's output before the next one saves it) peak at other moments
  // with and without the rebuild; on this model they differ by at most 3 boundary
  // activations, and 4 leaves room for another order of the ranks' threads.
  const double boundary = 4.0 * n * test_model().d_model;
  const double tolerance = 4 * boundary;
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B})
    for (int p : {1, 2, 4}) {
      SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p));
      auto kept = make(kind, p, m, RecomputeSpec::none());
      auto recomputed = make(kind, p, m, RecomputeSpec::every_unit());
      const auto batch = make_microbatches(m, n, 1);
      const auto a = kept->run_step(batch, 1.0f / (m * n), 1, 1e-2);
      const auto b = recomputed->run_step(batch, 1.0f / (m * n), 1, 1e-2);
      const schedule::Schedule& sched = kept->schedule();
      std::vector<StageRange> ranges;
      for (int s = 0; s < sched.num_stages(); ++s)
        ranges.push_back({kept->stage(s).unit_begin(), kept->stage(s).unit_end()});
      const auto without =
          estimate_rank_memory(model, ranges, sched, "adamw", n, RecomputeSpec::none(), saved);
      const auto with = estimate_rank_memory(model, ranges, sched, "adamw", n,
                                             RecomputeSpec::every_unit(), saved);
      // What the stages hold between actions (the executor samples there, so no backward's
      // rebuild or output gradients count): every micro-batch in flight with its saved
      // tensors, or with its kept input only.
      const auto held_kept =
          peak_activation_bytes(sched, stage_activation_bytes(saved, input, ranges, {}), false);
      auto stages = stage_activation_bytes(saved, input, ranges, every);
      for (auto& st : stages) st.rebuilt = 0, st.forward_extra = 0;
      const auto held_recomputed = peak_activation_bytes(sched, stages, false);
      double largest_drop = 0;
      for (int r = 0; r < p; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        EXPECT_EQ(static_cast<double>(a.peak_activation_bytes[r]), held_kept[r]);
        EXPECT_EQ(static_cast<double>(b.peak_activation_bytes[r]), held_recomputed[r]);
        const double predicted = without[r].activation_bytes - with[r].activation_bytes;
        const double measured = static_cast<double>(a.peak_allocated_bytes[r]) -
                                static_cast<double>(b.peak_allocated_bytes[r]);
        EXPECT_NEAR(measured, predicted, tolerance);
        largest_drop = std::max(largest_drop, predicted);
      }
      // GPipe holds every micro-batch: the first rank drops most of them.
      if (kind == ScheduleKind::kGPipe) EXPECT_GT(largest_drop, 2 * (m - 1) * boundary);
    }
}

TEST(Recompute, UnitsOutOfRangeOrListedTwiceAreRefused) {
  EXPECT_THROW(RecomputeSpec::of_units({8}).per_unit(8), std::invalid_argument);
  EXPECT_THROW(RecomputeSpec::of_units({-1}).per_unit(8), std::invalid_argument);
  EXPECT_THROW(RecomputeSpec::of_units({2, 3, 2}).per_unit(8), std::invalid_argument);
  EXPECT_THROW(make(ScheduleKind::k1F1B, 2, 2, RecomputeSpec::of_units({9})),
               std::invalid_argument);
  const auto marked = RecomputeSpec::of_units({5, 2}).per_unit(8);
  EXPECT_EQ(marked, (std::vector<bool>{false, false, true, false, false, true, false, false}));
  EXPECT_EQ(RecomputeSpec::every_unit().per_unit(3), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(to_string(RecomputeSpec::of_units({2, 3, 5})), "units:2,3,5");
  EXPECT_EQ(to_string(RecomputeSpec::every_unit()), "stage");
  EXPECT_EQ(to_string(RecomputeSpec::none()), "none");
}

}  // namespace
}  // namespace conveyor
