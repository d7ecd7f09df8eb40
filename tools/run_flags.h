#pragma once
// The flags `conveyor train` and `conveyor plan` share, registered by one function so both
// accept the same values with the same checks: the model (--preset and what overrides it),
// the batch, the device and its memory cap, TF32, activation recomputation, the CPU threads
// and the data-parallel gradient buckets.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/pipeline/recompute.h"
#include "engine/train/trainer.h"
#include "layers/model.h"

namespace CLI {
class App;  // tools/cli_flags.h includes CLI11 where flags are declared or read
}  // namespace CLI

namespace conveyor::cli {

struct RunFlags {
  std::string preset = "tiny";
  int64_t d_model = 0, layers = 0, vocab = 0, hidden = 0;
  std::string activation;  // empty: the preset's
  int64_t batch_tokens = 4096;
  std::string device = "auto";
  // --memory-cap in bytes, or --memory-limit-mb in MiB, and the text given, for messages.
  std::optional<uint64_t> memory_cap_bytes;
  double memory_limit_mb = 0.0;
  std::string memory_cap_text;
  bool tf32 = false;  // a plan profiled without TF32 would time another run's GEMMs
  std::string recompute = "none";
  int threads = 0;  // CPU kernel threads per rank; 0: the cores shared between the ranks
  double bucket_mb = kDefaultGradientBucketMiB;  // --bucket-mb; applied only when given
  std::string bucket_mb_text;                    // --bucket-mb as given, for messages

  // The model of --preset with the overrides given on `cmd` (UsageError for a bad preset).
  ModelConfig model(const CLI::App& cmd) const;
  // Sets what these flags decide of `config`: the model, batch, device choice, memory cap,
  // TF32, recomputation, CPU threads and (when given) the gradient bucket size, as `train`
  // and `plan` both need them.
  void apply(const CLI::App& cmd, TrainConfig& config) const;
  // --device: nothing for auto; UsageError for a device that cannot be parsed.
  std::optional<Device> device_choice() const;
  // --memory-cap or --memory-limit-mb (0: the device's memory); UsageError for a cap under
  // 1 KiB.
  size_t memory_limit_bytes() const;
  // One line per flag given on `cmd` that does nothing on `device` (--tf32 on the CPU,
  // --threads on CUDA), so that a run does not look configured in a way it is not.
  std::vector<std::string> ignored_on(const CLI::App& cmd, Device device) const;
};

// Registers --preset, --d-model, --layers, --vocab, --hidden, --activation, --batch-tokens,
// --device, --memory-cap (or --memory-limit-mb), --tf32, --recompute, --threads and
// --bucket-mb on `cmd`, the numbers range-checked. `command` picks help texts that name only
// what that command has (plan has no --dp or --schedule-file).
enum class RunFlagsFor { kTrain, kPlan };
void add_run_flags(CLI::App* cmd, RunFlags& flags, RunFlagsFor command);

// The bytes of a --memory-cap SIZE: a number without sign or exponent (a fraction is rounded
// down to whole bytes) and an optional unit, B, KB, MB, GB, TB, PB (powers of 1000) or KiB,
// MiB, GiB, TiB, PiB (powers of 1024; K, Ki, M, Mi... too), case-insensitive; UINT64_MAX for
// sizes past it. UsageError naming `flag`, the accepted form and the value seen.
uint64_t parse_size(const std::string& text, const std::string& flag);

// `text` of --recompute (or of `source`, e.g. a plan file) for a model of `num_units` units:
// none, stage, or units:LIST of comma-separated unit indices, each once. UsageError naming
// the flag, the accepted form and the value seen.
RecomputeSpec parse_recompute(const std::string& text, int64_t num_units,
                              const std::string& source = "--recompute");

// The threads one process would start for `ranks` ranks of its own on `device`: a thread
// per rank, and on the CPU --threads kernel threads each (`threads`, 0: the cores shared
// between them). UsageError past kMaxThreadsInProcess, naming the flags and what would fit;
// `what` names the ranks (e.g. "--stages 16 x --dp 2").
inline constexpr int64_t kMaxThreadsInProcess = 4096;
void check_threads_in_process(int threads, int64_t ranks, Device device, const std::string& what);

}  // namespace conveyor::cli
