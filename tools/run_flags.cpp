#include "tools/run_flags.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <vector>

#include "engine/core/number_text.h"
#include "engine/train/run_limits.h"
#include "layers/ops.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"

namespace conveyor::cli {

constexpr double kMinMemoryCapBytes = 1024.0;
constexpr double kMaxMemoryCapBytes = 1125899906842624.0;  // 2^50: 1 PiB
constexpr double kMaxMemoryCapMiB = 1073741824.0;          // the same 1 PiB

ModelConfig RunFlags::model(const CLI::App& cmd) const {
  ModelConfig model = preset_with_overrides(preset, d_model, layers, hidden, vocab, cmd);
  if (cmd.count("--activation")) {
    try {
      model.activation = ops::parse_activation(activation);
    } catch (const std::invalid_argument&) {
      throw not_one_of("--activation", "gelu or relu", activation);
    }
  }
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
      throw UsageError("--bucket-mb " + escaped_for_message(bucket_mb_text) +
                       " is less than 1 KiB, the smallest bucket accepted; give at least "
                       "0.0009765625 (1 KiB), or 0 for one bucket per stage");
    config.gradient_bucket_mib = bucket_mb;
  }
}

std::optional<Device> RunFlags::device_choice() const {
  if (device == "auto") return std::nullopt;
  try {
    return parse_device(device);
  } catch (const std::invalid_argument&) {
    throw not_one_of("--device", "auto, cpu, cuda or cuda:N (N: a GPU index, in digits)", device);
  }
}

size_t RunFlags::memory_limit_bytes() const {
  const bool sized = memory_cap_bytes.has_value();
  // Exact: a double times a power of two, and 2^50 bytes fit a double's mantissa.
  const double bytes =
      sized ? static_cast<double>(*memory_cap_bytes) : memory_limit_mb * 1024.0 * 1024.0;
  const std::string given = sized ? "--memory-cap " + escaped_for_message(memory_cap_text)
                                  : "--memory-limit-mb " + escaped_for_message(memory_cap_text);
  if (bytes > kMaxMemoryCapBytes)
    throw UsageError(given +
                     " is more than 1 PiB, the largest cap accepted; give the device's "
                     "size, or 0 for what the device can give now");
  // A cap that rounds to nothing would read as 0, what the device can give now, and under
  // 1 KiB no allocation of the allocator's smallest block fits anyway. A size such as 0.5B
  // rounds down to 0 bytes; only a number of zeros asks for the device's figure (units hold
  // no digits).
  const bool asked_for_some = memory_cap_text.find_first_of("123456789") != std::string::npos;
  if ((bytes > 0 || asked_for_some) && bytes < kMinMemoryCapBytes)
    throw UsageError(given + (sized ? " is " + counted(*memory_cap_bytes, "byte") + "," : " is") +
                     " less than 1 KiB, the smallest cap accepted; give at least " +
                     (sized ? "1KiB" : "0.0009765625 MiB (1 KiB)") +
                     ", or 0 for what the device can give now");
  return static_cast<size_t>(bytes);
}

std::vector<std::string> RunFlags::ignored_on(const CLI::App& cmd, Device device) const {
  std::vector<std::string> notes;
  if (tf32 && device.is_cpu())
    notes.push_back("--tf32 does nothing on the CPU, whose GEMMs are fp32 throughout");
  if (cmd.count("--threads") && device.is_cuda())
    notes.push_back("--threads " + std::to_string(threads) +
                    " sets the CPU kernels' threads and does nothing on " + device.to_string());
  return notes;
}

uint64_t parse_size(const std::string& text, const std::string& flag) {
  auto fail = [&](const char* why) -> uint64_t {
    throw UsageError(flag +
                     " expects a number of bytes with an optional unit (B, KB, MB, GB, "
                     "TB, PB: powers of 1000; KiB, MiB, GiB, TiB, PiB: powers of 1024), without "
                     "sign or exponent, such as 512MiB or 1.5GiB (rounded down to whole bytes); "
                     "got '" +
                     escaped_for_message(text) + "'" + why);
  };
  // The number: whole digits, and a fraction after a point; either may be left out, not both.
  size_t i = std::min(text.find_first_not_of("0123456789."), text.size());
  const std::string_view number = std::string_view(text).substr(0, i);
  const size_t point = std::min(number.find('.'), number.size());
  const std::string_view whole_digits = number.substr(0, point);
  const std::string_view fraction_digits = number.substr(std::min(point + 1, number.size()));
  if (whole_digits.empty() && fraction_digits.empty()) return fail("");
  // Each part is plain digits (a second point is not).
  const std::optional<uint64_t> whole =
      whole_digits.empty() ? 0 : parse_decimal_digits(whole_digits);
  if (!whole || (!fraction_digits.empty() && !parse_decimal_digits(fraction_digits)))
    return fail("");
  // Digits past the 18th change no byte count a unit up to 2^50 makes.
  const std::string_view kept_fraction = fraction_digits.substr(0, 18);
  const uint64_t fraction = kept_fraction.empty() ? 0 : *parse_decimal_digits(kept_fraction);
  uint64_t scale = 1;
  for (size_t d = 0; d < kept_fraction.size(); ++d) scale *= 10;
  while (i < text.size() && text[i] == ' ') ++i;
  std::string unit;
  for (; i < text.size(); ++i)
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  static const std::vector<std::pair<std::string, uint64_t>> units = [] {
    std::vector<std::pair<std::string, uint64_t>> out = {{"", 1}, {"b", 1}};
    uint64_t k = 1, ki = 1;
    for (const char* p : {"k", "m", "g", "t", "p"}) {
      k *= 1000;
      ki *= 1024;
      out.insert(out.end(), {{p, k},
                             {std::string(p) + "b", k},
                             {std::string(p) + "i", ki},
                             {std::string(p) + "ib", ki}});
    }
    return out;
  }();
  const auto found =
      std::find_if(units.begin(), units.end(), [&](const auto& u) { return u.first == unit; });
  if (found == units.end()) {
    // "1e3KiB" reads as the unit "e3kib": say what it is.
    const bool exponent = unit.size() > 1 && unit[0] == 'e' &&
                          (std::isdigit(static_cast<unsigned char>(unit[1])) != 0 ||
                           unit[1] == '+' || unit[1] == '-');
    return fail(exponent ? " (an exponent)" : " (unknown unit)");
  }
  const unsigned __int128 bytes = static_cast<unsigned __int128>(*whole) * found->second +
                                  static_cast<unsigned __int128>(fraction) * found->second / scale;
  // Saturated: the caller's largest size refuses it with its own bound.
  if (bytes > UINT64_MAX) return UINT64_MAX;
  return static_cast<uint64_t>(bytes);
}

void add_run_flags(CLI::App* cmd, RunFlags& f, RunFlagsFor command) {
  cmd->add_option("--preset", f.preset,
                  "Model preset: tiny, small, medium (the model flags below override it)")
      ->capture_default_str();
  add_int_flag(cmd, "--d-model", f.d_model, 1, ModelConfig::kMaxWidth, "Model width")
      ->default_str("preset");
  add_int_flag(cmd, "--layers", f.layers, 1, ModelConfig::kMaxLayers, "Number of MLP blocks")
      ->default_str("preset");
  add_int_flag(cmd, "--vocab", f.vocab, 2, ModelConfig::kMaxVocab, "Vocabulary size")
      ->default_str(command == RunFlagsFor::kTrain ? "preset, at least 256 with --data" : "preset");
  add_int_flag(cmd, "--hidden", f.hidden, 1, ModelConfig::kMaxHidden, "MLP hidden width")
      ->default_str("4 x d-model");
  cmd->add_option("--activation", f.activation, "gelu or relu")->default_str("preset");
  add_int_flag(cmd, "--batch-tokens", f.batch_tokens, 1, kMaxBatchTokens,
               "Tokens per optimizer step");
  cmd->add_option("--device", f.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  CLI::Option* cap = cmd->add_option_function<std::string>(
                            "--memory-cap",
                            [&f](const std::string& text) {
                              f.memory_cap_bytes = parse_size(text, "--memory-cap");
                              f.memory_cap_text = text;
                            },
                            "Cap each device's memory, emulating a smaller device: bytes with "
                            "an optional unit, B, KB, MB, GB, TB, PB (powers of 1000) or KiB, "
                            "MiB, GiB, TiB, PiB (powers of 1024), case-insensitive and with or "
                            "without the B (512M, 512mi), such as 512MiB or 1.5GiB (a "
                            "fraction is rounded down to whole bytes), up to 1PiB; 0: what "
                            "the device can give now")
                         ->type_name("SIZE");
  cmd->add_option_function<std::string>(
         "--memory-limit-mb",
         [&f](const std::string& text) {
           // The numbers every flag takes; the range said exactly (parse_float's %g would
           // show 1.07374e+09).
           try {
             f.memory_limit_mb = parse_float(text, "--memory-limit-mb", 0.0, kMaxMemoryCapMiB);
           } catch (const UsageError&) {
             throw UsageError(
                 "--memory-limit-mb expects a finite number of MiB in [0, "
                 "1073741824] (1 PiB), got '" +
                 escaped_for_message(text) + "'");
           }
           f.memory_cap_text = text;
         },
         "The same cap in MiB, in [0, 1073741824] (--memory-cap is the documented name)")
      ->type_name("NUM")
      ->default_str("0")
      ->excludes(cap);
  add_switch(cmd, "--tf32", f.tf32, "Let fp32 GEMMs use TF32 tensor cores (default off)");
  cmd->add_option("--recompute", f.recompute,
                  "Re-run the forward in the backward instead of keeping activations: none, "
                  "stage (every unit) or units:LIST of unit indices such as units:2,3,5")
      ->capture_default_str();
  add_int_flag(cmd, "--threads", f.threads, 0, TrainConfig::kMaxCpuThreads,
               "CPU kernel threads per rank (0: all cores, shared between the ranks)");
  // Kept as written too, so a refusal quotes the user's text (1e-400 is no double).
  cmd->add_option_function<std::string>(
         "--bucket-mb",
         [flags = &f](const std::string& text) {
           flags->bucket_mb = parse_float(text, "--bucket-mb", 0.0, kMaxGradientBucketMiB);
           flags->bucket_mb_text = text;
         },
         command == RunFlagsFor::kTrain
             ? "With --dp: all-reduce each stage's gradients in buckets of at most this many "
               "MiB, ceil(stage gradient bytes / bucket) of them (0: one bucket per stage); a "
               "--schedule-file keeps its own buckets, and a size given with it must agree"
             : "Cost the all-reduce of the data-parallel row's gradients in buckets of at most "
               "this many MiB, each paying the latency again, as train --bucket-mb would run "
               "them (0: one bucket)")
      ->type_name("NUM")
      ->default_str(format_number(f.bucket_mb));
}

void check_threads_in_process(int threads, int64_t ranks, Device device, const std::string& what) {
  // Every thread is a process id of the machine's (32768 of them on some systems): tens of
  // thousands would leave the other programs there unable to start one.
  const int64_t per_rank =
      device.is_cpu()
          ? cpu_threads_per_rank(threads,
                                 static_cast<int>(std::min<int64_t>(ranks, kMaxThreadsInProcess)))
          : 1;
  if (ranks * per_rank <= kMaxThreadsInProcess) return;
  const std::string limit =
      "at most " + std::to_string(kMaxThreadsInProcess) + " are started in one process";
  if (ranks > kMaxThreadsInProcess)
    throw UsageError(std::to_string(ranks) + " ranks in one process (" + what +
                     "), each a thread of its own; " + limit +
                     ": use fewer, or run one rank per process under mpirun");
  throw UsageError("--threads " + std::to_string(threads) + " for each of " +
                   std::to_string(ranks) + " ranks in one process (" + what + ") is " +
                   std::to_string(ranks * per_rank) + " kernel threads; " + limit +
                   ": give --threads " + std::to_string(kMaxThreadsInProcess / ranks) +
                   " or fewer, or 0 to share the cores between the ranks");
}

RecomputeSpec parse_recompute(const std::string& text, int64_t num_units,
                              const std::string& source) {
  const std::string last = std::to_string(num_units - 1);
  const std::string form = "none, stage or units:LIST (comma-separated unit indices from 0 to " +
                           last + ", each once, e.g. units:2,3,5)";
  auto fail = [&](const std::string& why) -> RecomputeSpec {
    throw UsageError(source + " expects " + form + ", got '" + escaped_for_message(text) + "'" +
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
    const std::optional<uint64_t> index = parse_decimal_digits(item);
    if (!index) return fail(" ('" + escaped_for_message(item) + "' is not a unit index)");
    if (*index >= static_cast<uint64_t>(num_units))
      return fail(" (unit " + item + " is out of range)");
    const auto u = static_cast<int64_t>(*index);
    if (seen[static_cast<size_t>(u)]) return fail(" (unit " + item + " is listed twice)");
    seen[static_cast<size_t>(u)] = true;
    units.push_back(u);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return RecomputeSpec::of_units(std::move(units));
}

}  // namespace conveyor::cli
