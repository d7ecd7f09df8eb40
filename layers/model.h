#pragma once
// A model is a description: an ordered list of units (a factory from unit index to a Layer
// whose parameters carry global names such as "blocks.3.fc1.weight") and the shape of the
// activation that flows between units, so that a pipeline can cut any model into contiguous
// ranges of units and allocate the tensors it receives. Unit 0 takes i32 token ids [n]; the
// last unit is a loss head returning per-token losses [n] (see Layer and MicroBatchInputs).
//
// The reference model is one such description:
//   token embedding -> L × MlpBlock -> LossHead
// (unit 0 the embedding, units 1..L the blocks, unit L+1 the head), configured by ModelConfig.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/tensor.h"
#include "layers/layer.h"
#include "layers/ops.h"

namespace conveyor {

// The tensor passed from one unit to the next for a micro-batch; its gradient, flowing back,
// has the same shape and dtype.
struct ActivationSpec {
  Shape shape;
  DType dtype = DType::kF32;
};

struct ModelDescription {
  // Shown in logs, and part of what a checkpoint's model fingerprint holds with the unit
  // count, vocab and parameter counts per unit (resume_trainer refuses another): say in it
  // what parameter shapes do not show, such as an activation function or an epsilon, as the
  // reference model's name does ("tiny (d=64, L=2, V=64, hidden=256, gelu, ...)").
  std::string name;
  int64_t num_units = 0;  // at least 2: the first takes token ids, the last returns the loss
  // Token ids the first unit accepts are [0, vocab); 0 when the description does not say
  // (the trainer then needs a data source of the caller's).
  int64_t vocab = 0;
  // A new instance of unit `index` in [0, num_units), parameters not yet materialised. Each
  // stage builds its own units, and the parameter counts come from built units, so it must
  // build the same layer (same names, shapes and initialisation) on every call.
  std::function<std::unique_ptr<Layer>(int64_t index)> make_unit;
  // The activation entering unit `boundary` (leaving unit boundary - 1), boundary in
  // [1, num_units), for a micro-batch of `tokens` tokens. A pipeline allocates the
  // activations and gradients it receives from this.
  std::function<ActivationSpec(int64_t boundary, int64_t tokens)> activation;
  // Optional: what unit `index` computes, one name for the units that run the same work on
  // the same shapes ("block" for every block of the reference model), so that profile_units
  // times them as one (engine/pipeline/identical_units.h). Empty: each unit is timed on its own.
  std::function<std::string(int64_t index)> unit_kind;

  // Throws std::invalid_argument naming the first missing or impossible field. It builds
  // every unit twice (parameters not materialised): each must come back, its parameters must
  // have names, unique across the model, and positive dimensions, and the second build must
  // hold the same parameters (names, shapes, initialisation, decay) as the first.
  void validate() const;
  // Unit `index`, checked: the index is in range and the factory returned a layer.
  std::unique_ptr<Layer> unit(int64_t index) const;
  // Units [begin, end); throws std::out_of_range unless 0 <= begin < end <= num_units.
  std::vector<std::unique_ptr<Layer>> units(int64_t begin, int64_t end) const;
  // The activation at `boundary` for `tokens` tokens, checked against the range.
  ActivationSpec activation_at(int64_t boundary, int64_t tokens) const;
  // What crosses `boundary` in [0, num_units] for a micro-batch of `tokens` tokens: token ids,
  // i32 [tokens], entering unit 0; activation_at(boundary, tokens) between two units (their
  // gradient too); the per-token losses, f32 [tokens], leaving the last unit.
  ActivationSpec boundary_spec(int64_t boundary, int64_t tokens) const;
  // Throws std::invalid_argument when `tensor` is not boundary_spec(boundary, tokens), naming
  // it by `role` and `unit` ("the output of" unit 3): a unit that returns another shape than
  // the description says is found where it does, not by a kernel of the next unit or stage.
  // Nothing is formatted unless it throws (a stage asks at every unit of every micro-batch).
  void check_boundary(int64_t boundary, int64_t tokens, const Tensor& tensor, const char* role,
                      int64_t unit) const;
  // What unit `index` holds for a micro-batch of `tokens` tokens (Layer::activation_memory of
  // the unit on its input: token ids [tokens] for the first unit, else activation_at(index,
  // tokens)); empty when the unit's layer does not say.
  std::optional<ActivationMemory> unit_memory(int64_t index, int64_t tokens) const;
  // Parameters (elements) of each unit, and of the whole model; a count past int64_t is
  // refused (std::invalid_argument), never wrapped.
  std::vector<int64_t> unit_parameter_counts() const;
  int64_t count_parameters() const;
};

// The activation function of a model whose units all pass f32 rows [tokens, width].
std::function<ActivationSpec(int64_t boundary, int64_t tokens)> activation_rows(
    int64_t width, DType dtype = DType::kF32);

struct ModelConfig {
  std::string preset = "tiny";
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t vocab = 64;
  int64_t hidden = 256;  // MLP width, 4·d_model by default
  ops::ActivationKind activation = ops::ActivationKind::kGelu;
  float ln_eps = 1e-5f;

  // Bounds of the fields: the partitioner and a model's validation walk every block, and the
  // tables grow with the widths (the embedding is [vocab, d_model], beyond which the memory
  // estimate refuses anyway), so a typo is refused before anything is built.
  static constexpr int64_t kMaxWidth = 65536;              // d_model
  static constexpr int64_t kMaxLayers = 4096;              // n_layers
  static constexpr int64_t kMaxVocab = int64_t{1} << 24;   // vocab
  static constexpr int64_t kMaxHidden = int64_t{1} << 20;  // hidden

  int64_t num_units() const { return n_layers + 2; }
  // Throws std::invalid_argument naming the first bad field.
  void validate() const;
  std::string to_string() const;
};

// "tiny" (CPU default), "small" (d=1024, L=8, V=32768), "medium" (d=2048, L=16, V=32768).
// Throws std::invalid_argument listing the presets for an unknown name.
ModelConfig model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

// The reference model of `config` as a description (validates the config first).
ModelDescription reference_model(const ModelConfig& config);

// Unit `index` of the reference model (see above), with parameters not yet materialised.
std::unique_ptr<Layer> make_model_unit(const ModelConfig& config, int64_t index);
// Units [begin, end); throws std::out_of_range unless 0 <= begin < end <= config.num_units().
std::vector<std::unique_ptr<Layer>> make_model_units(const ModelConfig& config, int64_t begin,
                                                     int64_t end);
// Number of parameters of the whole reference model.
int64_t count_parameters(const ModelConfig& config);

}  // namespace conveyor
