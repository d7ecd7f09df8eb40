#pragma once
// A resume continues the saved run: each setting of `conveyor train` that the command line
// leaves out takes the checkpoint's value rather than the flag's default, so that
// `train --resume DIR` alone goes on as the run that saved DIR would have.
#include <string>
#include <vector>

#include "engine/train/train_config.h"

namespace CLI {
class App;  // tools/cli_flags.h includes CLI11 where flags are declared or read
}  // namespace CLI

namespace conveyor::cli {

// The model flags given on `cmd` (as "--d-model"): with any of them, the model is the flags'
// and none of its settings the checkpoint's.
std::vector<std::string> model_flags_given(const CLI::App& cmd);

// What --resume takes from the checkpoint for `cmd`: "the model" where no model flag is given,
// and each of --batch-tokens, --seed, --steps, --optimizer, --lr, --min-lr, --warmup,
// --weight-decay, --clip and (unless `microbatches_chosen_elsewhere`) --microbatches left out.
std::vector<std::string> settings_left_to_checkpoint(const CLI::App& cmd,
                                                     bool microbatches_chosen_elsewhere);

// Sets in `config` what the checkpoint at `path` (DIR, DIR/latest or DIR/step_<N>) records
// for the settings `cmd` was not given: the model (when no model flag is given), --batch-tokens,
// --seed, --steps, the optimizer and its schedule (--optimizer, --lr, --min-lr, --warmup,
// --weight-decay, --clip, and the moments' constants, which have no flags) and, unless
// `microbatches_chosen_elsewhere` (a schedule file, a plan or --partition auto chooses them),
// --microbatches. Returns each setting that so differs from the flag's default, as
// "--flag value". A checkpoint that cannot be opened changes nothing: the resume itself then
// refuses it, naming the problem.
std::vector<std::string> inherit_resumed_settings(const std::string& path, const CLI::App& cmd,
                                                  bool microbatches_chosen_elsewhere,
                                                  TrainConfig& config);

// `message`, a refusal of the settings, with the settings of `inherited` that it speaks of
// said to be the checkpoint's: the user never typed them and would look for them in vain.
std::string with_inherited_origin(const std::string& message,
                                  const std::vector<std::string>& inherited);

}  // namespace conveyor::cli
