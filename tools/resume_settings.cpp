#include "tools/resume_settings.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>

#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_model.h"
#include "layers/ops.h"
#include "tools/cli_flags.h"

namespace conveyor::cli {
namespace {

// The reference model a manifest describes (describe_model's fields), or nothing for another
// description (a library user's model) or one that does not describe it back to the letter.
std::optional<ModelConfig> described_model(const nlohmann::json& description) {
  try {
    const nlohmann::json& c = description.at("config");
    ModelConfig model;
    model.preset = c.at("preset").get<std::string>();
    model.d_model = c.at("d_model").get<int64_t>();
    model.n_layers = c.at("n_layers").get<int64_t>();
    model.vocab = c.at("vocab").get<int64_t>();
    model.hidden = c.at("hidden").get<int64_t>();
    model.activation = ops::parse_activation(c.at("activation").get<std::string>());
    model.ln_eps = c.at("ln_eps").get<float>();
    if (describe_model(model) != c) return std::nullopt;
    return model;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  } catch (const std::invalid_argument&) {  // an activation this build does not know
    return std::nullopt;
  }
}

}  // namespace

std::vector<std::string> inherit_resumed_settings(const std::string& path, const CLI::App& cmd,
                                                  bool microbatches_chosen_elsewhere,
                                                  TrainConfig& config) {
  std::optional<Checkpoint> checkpoint;
  try {
    checkpoint.emplace(open_checkpoint(path, CheckpointCheck::kLayoutOnly));
  } catch (const CheckpointError&) {
    return {};
  }
  const TrainingState& saved = checkpoint->state();
  std::vector<std::string> inherited;
  // Sets `setting` to `value` unless `flag` was given, and records a value the default did
  // not already have.
  auto inherit = [&](const char* flag, auto& setting, const auto& value) {
    if (cmd.count(flag) || setting == value) return;
    setting = value;
    const nlohmann::json shown = value;  // exact: a double's shortest round-trip digits
    inherited.push_back(std::string(flag) + " " +
                        (shown.is_string() ? shown.get<std::string>() : shown.dump()));
  };

  bool model_given = false;
  for (const char* flag :
       {"--preset", "--d-model", "--layers", "--hidden", "--vocab", "--activation"})
    model_given = model_given || cmd.count(flag) > 0;
  if (const std::optional<ModelConfig> model = described_model(saved.model);
      model && !model_given && describe_model(*model) != describe_model(config.model)) {
    config.model = *model;
    inherited.push_back("the model " + saved.model.value("name", std::string()));
  }
  const nlohmann::json& rng = saved.rng;
  if (rng.contains("batch_tokens") && rng["batch_tokens"].is_number_integer())
    inherit("--batch-tokens", config.batch_tokens, rng["batch_tokens"].get<int64_t>());
  if (rng.contains("seed") && rng["seed"].is_number_integer())
    inherit("--seed", config.seed, rng["seed"].get<int64_t>());
  inherit("--steps", config.steps, saved.lr_schedule.total_steps);
  if (!microbatches_chosen_elsewhere)
    inherit("--microbatches", config.microbatches, saved.microbatches);
  OptimizerConfig& opt = config.optimizer;
  const OptimizerConfig& then = saved.optimizer;
  inherit("--optimizer", opt.kind, then.kind);
  inherit("--lr", opt.lr, then.lr);
  inherit("--min-lr", opt.min_lr, then.min_lr);
  inherit("--warmup", opt.warmup_steps, then.warmup_steps);
  inherit("--weight-decay", opt.weight_decay, then.weight_decay);
  inherit("--clip", opt.clip_norm, then.clip_norm);
  // No flag sets these: a checkpoint a library program saved with others keeps them.
  opt.beta1 = then.beta1;
  opt.beta2 = then.beta2;
  opt.eps = then.eps;
  opt.momentum = then.momentum;
  return inherited;
}

}  // namespace conveyor::cli
