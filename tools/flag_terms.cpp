#include "tools/flag_terms.h"

#include <cctype>
#include <string_view>
#include <utility>

namespace conveyor::cli {
namespace {

// Each setting the library's messages name, and the flag of `conveyor train` (or plan, which
// takes the same) that sets it.
constexpr std::pair<std::string_view, std::string_view> kFlagOfSetting[] = {
    {"TrainConfig::optimizer.lr", "--lr"},
    {"TrainConfig::optimizer.min_lr", "--min-lr"},
    {"TrainConfig::optimizer.warmup_steps", "--warmup"},
    {"TrainConfig::optimizer.weight_decay", "--weight-decay"},
    {"TrainConfig::optimizer.clip_norm", "--clip"},
    {"TrainConfig::optimizer.kind", "--optimizer"},
    {"TrainConfig::optimizer.beta1", "beta1"},
    {"TrainConfig::optimizer.beta2", "beta2"},
    {"TrainConfig::optimizer.eps", "eps"},
    {"TrainConfig::optimizer.momentum", "momentum"},
    {"TrainConfig::steps", "--steps"},
    {"TrainConfig::seed", "--seed"},
    {"TrainConfig::batch_tokens", "--batch-tokens"},
    {"TrainConfig::microbatches", "--microbatches"},
    {"TrainConfig::stages", "--stages"},
    {"TrainConfig::chunks", "--chunks"},
    {"TrainConfig::data_parallel", "--dp"},
    {"TrainConfig::cpu_threads", "--threads"},
    {"TrainConfig::shard_optimizer", "--shard-optimizer"},
    {"TrainConfig::gradient_bucket_mib unset", "--bucket-mb out"},
    {"TrainConfig::gradient_bucket_mib", "--bucket-mb"},
    {"TrainConfig::data_path", "--data FILE"},
    {"TrainConfig::model.vocab", "--vocab"},
    // The model description's fields, as a resume that finds another model names them.
    {"config.preset", "--preset"},
    {"config.d_model", "--d-model"},
    {"config.n_layers", "--layers"},
    {"config.hidden", "--hidden"},
    {"config.vocab", "--vocab"},
    {"config.activation", "--activation"},
    {"TrainerCheckpointOptions::directory", "--save-dir"},
    {"TrainerCheckpointOptions::every", "--save-every"},
    {"TrainerCheckpointOptions::keep_last", "--keep"},
    {"Device::cpu()", "--device cpu"},
    {"Device::cuda()", "--device cuda"},
    {"Device::cuda(N)", "--device cuda:N"},
    {"TransportKind::kAuto", "--transport auto"},
    {"TransportKind::kInProcess", "--transport inproc"},
    {"TransportKind::kNccl", "--transport nccl"},
    {"TransportKind::kMpi", "--transport mpi"},
    {"the transport timeout", "--timeout"},
    {"schedule::save_schedule", "`conveyor schedule --dump`"},
    {"save_schedule", "`conveyor schedule --dump`"},
};

bool continues_a_name(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == ':' || c == '(';
}

}  // namespace

std::string in_flag_terms(const std::string& message) {
  std::string out;
  out.reserve(message.size());
  size_t i = 0;
  while (i < message.size()) {
    bool replaced = false;
    // A name starts a word: "schedule::save_schedule" is not read as "save_schedule", nor
    // "manifest.model.config.vocab" as "config.vocab".
    if (i == 0 || (!continues_a_name(message[i - 1]) && message[i - 1] != '.') ||
        message[i - 1] == '(') {
      for (const auto& [setting, flag] : kFlagOfSetting) {
        if (message.compare(i, setting.size(), setting) != 0) continue;
        const size_t end = i + setting.size();
        if (end < message.size() && continues_a_name(message[end]) && setting.back() != ')')
          continue;
        out += flag;
        i = end;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += message[i++];
  }
  return out;
}

}  // namespace conveyor::cli
