// The validator and the CPU executor agree on one execution model (docs/execution-model.md):
// generated schedules are perturbed at random, and every perturbed schedule the validator
// accepts must run to the end on the executor (a short transport timeout turns a hang into a
// failure), with the losses of the unperturbed run; every one it rejects must name a rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"
#include "engine/schedule/validator.h"
#include "support/executor_fixture.h"
#include "support/schedule_perturbation.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using schedule::Action;
using schedule::Schedule;
using schedule::ScheduleKind;
using namespace conveyor::testing;

constexpr int kTokens = 5;

// What a step leaves that depends on the order of the arithmetic.
struct StepRecord {
  double loss_sum = 0;
  double grad_norm = 0;
  std::vector<std::vector<float>> grads;
};

// One step of `sched` on CPU ranks. A rank waiting longer than a few seconds for a peer
// fails the step: under the model no accepted schedule may wait at all for long.
StepRecord run_step(Schedule sched) {
  const ModelDescription model = reference_model(test_model());
  auto ranges =
      stage_ranges(model, partition_blocks(model, sched.num_stages(), PartitionSpec::uniform()));
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(4000);
  const int m = sched.num_microbatches;
  std::vector<Device> devices(sched.num_ranks(), Device::cpu());
  PipelineExecutor ex(model, std::move(sched), std::move(ranges), std::move(devices),
                      test_optimizer(), /*seed=*/17, options);
  const auto result =
      ex.run_step(make_microbatches(m, kTokens, 1), 1.0f / (m * kTokens), /*step=*/1, 1e-2);
  StepRecord rec{result.loss_sum, result.grad_norm, {}};
  for (Parameter* p : ex.parameters()) rec.grads.push_back(to_vector_f32(p->grad));
  return rec;
}

// Whether a host that walks each rank's list in order, blocking in every receive until its
// message has been sent (sends buffered, as in-process), reaches the end of every list: the
// executor before it obeyed the model. Expects a validated schedule (FIFO links).
bool list_walk_finishes(const Schedule& s) {
  const int p = s.num_ranks();
  std::vector<size_t> position(p, 0);
  std::vector<int> sent(static_cast<size_t>(p) * p, 0), received(sent.size(), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < p; ++r)
      for (; position[r] < s.ranks[r].size(); ++position[r], moved = true) {
        const Action& a = s.ranks[r][position[r]];
        if (schedule::is_send(a.kind)) ++sent[static_cast<size_t>(r) * p + a.peer];
        if (!schedule::is_recv(a.kind)) continue;
        const size_t link = static_cast<size_t>(a.peer) * p + r;
        if (received[link] == sent[link]) break;  // blocked in this receive
        ++received[link];
      }
  }
  for (int r = 0; r < p; ++r)
    if (position[r] < s.ranks[r].size()) return false;
  return true;
}

// Same losses and gradients as `want` when the arithmetic order is the same (weight
// gradients ascending per stage); otherwise the same losses (the forwards do not depend on
// when weight gradients run, and the step sums the losses in micro-batch order) and
// gradients that add the same float terms in another order: at most a few ulps of the
// largest term apart, far less than one micro-batch's share, which a weight gradient taken
// from the wrong micro-batch's activations changes. Returns whether it compared bits.
bool expect_like_unperturbed(const Schedule& sched, const StepRecord& got, const StepRecord& want) {
  if (schedule::weight_grads_ascending(sched)) {
    EXPECT_EQ(got.loss_sum, want.loss_sum);
    EXPECT_EQ(got.grad_norm, want.grad_norm);
    EXPECT_EQ(got.grads, want.grads);
    return true;
  }
  EXPECT_EQ(got.loss_sum, want.loss_sum);
  EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm);
  EXPECT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size() && i < want.grads.size(); ++i) {
    double largest = 0.0;
    for (float v : want.grads[i]) largest = std::max(largest, std::abs(static_cast<double>(v)));
    EXPECT_TRUE(all_close(got.grads[i], want.grads[i], 1e-5, 1e-5 * largest)) << "parameter " << i;
  }
  return false;
}

const Schedule& receive_before_send() {
  // Rank 0 lists the receive of the gradient before the send of the activation the gradient
  // comes back for: valid under the model, a hang for a host that blocks in list order.
  static const Schedule s = schedule::parse_text(
      "# conveyor schedule: name=receive-before-send ranks=2 chunks=1 layout=looped "
      "microbatches=1\n"
      "r0: F0.0 RG0.0<1 B0.0 SA0.0>1\n"
      "r1: RA1.0<0 F1.0 B1.0 SG1.0>0\n");
  return s;
}

TEST(ExecutionModel, AReceiveListedBeforeTheSendItAnswersRunsToTheEnd) {
  const Schedule& s = receive_before_send();
  ASSERT_NO_THROW(schedule::validate(s));
  EXPECT_FALSE(list_walk_finishes(s));  // the case a list walk hangs in
  const StepRecord want = run_step(schedule::generate(ScheduleKind::k1F1B, 2, 1));
  const auto start = std::chrono::steady_clock::now();
  StepRecord got;
  ASSERT_NO_THROW(got = run_step(s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  expect_like_unperturbed(s, got, want);
}

TEST(ExecutionModel, EveryPerturbedScheduleTheValidatorAcceptsRunsAndEveryOtherNamesARule) {
  const std::set<std::string> rules = {"shape",   "placement", "peer", "duplicate",
                                       "missing", "order",     "fifo", "deadlock"};
  std::mt19937_64 rng(20240611);
  constexpr int kDrawsPerRecipe = 30;
  // Each perturbation alone, and chains of three reorderings (which keep every action, so
  // more of them pass and they reach orders no single step does).
  std::vector<std::pair<std::string, std::vector<Perturbation>>> recipes;
  for (Perturbation how : kAllPerturbations) recipes.push_back({perturbation_name(how), {how}});
  const Perturbation kReorderings[] = {Perturbation::kMoveWithinRank,
                                       Perturbation::kSwapSendAndReceive,
                                       Perturbation::kSwapReceives};
  recipes.push_back({"three reorderings", {}});
  int bases = 0, accepted = 0, unchanged = 0, list_walk_hangs = 0, bitwise = 0;
  std::map<std::string, int> rejected;                  // by rule
  std::map<std::string, std::pair<int, int>> outcomes;  // by recipe: accepted, rejected
  for (const auto& [kind, name] : schedule::schedule_kinds())
    for (int p = 2; p <= 4; ++p)
      for (int m = 1; m <= 4; ++m) {
        const int v = kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
        Schedule base;
        try {
          base = schedule::generate(kind, p, m, v);
        } catch (const schedule::ScheduleError&) {
          continue;  // not defined for these values (interleaved needs m % p == 0)
        }
        ++bases;
        const StepRecord want = run_step(base);
        for (const auto& [recipe, steps] : recipes)
          for (int draw = 0; draw < kDrawsPerRecipe; ++draw) {
            Schedule s = base;
            bool applied = true;
            if (steps.empty())
              for (int n = 0; n < 3; ++n)
                applied &= perturb(s, kReorderings[uniform(rng, 0, 2)], rng);
            else
              applied = perturb(s, steps[0], rng);
            if (!applied) continue;
            SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) +
                         " p=" + std::to_string(p) + " m=" + std::to_string(m) + ", " + recipe +
                         ":\n" + schedule::dump_text(s));
            try {
              schedule::validate(s);
            } catch (const schedule::ValidationError& e) {
              EXPECT_TRUE(rules.count(e.rule())) << "rule '" << e.rule() << "': " << e.what();
              ++rejected[e.rule()];
              ++outcomes[recipe].second;
              continue;
            }
            ++outcomes[recipe].first;
            if (s == base) {
              ++unchanged;
              continue;
            }
            ++accepted;
            if (!list_walk_finishes(s)) ++list_walk_hangs;
            StepRecord got;
            try {
              got = run_step(s);
            } catch (const std::exception& e) {
              ADD_FAILURE() << "an accepted schedule failed to run: " << e.what();
              continue;
            }
            if (expect_like_unperturbed(s, got, want)) ++bitwise;
          }
      }

  std::cout << bases << " generated schedules; perturbed: " << accepted << " accepted and run ("
            << list_walk_hangs << " of them would hang a host walking the list in order, "
            << bitwise << " compared bitwise with the unperturbed run, the others' weight "
            << "gradients out of micro-batch order), " << unchanged << " accepted but unchanged\n";
  for (const auto& [rule, count] : rejected)
    std::cout << "  rejected [rule: " << rule << "]: " << count << "\n";
  for (const auto& [recipe, counts] : outcomes)
    std::cout << "  " << recipe << ": " << counts.first << " accepted, " << counts.second
              << " rejected\n";

  // Not vacuous: accepted perturbations ran, many of them ones a list walk hangs in, both
  // comparisons were made, and every rule these perturbations can break was broken. (shape
  // and peer cannot be: the rank count stays, and an action moved to another rank breaks
  // placement first.)
  EXPECT_GE(bases, 50);
  EXPECT_GE(accepted, 200);
  EXPECT_GE(list_walk_hangs, 50);
  EXPECT_GE(bitwise, 100);
  EXPECT_GE(accepted - bitwise, 1);
  for (const char* rule : {"placement", "duplicate", "missing", "order", "fifo", "deadlock"})
    EXPECT_GE(rejected[rule], 1) << "no perturbation was rejected by rule " << rule;
}

}  // namespace
}  // namespace conveyor
