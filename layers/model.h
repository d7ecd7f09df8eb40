#pragma once
// The reference model and its presets:
//   token embedding -> L × MlpBlock -> LossHead
// as an ordered list of units (unit 0 the embedding, units 1..L the blocks, unit L+1 the
// head) so that a pipeline can cut it into contiguous ranges of units.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "layers/layer.h"
#include "layers/ops.h"

namespace conveyor {

struct ModelConfig {
  std::string preset = "tiny";
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t vocab = 64;
  int64_t hidden = 256;  // MLP width, 4·d_model by default
  ops::ActivationKind activation = ops::ActivationKind::GELU;
  float ln_eps = 1e-5f;

  int64_t num_units() const { return n_layers + 2; }
  // Throws std::invalid_argument naming the first bad field.
  void validate() const;
  std::string to_string() const;
};

// "tiny" (CPU default), "small" (d=1024, L=8, V=32768), "medium" (d=2048, L=16, V=32768).
// Throws std::invalid_argument listing the presets for an unknown name.
ModelConfig model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

// Unit `index` of the model (see above), with parameters not yet materialised.
std::unique_ptr<Layer> make_model_unit(const ModelConfig& config, int64_t index);
// Units [begin, end).
std::vector<std::unique_ptr<Layer>> make_model_units(const ModelConfig& config, int64_t begin,
                                                     int64_t end);
// Number of parameters of the whole model.
int64_t count_parameters(const ModelConfig& config);

}  // namespace conveyor
