// `conveyor plan`: profiles every unit of the model on the device, plans the partition, the
// schedule and the micro-batch count for the given devices and batch, prints the profile and
// the ranked table, and optionally writes the chosen plan for `conveyor train --plan FILE`.
#include "tools/plan_command.h"

#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "engine/pipeline/profile.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/output_file.h"
#include "tools/run_flags.h"

namespace conveyor::cli {

PlannedRun plan_training(const TrainConfig& config, Device device, int repetitions, bool print) {
  if (repetitions < 1)
    throw UsageError("--repetitions must be at least 1, got " + std::to_string(repetitions));
  const ModelDescription model = reference_model(config.model);
  const int p = config.stages;
  if (config.batch_tokens < p)
    throw UsageError("a batch of " + std::to_string(config.batch_tokens) + " tokens cannot feed " +
                     std::to_string(p) + " devices; use at least " + std::to_string(p) + " tokens");
  // Profiled as the run will be: with each rank's share of the CPU threads, and on the CPU
  // with the other ranks' work running alongside on the same cores.
  DeviceContextOptions context_options;
  context_options.allow_tf32 = config.allow_tf32;
  context_options.cpu_threads = cpu_threads_per_rank(config.cpu_threads, p);
  DeviceContext ctx(device, context_options);
  ProfileOptions profile_options;
  profile_options.repetitions = repetitions;
  profile_options.seed = config.seed;
  profile_options.optimizer_slots = config.optimizer.kind == "sgd" ? 0 : 2;
  if (!device.is_cuda()) {
    profile_options.neighbours = p - 1;
    profile_options.neighbour_context = context_options;
  }
  // Each candidate micro-batch count is measured at its own size: times do not scale linearly
  // once a unit's working set leaves the caches.
  PlanOptions options;
  options.num_ranks = p;
  options.batch_tokens = config.batch_tokens;
  options.memory_cap = static_cast<double>(config.memory_limit_bytes);
  options.recompute = config.recompute;
  for (int m : {p, 2 * p, 4 * p, 8 * p})
    if (config.batch_tokens % m == 0) options.microbatch_counts.push_back(m);
  if (options.microbatch_counts.empty()) options.microbatch_counts.push_back(1);
  std::vector<UnitCosts> measured;
  for (int m : options.microbatch_counts) {
    profile_options.microbatch_tokens = config.batch_tokens / m;
    measured.push_back(profile_units(model, ctx, profile_options));
  }
  PlannedRun out;
  out.costs = measured.front();
  try {
    out.plan = plan(measured, options);
  } catch (const PlanError& e) {
    throw UsageError(e.what());
  }
  const int64_t tokens = out.costs.microbatch_tokens;
  if (print) {
    std::printf(
        "profile %s on %s, %lld tokens per micro-batch (median of %d; the plan also used sizes "
        "measured for each micro-batch count)\n",
        model.name.c_str(), device.to_string().c_str(), static_cast<long long>(tokens),
        repetitions);
    std::printf("%6s %10s %10s %10s %12s %12s\n", "unit", "F (ms)", "I (ms)", "W (ms)", "act (KiB)",
                "state (KiB)");
    for (size_t u = 0; u < out.costs.units.size(); ++u) {
      const UnitCost& c = out.costs.units[u];
      std::printf("%6zu %10.3f %10.3f %10.3f %12.1f %12.1f\n", u, c.forward * 1e3,
                  c.backward_input * 1e3, c.backward_weight * 1e3, c.activation_bytes / 1024,
                  c.state_bytes / 1024);
    }
    std::printf("transfer of one boundary activation: %.3f ms\n\n",
                out.costs.transfer_seconds * 1e3);
    std::printf("%s", format_plan(out.plan).c_str());
  }
  return out;
}

const PlanCandidate& best_pipeline(const Plan& plan) {
  for (const auto& c : plan.candidates)
    if (c.rejected.empty() && c.pipelined) return c;
  // Replicas of the whole model that fit where no pipeline does: how to run them instead.
  std::string instead;
  for (const auto& c : plan.candidates)
    if (c.rejected.empty() && !c.pipelined) {
      const std::string p = std::to_string(c.peak_bytes.size());
      instead = "; " + c.layout + (c.shard_optimizer ? " sharing the optimizer state" : "") +
                " fits: run --stages 1 --dp " + p +
                (c.shard_optimizer ? " --shard-optimizer" : "") + " instead";
      break;
    }
  // Every reason reads alike; the first one says what fits.
  for (const auto& c : plan.candidates)
    if (c.pipelined)
      throw UsageError("no pipeline layout fits (" + std::to_string(plan.candidates.size()) +
                       " tried); " + c.layout + ", " + std::to_string(c.microbatches) +
                       " micro-batches: " + c.rejected + instead);
  throw UsageError("no pipeline layout was tried: the model has too few units for the devices");
}

std::string plan_text(const PlanCandidate& candidate, int stages) {
  nlohmann::json plan = {{"stages", stages},
                         {"schedule", schedule::schedule_kind_name(candidate.kind)},
                         {"chunks", candidate.chunks},
                         {"microbatches", candidate.microbatches},
                         {"partition", blocks_of(candidate.ranges)},
                         {"recompute", to_string(candidate.recompute)},
                         {"predicted_step_seconds", candidate.step_seconds},
                         {"predicted_rank_compute_seconds", candidate.busy_seconds}};
  return plan.dump(2) + "\n";
}

void write_plan_file(OutputFile& file, const PlanCandidate& candidate, int stages) {
  file.write(plan_text(candidate, stages));
  file.close();
}

void apply_plan_text(const std::string& text, const std::string& source, TrainConfig& config) {
  try {
    const nlohmann::json plan = nlohmann::json::parse(text);
    const std::string kind = plan.at("schedule").get<std::string>();
    const auto parsed = schedule::parse_schedule_kind(kind);
    if (!parsed)
      throw UsageError(source + " names schedule '" + kind + "', expected " +
                       schedule::schedule_kind_choices());
    config.stages = plan.at("stages").get<int>();
    config.schedule = *parsed;
    config.chunks = plan.at("chunks").get<int>();
    config.microbatches = plan.at("microbatches").get<int64_t>();
    config.partition =
        PartitionSpec::explicit_blocks(plan.at("partition").get<std::vector<int64_t>>());
    // Plans written before recomputation existed keep every activation.
    config.recompute = plan.contains("recompute")
                           ? parse_recompute(plan.at("recompute").get<std::string>(),
                                             config.model.num_units(), source + " recompute")
                           : RecomputeSpec::none();
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(source +
                     " is not a plan written by `conveyor plan --out` (stages, schedule, "
                     "chunks, microbatches, partition): " +
                     e.what());
  }
}

void apply_plan_file(const std::string& path, TrainConfig& config) {
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read plan file '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  apply_plan_text(text.str(), "plan file '" + path + "'", config);
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
  // Opened before the profile runs, so that a bad path fails at once.
  std::optional<OutputFile> out;
  if (!f.out.empty()) out.emplace(f.out, "--out", /*lock=*/false);
  const PlannedRun run = plan_training(config, device, f.repetitions, true);
  if (out) {
    const PlanCandidate& best = best_pipeline(run.plan);
    write_plan_file(*out, best, f.stages);
    std::printf("plan   %s, %d micro-batches, partition written to %s\n", best.layout.c_str(),
                best.microbatches, f.out.c_str());
  }
}

}  // namespace

void register_plan_command(CLI::App& app) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Profile the model and choose partition, schedule and micro-batches");
  PlanFlags& f = *flags;
  add_run_flags(cmd, f.run);
  add_int_flag(cmd, "--stages", f.stages, 1, 1024, "Devices to plan for");
  cmd->add_option("--optimizer", f.optimizer, "adamw or sgd (its state counts)")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->capture_default_str();
  add_int_flag(cmd, "--seed", f.seed, 0, std::numeric_limits<int64_t>::max(),
               "Seed of the profiled weights");
  add_int_flag(cmd, "--repetitions", f.repetitions, 1, 1000, "Timed runs per unit (median)");
  cmd->add_option("--out", f.out, "Write the chosen plan (JSON) for `train --plan FILE`")
      ->type_name("FILE");
  cmd->footer(std::string("Example: conveyor plan --stages 2 --d-model 128 --layers 8 --vocab "
                          "16384 --out plan.json, then conveyor train --plan plan.json\n") +
              kExitStatusText);
  cmd->callback([flags, cmd] { run_plan(*flags, *cmd); });
}

}  // namespace conveyor::cli
