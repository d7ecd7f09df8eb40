#include "tools/resume_settings.h"

#include <cctype>
#include <charconv>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <type_traits>

#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_model.h"
#include "layers/ops.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/flag_terms.h"

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

// The flags that set the model, each a field of it.
constexpr const char* kModelFlags[] = {"--preset", "--d-model", "--layers",
                                       "--hidden", "--vocab",   "--activation"};

// The flags whose settings a resume takes from the checkpoint when they are left out, but
// --microbatches, which a schedule file, a plan or --partition auto may choose instead.
constexpr const char* kResumedFlags[] = {"--batch-tokens", "--seed",         "--steps",
                                         "--optimizer",    "--lr",           "--min-lr",
                                         "--warmup",       "--weight-decay", "--clip"};

// A value as the flag takes it: a double in its shortest exact digits, as typed (0, not 0.0).
template <typename T>
std::string flag_text(const T& value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[40];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, value).ptr);
  } else if constexpr (std::is_arithmetic_v<T>) {
    return std::to_string(value);
  } else {
    return value;
  }
}

// Whether `message` names `flag` whole (--lr, not the start of --lr-something).
bool names_flag(const std::string& message, const std::string& flag) {
  for (size_t at = message.find(flag); at != std::string::npos; at = message.find(flag, at + 1)) {
    const size_t end = at + flag.size();
    if (end == message.size() ||
        !(std::isalnum(static_cast<unsigned char>(message[end])) || message[end] == '-'))
      return true;
  }
  return false;
}

}  // namespace

std::vector<std::string> model_flags_given(const CLI::App& cmd) {
  std::vector<std::string> given;
  for (const char* flag : kModelFlags)
    if (cmd.count(flag)) given.push_back(flag);
  return given;
}

std::vector<std::string> settings_left_to_checkpoint(const CLI::App& cmd,
                                                     bool microbatches_chosen_elsewhere) {
  std::vector<std::string> left;
  if (model_flags_given(cmd).empty()) left.push_back("the model");
  for (const char* flag : kResumedFlags)
    if (!cmd.count(flag)) left.push_back(flag);
  if (!microbatches_chosen_elsewhere && !cmd.count("--microbatches"))
    left.push_back("--microbatches");
  return left;
}

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
    inherited.push_back(std::string(flag) + " " + flag_text(value));
  };

  if (const std::optional<ModelConfig> model = described_model(saved.model);
      model && model_flags_given(cmd).empty() &&
      describe_model(*model) != describe_model(config.model)) {
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

std::string with_inherited_origin(const std::string& message,
                                  const std::vector<std::string>& inherited) {
  const std::string text = in_flag_terms(message);
  std::vector<std::string> named;
  for (const std::string& setting : inherited) {
    const std::string flag = setting.substr(0, setting.find(' '));
    bool said = false;
    if (setting.starts_with("the model ")) {  // said by any of its flags
      said = names_flag(text, "the model");
      for (const char* f : kModelFlags) said = said || names_flag(text, f);
    } else {
      said = names_flag(text, flag) ||
             (flag == "--microbatches" && text.find("micro-batch") != std::string::npos);
    }
    if (said) named.push_back(setting);
  }
  if (named.empty()) return message;
  return text + " (" + listed(named) + (named.size() == 1 ? " is" : " are") +
         " the checkpoint's, which --resume takes for the flags left out)";
}

}  // namespace conveyor::cli
