// `conveyor train`: builds a TrainConfig from a preset and flags, trains, prints one line per
// logged step and a summary, and optionally writes one JSON object per step.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/measured_timing.h"
#include "engine/schedule/simulator.h"
#include "engine/train/trainer.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace conveyor::cli {
namespace {

// Typed settings are spelled as words on the command line and parsed here.
struct TrainFlags {
  std::string preset = "tiny";
  int64_t d_model = 0, layers = 0, vocab = 0, hidden = 0;
  std::string activation;
  std::string device = "auto";
  std::string schedule = "1f1b";
  std::string partition = "uniform";
  std::string placement = "auto";
  std::string transport = "auto";
  TrainConfig config;
  std::string log_json;
  int64_t log_every = 10;
  double memory_limit_mb = 0.0;
  double timeout_s = 120.0;
  std::string trace;
  bool quiet = false;
};

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) bytes /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

std::string human_rate(double per_second) {
  char buf[32];
  if (per_second >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", per_second / 1e6);
  else if (per_second >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", per_second / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", per_second);
  return buf;
}

void print_pipeline(Trainer& trainer) {
  const auto& sched = trainer.executor().schedule();
  std::printf("pipeline %d rank(s) x %d chunk(s), schedule %s, transport %s, stages (units):",
              sched.num_ranks(), sched.placement.chunks, sched.name.c_str(),
              trainer.executor().uses_nccl() ? "nccl" : "in-process");
  const auto& ranges = trainer.stage_ranges();
  for (size_t s = 0; s < ranges.size(); ++s)
    std::printf(
        " %zu:[%lld,%lld)@%s", s, static_cast<long long>(ranges[s].begin),
        static_cast<long long>(ranges[s].end),
        trainer.rank_devices()[sched.placement.rank_of(static_cast<int>(s))].to_string().c_str());
  std::printf("\n");
}

// Measured bubble of the last step per rank, next to the simulator's prediction for the
// costs measured in that step; optionally the measured timeline as a Chrome trace.
void report_bubble(Trainer& trainer, const PipelineStepResult& last, const std::string& trace) {
  const auto& sched = trainer.executor().schedule();
  const schedule::SimResult measured = summarize_timing(sched, last.timing);
  const schedule::SimResult predicted =
      schedule::simulate(sched, measured_costs(sched, last.timing));
  std::printf("bubble last step: measured %.3f, simulated %.3f |", measured.bubble_fraction,
              predicted.bubble_fraction);
  for (int r = 0; r < sched.num_ranks(); ++r) {
    const double m_idle = measured.makespan > 0 ? measured.ranks[r].idle / measured.makespan : 0;
    const double p_idle = predicted.makespan > 0 ? predicted.ranks[r].idle / predicted.makespan : 0;
    std::printf(" r%d %.3f (%.3f)", r, m_idle, p_idle);
  }
  std::printf("\n");
  if (!trace.empty()) {
    std::ofstream out(trace);
    if (!out) throw UsageError("cannot write --trace file '" + trace + "'");
    out << schedule::chrome_trace_json(sched, measured, /*us_per_unit=*/1.0);
    std::printf("trace  %s (measured timeline of the last step, microseconds)\n", trace.c_str());
  }
}

schedule::ScheduleKind parse_schedule(const std::string& name) {
  if (const auto kind = schedule::parse_schedule_kind(name)) return *kind;
  throw UsageError("unknown schedule '" + name + "', expected " +
                   schedule::schedule_kind_choices());
}

// "uniform", "params", or blocks per stage such as "3,5,5,3".
PartitionSpec parse_partition(const std::string& text) {
  if (text == "uniform") return PartitionSpec::uniform();
  if (text == "params") return PartitionSpec::by_parameters();
  std::vector<int64_t> counts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || value < 0)
      throw UsageError("partition '" + text +
                       "' is not uniform, params or a list of block counts such as 3,5,5,3");
    counts.push_back(value);
  }
  if (counts.empty())
    throw UsageError("partition '" + text +
                     "' is not uniform, params or a list of block counts such as 3,5,5,3");
  return PartitionSpec::explicit_blocks(std::move(counts));
}

RankPlacement parse_placement(const std::string& name) {
  if (name == "auto") return RankPlacement::kAuto;
  if (name == "shared") return RankPlacement::kShared;
  throw UsageError("placement must be auto or shared, got '" + name + "'");
}

TransportKind parse_transport(const std::string& name) {
  if (name == "auto") return TransportKind::kAuto;
  if (name == "inproc") return TransportKind::kInProcess;
  if (name == "nccl") return TransportKind::kNccl;
  throw UsageError("transport must be auto, inproc or nccl, got '" + name + "'");
}

std::optional<Device> parse_device_choice(const std::string& text) {
  if (text == "auto") return std::nullopt;
  try {
    return parse_device(text);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

TrainConfig resolve_config(TrainFlags& f, const CLI::App& cmd) {
  TrainConfig config = f.config;
  try {
    config.model = model_preset(f.preset);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  config.device = parse_device_choice(f.device);
  config.schedule = parse_schedule(f.schedule);
  config.partition = parse_partition(f.partition);
  config.placement = parse_placement(f.placement);
  config.transport = parse_transport(f.transport);
  if (cmd.count("--d-model")) config.model.d_model = f.d_model;
  if (cmd.count("--layers")) config.model.n_layers = f.layers;
  if (cmd.count("--hidden"))
    config.model.hidden = f.hidden;
  else if (cmd.count("--d-model"))
    config.model.hidden = 4 * f.d_model;
  if (cmd.count("--vocab"))
    config.model.vocab = f.vocab;
  else if (!config.data_path.empty() && config.model.vocab < 256)
    config.model.vocab = 256;
  if (cmd.count("--activation")) config.model.activation = ops::parse_activation(f.activation);
  if (f.memory_limit_mb < 0) throw UsageError("--memory-limit-mb must be >= 0");
  config.memory_limit_bytes = static_cast<size_t>(f.memory_limit_mb * 1024.0 * 1024.0);
  if (f.log_every < 1) throw UsageError("--log-every must be at least 1");
  if (!(f.timeout_s > 0)) throw UsageError("--timeout must be positive");
  config.transport_timeout = std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000));
  try {
    config.model.validate();
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  return config;
}

void run_train(TrainFlags& f, const CLI::App& cmd) {
  TrainConfig config = resolve_config(f, cmd);
  std::string note;
  Device device;
  try {
    device = resolve_device(config.device, &note);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (!note.empty()) std::printf("conveyor: %s\n", note.c_str());
  config.device = device;

  std::unique_ptr<Trainer> trainer;
  try {
    trainer = std::make_unique<Trainer>(config);
  } catch (const std::invalid_argument& e) {  // schedule, partition, placement errors too
    throw UsageError(e.what());
  }
  std::ofstream json_log;
  if (!f.log_json.empty()) {
    json_log.open(f.log_json);
    if (!json_log) throw UsageError("cannot write --log-json file '" + f.log_json + "'");
  }
  const auto entropy = trainer->source().entropy();
  std::printf("model  %s\n", trainer->model().name.c_str());
  std::printf("data   %s\n", trainer->source().describe().c_str());
  std::printf("device %s | %lld steps x %lld tokens in %lld micro-batches | %s lr %.2g\n",
              device.to_string().c_str(), static_cast<long long>(config.steps),
              static_cast<long long>(config.batch_tokens),
              static_cast<long long>(config.microbatches), config.optimizer.kind.c_str(),
              config.optimizer.lr);
  print_pipeline(*trainer);
  std::fflush(stdout);

  PipelineStepResult last_step;
  double total_seconds = 0.0, tail_loss = 0.0, last_loss = 0.0;
  size_t peak = 0;
  const int64_t tail = std::min<int64_t>(10, config.steps);
  for (int64_t s = 1; s <= config.steps; ++s) {
    StepStats st = trainer->step();
    total_seconds += st.seconds;
    peak = std::max(peak, st.peak_bytes);
    last_loss = st.loss;
    if (s > config.steps - tail) tail_loss += st.loss / static_cast<double>(tail);
    if (json_log.is_open()) {
      nlohmann::json row = {{"step", st.step},
                            {"loss", st.loss},
                            {"tokens", st.tokens},
                            {"seconds", st.seconds},
                            {"lr", st.lr},
                            {"grad_norm", st.grad_norm},
                            {"peak_bytes", st.peak_bytes}};
      json_log << row.dump() << '\n';
    }
    if (!f.quiet && (s % f.log_every == 0 || s == 1 || s == config.steps)) {
      const double rate = st.tokens / st.seconds;
      const double eta = total_seconds / s * static_cast<double>(config.steps - s);
      std::printf("step %5lld/%lld | loss %.4f | %s tok/s | lr %.2e | mem %s | eta %.0fs\n",
                  static_cast<long long>(s), static_cast<long long>(config.steps), st.loss,
                  human_rate(rate).c_str(), st.lr, human_bytes(st.peak_bytes).c_str(), eta);
      std::fflush(stdout);
    }
    if (s == config.steps) last_step = std::move(st.pipeline);
  }
  const double tokens = static_cast<double>(config.steps * config.batch_tokens);
  std::printf("done   %lld steps, %.0f tokens in %.1f s (%s tok/s), peak memory %s\n",
              static_cast<long long>(config.steps), tokens, total_seconds,
              human_rate(tokens / total_seconds).c_str(), human_bytes(peak).c_str());
  std::printf("loss   final %.4f, mean of last %lld steps %.4f", last_loss,
              static_cast<long long>(tail), tail_loss);
  if (entropy)
    std::printf(" | source entropy %.4f, gap %+.1f%%", *entropy,
                100.0 * (tail_loss - *entropy) / *entropy);
  std::printf("\n");
  report_bubble(*trainer, last_step, f.trace);
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto flags = std::make_shared<TrainFlags>();
  TrainConfig& c = flags->config;
  CLI::App* cmd = app.add_subcommand("train", "Train the reference model");
  cmd->add_option("--preset", flags->preset, "Model preset: tiny, small, medium")
      ->capture_default_str();
  cmd->add_option("--d-model", flags->d_model, "Model width (overrides the preset)");
  cmd->add_option("--layers", flags->layers, "Number of MLP blocks (overrides the preset)");
  cmd->add_option("--vocab", flags->vocab, "Vocabulary size (overrides the preset)");
  cmd->add_option("--hidden", flags->hidden, "MLP hidden width (default 4 x d-model)");
  cmd->add_option("--activation", flags->activation, "gelu or relu");
  cmd->add_option("--steps", c.steps, "Optimizer steps")->capture_default_str();
  cmd->add_option("--batch-tokens", c.batch_tokens, "Tokens per optimizer step")
      ->capture_default_str();
  cmd->add_option("--microbatches", c.microbatches, "Micro-batches per step")
      ->capture_default_str();
  cmd->add_option("--optimizer", c.optimizer.kind, "adamw or sgd")->capture_default_str();
  cmd->add_option("--lr", c.optimizer.lr, "Peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", c.optimizer.min_lr, "Final learning rate of the cosine decay")
      ->capture_default_str();
  cmd->add_option("--warmup", c.optimizer.warmup_steps, "Linear warm-up steps")
      ->capture_default_str();
  cmd->add_option("--weight-decay", c.optimizer.weight_decay, "Decoupled weight decay")
      ->capture_default_str();
  cmd->add_option("--clip", c.optimizer.clip_norm, "Clip the global gradient norm (0: off)")
      ->capture_default_str();
  cmd->add_option("--seed", c.seed, "Seed of the weights and of the Markov source")
      ->capture_default_str();
  cmd->add_option("--data", c.data_path, "Train on the bytes of FILE instead of the Markov source");
  cmd->add_option("--device", flags->device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_flag("--tf32", c.allow_tf32, "Let fp32 GEMMs use TF32 tensor cores");
  cmd->add_option("--memory-limit-mb", flags->memory_limit_mb,
                  "Cap the device allocator (emulates a smaller device)");
  cmd->add_option("--threads", c.cpu_threads,
                  "CPU kernel threads per rank (0: all cores, shared between the ranks)")
      ->capture_default_str();
  cmd->add_option("--log-json", flags->log_json, "Write one JSON object per step to FILE");
  cmd->add_option("--log-every", flags->log_every, "Print every N steps")->capture_default_str();
  cmd->add_flag("--quiet", flags->quiet, "Only print the summary");
  cmd->add_option("--stages", c.stages, "Pipeline ranks (p)")->capture_default_str();
  cmd->add_option("--chunks", c.chunks, "Virtual stages per rank (interleaved)")
      ->capture_default_str();
  cmd->add_option("--schedule", flags->schedule, "Schedule: " + schedule_choices_text())
      ->capture_default_str();
  cmd->add_option("--schedule-file", c.schedule_file,
                  "Run the schedule in FILE (text or CSV, see `conveyor schedule --dump`)");
  cmd->add_option("--partition", flags->partition,
                  "Blocks per stage: uniform, params, or counts such as 3,5,5,3")
      ->capture_default_str();
  cmd->add_option("--placement", flags->placement,
                  "auto (one rank per GPU when there are enough) or shared (all on one GPU)")
      ->capture_default_str();
  cmd->add_option("--transport", flags->transport,
                  "auto (NCCL when every rank has its own GPU), inproc or nccl")
      ->capture_default_str();
  cmd->add_option("--timeout", flags->timeout_s, "Seconds a rank waits for a peer before failing")
      ->capture_default_str();
  cmd->add_option("--trace", flags->trace,
                  "Write the last step's measured timeline (Chrome trace)");
  cmd->callback([flags, cmd] { run_train(*flags, *cmd); });
}

}  // namespace conveyor::cli
