// `conveyor plan`: profiles every unit of the model on the device, plans the partition, the
// schedule and the micro-batch count for the given devices and batch (plan_training.cpp),
// prints the profile and the ranked table, and optionally writes the chosen plan for
// `conveyor train --plan FILE`. Here too the refusal when no layout fits, which best_pipeline
// also gives `conveyor train --partition auto`.
#include "tools/plan_command.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "engine/core/number_text.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/output_file.h"
#include "tools/run_flags.h"

namespace conveyor::cli {

namespace {

// The flags that run `replicas`, a data-parallel candidate of `run`: planned for one
// replica's share of --dp D, each of its P replicas is one of the run's, so the run needs
// P x D of them; each fits running its share in the candidate's micro-batches one after
// another, and --microbatches counts those of every replica.
std::string replica_run_flags(const PlannedRun& run, const PlanCandidate& replicas) {
  const size_t p = replicas.peak_bytes.size();
  const size_t all = p * static_cast<size_t>(run.replicas);
  return "--stages 1 --dp " +
         (run.replicas > 1 ? std::to_string(all) + " (" + std::to_string(p) + " x --dp " +
                                 std::to_string(run.replicas) + ")"
                           : std::to_string(p)) +
         " --microbatches " + std::to_string(all * static_cast<size_t>(replicas.microbatches)) +
         (replicas.shard_optimizer ? " --shard-optimizer" : "");
}

// Why no candidate of `run` is feasible (pipelined ones only when `pipelines`), and what
// would work.
[[noreturn]] void refuse_plan(const PlannedRun& run, bool pipelines) {
  const Plan& plan = run.plan;
  const std::string stages = std::to_string(run.stages);
  // Replicas of the whole model that fit where no pipeline does: how to run them instead.
  std::string replicas;
  for (const auto& c : plan.candidates)
    if (!c.pipelined) {
      if (c.rejected.empty()) {
        replicas = "; " + c.layout + (c.shard_optimizer ? " sharing the optimizer state" : "") +
                   (run.replicas > 1 ? " fits each replica's share" : " fits") + ": run " +
                   replica_run_flags(run, c) + " instead";
        break;
      }
      if (replicas.empty()) replicas = "; " + c.layout + " does not fit either: " + c.rejected;
    }
  int tried = 0;
  const PlanCandidate* first = nullptr;
  for (const auto& c : plan.candidates)
    if (c.pipelined && ++tried == 1) first = &c;
  if (first != nullptr)
    throw UsageError("no " + std::string(pipelines ? "pipeline " : "") + "layout fits (" +
                     std::to_string(tried) + " tried" +
                     (run.constraints.empty() ? "" : " with " + run.constraints) + "); " +
                     first->layout + ", " + std::to_string(first->microbatches) +
                     " micro-batches: " + first->rejected + replicas);
  if (run.units < run.stages)
    throw UsageError("the model has " + std::to_string(run.units) +
                     " units (the embedding, the blocks and the loss head), too few for " + stages +
                     " pipeline stages" + replicas + "; use --stages " + std::to_string(run.units) +
                     " or fewer, or more --layers");
  throw UsageError("no pipeline layout of " + stages + " stages" +
                   (run.constraints.empty() ? "" : " with " + run.constraints) +
                   " can be made for this model of " + std::to_string(run.units) +
                   " units and this batch" + replicas +
                   (run.constraints.empty() ? "" : "; leave out or change " + run.constraints));
}

}  // namespace

const PlanCandidate& best_pipeline(const PlannedRun& run) {
  if (const PlanCandidate* best = run.plan.fastest_pipeline()) return *best;
  refuse_plan(run, true);
}

void require_some_layout(const PlannedRun& run) {
  for (const auto& c : run.plan.candidates)
    if (c.rejected.empty()) return;
  refuse_plan(run, false);
}

namespace {

struct PlanFlags {
  RunFlags run;  // model, batch, device, memory cap, recomputation (shared with train)
  std::string optimizer = "adamw";
  int stages = 2;
  int repetitions = 5;
  uint64_t seed = 1;
  std::string out;
};

void run_plan(const PlanFlags& f, const CLI::App& cmd) {
  TrainConfig config;
  f.run.apply(cmd, config);
  config.stages = f.stages;
  check_optimizer_flag(f.optimizer);
  config.optimizer.kind = f.optimizer;
  config.seed = f.seed;
  try {
    config.model.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  std::string note;
  Device device;
  try {
    device = resolve_device(config.device, &note);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (!note.empty()) std::printf("conveyor: %s\n", note.c_str());
  for (const std::string& ignored : f.run.ignored_on(cmd, device))
    std::printf("note   %s\n", ignored.c_str());
  // Made before the profile runs, so that a bad path fails at once; the file itself is
  // replaced only once a plan exists, so a failed run leaves an earlier plan as it was.
  std::optional<ReplacedFile> out;
  if (!f.out.empty()) out.emplace(f.out, "--out");
  const PlannedRun run = plan_training(config, device, f.repetitions, true);
  require_some_layout(run);
  const PlanCandidate* best = run.plan.fastest_pipeline();
  if (!out) {
    // Replicas are a valid answer to `plan`; the table says so, and this says why.
    if (best == nullptr && run.units < run.stages) {
      const PlanCandidate& first =
          *std::find_if(run.plan.candidates.begin(), run.plan.candidates.end(),
                        [](const PlanCandidate& c) { return c.rejected.empty(); });
      std::printf(
          "note   the model has %lld units (the embedding, the blocks and the loss head), too "
          "few for %d pipeline stages; only %s fits: run conveyor train %s\n",
          static_cast<long long>(run.units), run.stages, first.layout.c_str(),
          replica_run_flags(run, first).c_str());
    }
    return;
  }
  // A plan file holds a pipeline (what `train --plan` runs); replicas are run by flags.
  if (best == nullptr) {
    try {
      refuse_plan(run, true);
    } catch (const UsageError& e) {
      throw UsageError(
          "--out writes a plan file, which holds only a pipeline, and none can "
          "be made: " +
          std::string(e.what()));
    }
  }
  config.device = device;
  out->commit(plan_text(*best, config));
  std::printf("plan   %s, %s, partition written to %s\n", best->layout.c_str(),
              counted(best->microbatches, "micro-batch", "micro-batches").c_str(),
              escaped_for_message(f.out).c_str());
  const PlanCandidate& first = run.plan.candidates.front();
  if (!first.pipelined)
    std::printf(
        "note   %s is faster, and a plan file holds only a pipeline: the file has the best "
        "pipeline; for the replicas run conveyor train %s instead\n",
        first.layout.c_str(), replica_run_flags(run, first).c_str());
}

}  // namespace

void register_plan_command(CLI::App& app) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Profile the model and choose partition, schedule and micro-batches");
  PlanFlags& f = *flags;
  add_run_flags(cmd, f.run, RunFlagsFor::kPlan);
  add_int_flag(cmd, "--stages", f.stages, 1, 1024, "Devices to plan for");
  cmd->add_option("--optimizer", f.optimizer, "adamw or sgd (its state counts)")
      ->capture_default_str();
  add_int_flag(cmd, "--seed", f.seed, 0, std::numeric_limits<int64_t>::max(),
               "Seed of the profiled weights");
  add_int_flag(cmd, "--repetitions", f.repetitions, 1, 1000,
               "Timed runs per unit (lower quartile)");
  add_path_flag(cmd, "--out", f.out, "Write the chosen plan (JSON) for `train --plan FILE`")
      ->type_name("FILE");
  cmd->footer(std::string("Example: conveyor plan --stages 2 --d-model 128 --layers 8 --vocab "
                          "16384 --out plan.json, then conveyor train --plan plan.json --d-model "
                          "128 --layers 8 --vocab 16384 (a plan holds only the layout: the run "
                          "repeats the model flags)\n") +
              exit_status_text("the plan file or stdout could not be written"));
  cmd->callback([flags, cmd] { run_plan(*flags, *cmd); });
}

}  // namespace conveyor::cli