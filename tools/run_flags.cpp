#include "tools/run_flags.h"

#include <stdexcept>
#include <vector>

#include "layers/ops.h"
#include "tools/cli_common.h"

namespace conveyor::cli {

// Token ids are i32 and the embedding is a [vocab, d_model] table: beyond this the memory
// estimate refuses anyway, so the flag says it at once.
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr double kMinMemoryCapBytes = 1024.0;
constexpr double kMaxMemoryCapBytes = 1125899906842624.0;  // 2^50, as --memory-limit-mb's 2^30 MiB

ModelConfig RunFlags::model(const CLI::App& cmd) const {
  ModelConfig model = preset_with_overrides(preset, d_model, layers, hidden, vocab, cmd);
  if (cmd.count("--activation")) model.activation = ops::parse_activation(activation);
  return model;
}

void RunFlags::apply(const CLI::App& cmd, TrainConfig& config) const {
  config.model = model(cmd);
  config.batch_tokens = batch_tokens;
  config.device = device_choice();
  config.memory_limit_bytes = memory_limit_bytes();
  config.allow_tf32 = tf32;
  config.recompute = parse_recompute(recompute, config.model.num_units());
  config.cpu_threads = threads;
  if (cmd.count("--bucket-mb")) {
    if (bucket_mb > 0 && bucket_mb < kMinGradientBucketMiB)
      throw UsageError("--bucket-mb " + escape_for_message(bucket_mb_text) +
                       " is less than 1 KiB, the smallest bucket accepted; give at least "
                       "0.0009765625 (1 KiB), or 0 for one bucket per stage");
    config.gradient_bucket_mib = bucket_mb;
  }
}

std::optional<Device> RunFlags::device_choice() const {
  if (device == "auto") return std::nullopt;
  try {
    return parse_device(device);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

size_t RunFlags::memory_limit_bytes() const {
  const bool sized = !memory_cap.empty();
  const double bytes = sized ? std::stod(memory_cap) : memory_limit_mb * 1024.0 * 1024.0;
  // A cap that rounds to nothing would read as "no cap" (0), and under 1 KiB no allocation of
  // the allocator's smallest block fits anyway.
  if (sized && bytes > kMaxMemoryCapBytes)
    throw UsageError("--memory-cap " + memory_cap + " bytes is more than 1 PiB, the largest cap "
                     "accepted; give the device's size, or 0 for the device's own memory");
  if (bytes > 0 && bytes < kMinMemoryCapBytes)
    throw UsageError(sized ? "--memory-cap " + memory_cap +
                                 " bytes is less than 1 KiB, the smallest cap accepted; give at "
                                 "least 1KiB, or 0 for the device's own memory"
                           : "--memory-limit-mb " + format_number(memory_limit_mb) +
                                 " is less than 1 KiB, the smallest cap accepted; give at least " +
                                 format_number(kMinMemoryCapBytes / (1024.0 * 1024.0)) +
                                 " MiB, or 0 for the device's own memory");
  return static_cast<size_t>(bytes);
}

void add_run_flags(CLI::App* cmd, RunFlags& f) {
  cmd->add_option("--preset", f.preset,
                  "Model preset: tiny, small, medium (the model flags below override it)")
      ->capture_default_str();
  // 0 is left to the model's own check, which names the field.
  add_int_flag(cmd, "--d-model", f.d_model, 0, 65536, "Model width")->default_str("preset");
  // Bounded up front: the partitioner and the model walk every block.
  add_int_flag(cmd, "--layers", f.layers, 1, 4096, "Number of MLP blocks")->default_str("preset");
  add_int_flag(cmd, "--vocab", f.vocab, 2, kMaxVocab, "Vocabulary size")
      ->default_str("preset, 256 with train --data");
  add_int_flag(cmd, "--hidden", f.hidden, 1, 1 << 20, "MLP hidden width")
      ->default_str("4 x d-model");
  cmd->add_option("--activation", f.activation, "gelu or relu")->default_str("preset");
  add_int_flag(cmd, "--batch-tokens", f.batch_tokens, 1, int64_t{1} << 31,
               "Tokens per optimizer step");
  cmd->add_option("--device", f.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  // CLI11's size parser: a number of bytes with an optional unit (KiB, MiB, GiB; KB = 1000).
  CLI::Option* cap =
      cmd->add_option("--memory-cap", f.memory_cap,
                      "Cap each device's memory, emulating a smaller device: bytes with a unit "
                      "such as 512MiB or 80GiB (0: the device's own memory)")
          // Before the transform, which would wrap a negative size around to 16 EiB.
          ->check([](const std::string& text) {
            return text.find('-') != std::string::npos
                       ? "a size is a whole number of bytes, KiB, MiB or GiB, got '" + text + "'"
                       : std::string();
          })
          ->transform(CLI::AsSizeValue(true))
          ->type_name("SIZE");
  add_float_flag(cmd, "--memory-limit-mb", f.memory_limit_mb, 0.0, 1073741824.0, false,
                 "The same cap in MiB (--memory-cap is the documented name)")
      ->excludes(cap);
  cmd->add_flag("--tf32", f.tf32, "Let fp32 GEMMs use TF32 tensor cores (default off)");
  cmd->add_option("--recompute", f.recompute,
                  "Re-run the forward in the backward instead of keeping activations: none, "
                  "stage (every unit) or units:LIST of unit indices such as units:2,3,5")
      ->capture_default_str();
  add_int_flag(cmd, "--threads", f.threads, 0, 4096,
               "CPU kernel threads per rank (0: all cores, shared between the ranks)");
  // Kept as written too, so a refusal quotes the user's text (1e-400 is no double).
  cmd->add_option_function<std::string>(
         "--bucket-mb",
         [flags = &f](const std::string& text) {
           flags->bucket_mb = parse_float(text, "--bucket-mb", 0.0, kMaxGradientBucketMiB);
           flags->bucket_mb_text = text;
         },
         "With --dp: all-reduce each stage's gradients in buckets of at most this many "
         "MiB, ceil(stage gradient bytes / bucket) of them (0: one bucket per stage); "
         "a --schedule-file keeps its own buckets, and a size given with it must agree")
      ->type_name("NUM")
      ->default_str(format_number(f.bucket_mb));
}

RecomputeSpec parse_recompute(const std::string& text, int64_t num_units,
                              const std::string& source) {
  const std::string last = std::to_string(num_units - 1);
  const std::string form = "none, stage or units:LIST (comma-separated unit indices from 0 to " +
                           last + ", each once, e.g. units:2,3,5)";
  auto fail = [&](const std::string& why) -> RecomputeSpec {
    throw UsageError(source + " expects " + form + ", got '" + escape_for_message(text) + "'" +
                     why);
  };
  if (text == "none") return RecomputeSpec::none();
  if (text == "stage") return RecomputeSpec::every_unit();
  const std::string prefix = "units:";
  if (text.compare(0, prefix.size(), prefix) != 0 || text.size() == prefix.size()) return fail("");
  std::vector<int64_t> units;
  std::vector<bool> seen(static_cast<size_t>(num_units), false);
  size_t at = prefix.size();
  while (true) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? comma : comma - at);
    bool digits = !item.empty() && item.size() <= 18;
    for (const char c : item) digits = digits && c >= '0' && c <= '9';
    if (!digits) return fail(" ('" + escape_for_message(item) + "' is not a unit index)");
    const int64_t u = std::stoll(item);
    if (u >= num_units) return fail(" (unit " + item + " is out of range)");
    if (seen[static_cast<size_t>(u)]) return fail(" (unit " + item + " is listed twice)");
    seen[static_cast<size_t>(u)] = true;
    units.push_back(u);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return RecomputeSpec::of_units(std::move(units));
}

}  // namespace conveyor::cli
