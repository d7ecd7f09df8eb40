#include "layers/model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "engine/core/number_text.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"

namespace conveyor {
namespace {

std::string label_of(const ModelDescription& model) {
  return model.name.empty() ? "the model description" : "model '" + model.name + "'";
}

// At least one dimension, each at least 1: what an activation or a parameter needs.
bool has_positive_dimensions(const Shape& shape) {
  return !shape.empty() && std::all_of(shape.begin(), shape.end(), [](int64_t d) { return d > 0; });
}

// Empty when `init` gives finite values; else what it must be instead. Non-finite values
// would make NaN weights without a word, and an empty range (uniform(0), say, from a bound
// computed in integers) is refused by the kernel without the parameter's name.
std::string init_problem(const InitSpec& init) {
  if (!known_init_kind(init.kind))
    return "expected InitSpec::kind to be InitSpec::Kind::kUniform or kConstant, got the value " +
           std::to_string(static_cast<int>(init.kind));
  if (init.kind == InitSpec::Kind::kConstant)
    return std::isfinite(init.low) ? "" : "expected a finite value";
  if (!std::isfinite(init.low) || !std::isfinite(init.high) ||
      !std::isfinite(init.high - init.low) || !(init.low < init.high))
    return "expected finite bounds low < high (InitSpec::uniform(bound) with a finite bound "
           "above 0)";
  return "";
}

// Units [begin, end) of `count`: an empty or reversed range is a caller's slip (a stage holds
// at least one unit), refused rather than answered with no units. `what` names the call.
void check_unit_range(int64_t begin, int64_t end, int64_t count, const char* what) {
  if (begin >= 0 && begin < end && end <= count) return;
  throw std::out_of_range(std::string(what) + "(begin " + std::to_string(begin) + ", end " +
                          std::to_string(end) + ") is not a non-empty range of the model's " +
                          std::to_string(count) +
                          " units; expected 0 <= begin < end <= " + std::to_string(count));
}

}  // namespace

namespace {

// A parameter as the model sees it: what names, sizes, initialises and decays it.
std::string parameter_text(const Parameter& p) {
  std::ostringstream out;
  out << "'" << p.name << "' " << shape_to_string(p.shape) << " initialised "
      << (p.init.kind == InitSpec::Kind::kUniform    ? "uniform ["
          : p.init.kind == InitSpec::Kind::kConstant ? "constant ["
                                                     : "by an unknown kind [")
      << p.init.low << ", " << p.init.high << ")" << (p.weight_decay ? " decayed" : " not decayed");
  return out.str();
}

// Each stage builds its own units and the parameter counts come from built units: a factory
// that builds another layer on a second call (one that counts its calls, or draws at random)
// would give stages, counts and checkpoints that disagree. `first` and `second` are two
// builds of one unit; they must hold the same parameters and accept the same ids.
void check_built_alike(Layer& first, Layer& second, const std::string& where) {
  const std::vector<Parameter*> a = first.parameters(), b = second.parameters();
  const auto refuse = [&](const std::string& difference) {
    throw std::invalid_argument(where +
                                " is built differently by a second call of the unit "
                                "factory (" +
                                difference +
                                "); make_unit must build the same layer, with the same "
                                "parameters, on every call: each stage builds its own units");
  };
  if (a.size() != b.size())
    refuse(std::to_string(a.size()) + " parameters the first time, " + std::to_string(b.size()) +
           " the second");
  for (size_t i = 0; i < a.size(); ++i) {
    if (b[i] == nullptr) refuse("parameter " + std::to_string(i) + " is null the second time");
    const std::string was = parameter_text(*a[i]), is = parameter_text(*b[i]);
    if (was != is)
      refuse("parameter " + std::to_string(i) + " is " + was + " the first time, " + is +
             " the second");
  }
  if (first.accepted_ids() != second.accepted_ids())
    refuse("the ids it accepts differ between the two");
}

}  // namespace

void ModelDescription::validate() const {
  const std::string label = label_of(*this);
  if (num_units < 2)
    throw std::invalid_argument(label + " has " + counted(num_units, "unit") +
                                "; at least 2 are needed (the first takes token ids, the "
                                "last returns the loss)");
  // Validation builds every unit twice and the partitioner walks them all: 2^20 units take a
  // fraction of a second here, a count such as 2^40 (a typo) would take days before a word.
  constexpr int64_t kMaxUnits = int64_t{1} << 20;
  if (num_units > kMaxUnits)
    throw std::invalid_argument(label + " has " + std::to_string(num_units) + " units; at most " +
                                std::to_string(kMaxUnits) +
                                " are taken (ModelDescription::num_units)");
  if (vocab < 0)
    throw std::invalid_argument(label + " has vocab " + std::to_string(vocab) +
                                "; expected the number of token ids, or 0 when unknown");
  if (!make_unit) throw std::invalid_argument(label + " has no unit factory (make_unit is empty)");
  if (!activation)
    throw std::invalid_argument(label +
                                " has no activation shape (activation is empty); for rows of "
                                "width d use activation_rows(d)");
  for (int64_t boundary = 1; boundary < num_units; ++boundary) {
    const ActivationSpec spec = activation(boundary, 1);
    if (!has_positive_dimensions(spec.shape))
      throw std::invalid_argument(label + " gives the activation entering unit " +
                                  std::to_string(boundary) + " the shape " +
                                  shape_to_string(spec.shape) +
                                  " for one token; expected positive dimensions");
  }
  // Every unit built (twice, to compare), so that a factory that fails or builds another layer
  // each time, or a parameter that could never be allocated, initialised or saved under its
  // name, is reported here rather than by the stage or checkpoint that first meets it.
  std::map<std::string, int64_t> unit_of_name;
  for (int64_t index = 0; index < num_units; ++index) {
    const std::unique_ptr<Layer> layer = unit(index);
    const std::string where = label + " unit " + std::to_string(index);
    const std::optional<int64_t> ids = layer->accepted_ids();
    if (ids && (index == 0 || index == num_units - 1) && vocab > *ids)
      throw std::invalid_argument(where + " accepts " + (index == 0 ? "token" : "target") +
                                  " ids below " + std::to_string(*ids) +
                                  " but the model's vocab is " + std::to_string(vocab) +
                                  "; ids of the data could index past its table");
    for (const Parameter* p : layer->parameters()) {
      if (p == nullptr) throw std::invalid_argument(where + " lists a null parameter");
      if (p->name.empty())
        throw std::invalid_argument(where +
                                    " has a parameter without a name; expected a global "
                                    "name such as \"blocks.3.fc1.weight\"");
      if (!has_positive_dimensions(p->shape))
        throw std::invalid_argument(where + " gives parameter '" + p->name + "' the shape " +
                                    shape_to_string(p->shape) +
                                    "; expected positive dimensions (a single value is [1])");
      try {
        shape_numel(p->shape);
      } catch (const std::invalid_argument&) {
        throw std::invalid_argument(where + " gives parameter '" + p->name + "' the shape " +
                                    shape_to_string(p->shape) +
                                    ", more elements than a tensor can hold");
      }
      if (const std::string problem = init_problem(p->init); !problem.empty())
        throw std::invalid_argument(where + " gives parameter " + parameter_text(*p) + "; " +
                                    problem);
      const auto [it, added] = unit_of_name.emplace(p->name, index);
      if (!added)
        throw std::invalid_argument(
            where + " has a parameter named '" + p->name + "', as " +
            (it->second == index ? "it already has"
                                 : "unit " + std::to_string(it->second) + " has") +
            "; names must be unique across the model (they key initial values and "
            "checkpoints)");
    }
    check_built_alike(*layer, *unit(index), where);
  }
}

std::unique_ptr<Layer> ModelDescription::unit(int64_t index) const {
  if (index < 0 || index >= num_units)
    throw std::out_of_range("model unit " + std::to_string(index) + " out of range [0, " +
                            std::to_string(num_units) + ")");
  if (!make_unit) throw std::invalid_argument(label_of(*this) + " has no unit factory");
  std::unique_ptr<Layer> layer = make_unit(index);
  if (!layer)
    throw std::invalid_argument("the unit factory of " + label_of(*this) +
                                " returned no layer for unit " + std::to_string(index));
  return layer;
}

std::vector<std::unique_ptr<Layer>> ModelDescription::units(int64_t begin, int64_t end) const {
  check_unit_range(begin, end, num_units, "ModelDescription::units");
  std::vector<std::unique_ptr<Layer>> out;
  for (int64_t i = begin; i < end; ++i) out.push_back(unit(i));
  return out;
}

ActivationSpec ModelDescription::activation_at(int64_t boundary, int64_t tokens) const {
  if (boundary < 1 || boundary >= num_units)
    throw std::out_of_range("activation boundary " + std::to_string(boundary) +
                            " out of range [1, " + std::to_string(num_units) + ")");
  if (!activation) throw std::invalid_argument(label_of(*this) + " has no activation shape");
  return activation(boundary, tokens);
}

ActivationSpec ModelDescription::boundary_spec(int64_t boundary, int64_t tokens) const {
  if (boundary == 0) return {{tokens}, DType::kI32};
  if (boundary == num_units) return {{tokens}, DType::kF32};
  return activation_at(boundary, tokens);
}

void ModelDescription::check_boundary(int64_t boundary, int64_t tokens, const Tensor& tensor,
                                      const char* role, int64_t unit) const {
  const ActivationSpec expected = boundary_spec(boundary, tokens);
  if (tensor.defined() && tensor.shape() == expected.shape && tensor.dtype() == expected.dtype)
    return;
  const std::string found = tensor.defined() ? std::string(dtype_name(tensor.dtype())) + " " +
                                                   shape_to_string(tensor.shape())
                                             : std::string("undefined");
  const std::string says = boundary == 0 ? "token ids"
                           : boundary == num_units
                               ? "the per-token losses of the last unit"
                               : "the activation entering unit " + std::to_string(boundary);
  throw std::invalid_argument(label_of(*this) + ": " + role + " unit " + std::to_string(unit) +
                              " is " + found + " for a micro-batch of " + std::to_string(tokens) +
                              " tokens; expected " + dtype_name(expected.dtype) + " " +
                              shape_to_string(expected.shape) + " (" + says + ")");
}

std::optional<ActivationMemory> ModelDescription::unit_memory(int64_t index, int64_t tokens) const {
  const std::unique_ptr<Layer> layer = unit(index);
  const std::optional<ActivationMemory> memory =
      layer->activation_memory(boundary_spec(index, tokens).shape);
  // A NaN would reach the memory check as "needs about nan B", a negative figure would let
  // through a run that cannot fit.
  if (memory)
    for (const auto& [field, bytes] :
         {std::pair{"saved", memory->saved}, std::pair{"weight_pending", memory->weight_pending},
          std::pair{"workspace", memory->workspace}})
      if (!(bytes >= 0.0) || !std::isfinite(bytes))
        throw std::invalid_argument(
            label_of(*this) + " unit " + std::to_string(index) + " ('" + layer->name() +
            "') says activation_memory()." + field + " is " + number_text(bytes) + " bytes for " +
            std::to_string(tokens) + " tokens; expected a finite number of at least 0");
  return memory;
}

namespace {

[[noreturn]] void refuse_parameter_count(const std::string& what) {
  throw std::invalid_argument(what + " has more than " +
                              std::to_string(std::numeric_limits<int64_t>::max()) +
                              " parameters, more than a count can hold");
}

// a + b and a * b, or a refusal naming `what` where the result leaves int64_t.
int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) refuse_parameter_count(what);
  return sum;
}

int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) refuse_parameter_count(what);
  return product;
}

}  // namespace

std::vector<int64_t> ModelDescription::unit_parameter_counts() const {
  std::vector<int64_t> counts;
  for (int64_t i = 0; i < num_units; ++i) {
    const std::unique_ptr<Layer> layer = unit(i);  // outlives the pointers to its parameters
    int64_t n = 0;
    for (Parameter* p : layer->parameters())
      n = checked_add(n, shape_numel(p->shape),
                      "unit " + std::to_string(i) + " of model '" + name + "'");
    counts.push_back(n);
  }
  return counts;
}

int64_t ModelDescription::count_parameters() const {
  int64_t total = 0;
  for (int64_t n : unit_parameter_counts()) total = checked_add(total, n, "model '" + name + "'");
  return total;
}

std::function<ActivationSpec(int64_t, int64_t)> activation_rows(int64_t width, DType dtype) {
  if (width < 1)
    throw std::invalid_argument("activation width must be at least 1, got " +
                                std::to_string(width));
  return [width, dtype](int64_t, int64_t tokens) { return ActivationSpec{{tokens, width}, dtype}; };
}

void ModelConfig::validate() const {
  auto in_range = [](int64_t value, const char* field, int64_t max) {
    if (value < 1 || value > max)
      throw std::invalid_argument(std::string("ModelConfig::") + field + " must be from 1 to " +
                                  std::to_string(max) + ", got " + std::to_string(value));
  };
  in_range(d_model, "d_model", kMaxWidth);
  in_range(n_layers, "n_layers", kMaxLayers);
  in_range(vocab, "vocab", kMaxVocab);
  in_range(hidden, "hidden", kMaxHidden);
  // An infinite epsilon normalises every row to 0: the model would learn nothing.
  if (!(ln_eps > 0.0f) || !std::isfinite(ln_eps))
    throw std::invalid_argument("ModelConfig::ln_eps must be a finite number above 0, got " +
                                number_text(ln_eps));
  // A value cast from outside the enum would run as ReLU (the kernels test for GELU only)
  // while the model's name says otherwise.
  if (activation != ops::ActivationKind::kGelu && activation != ops::ActivationKind::kRelu)
    throw std::invalid_argument(
        "ModelConfig::activation must be ops::ActivationKind::kGelu or kRelu, got the value " +
        std::to_string(static_cast<int>(activation)));
}

std::string ModelConfig::to_string() const {
  std::ostringstream out;
  out << preset << " (d=" << d_model << ", L=" << n_layers << ", V=" << vocab
      << ", hidden=" << hidden << ", " << ops::activation_name(activation) << ", "
      << count_parameters(*this) << " parameters)";
  return out.str();
}

std::vector<std::string> model_preset_names() { return {"tiny", "small", "medium"}; }

ModelConfig model_preset(std::string_view name) {
  ModelConfig c;
  c.preset = std::string(name);
  if (name == "tiny") {
    c.d_model = 64, c.n_layers = 2, c.vocab = 64;
  } else if (name == "small") {
    c.d_model = 1024, c.n_layers = 8, c.vocab = 32768;
  } else if (name == "medium") {
    c.d_model = 2048, c.n_layers = 16, c.vocab = 32768;
  } else {
    throw std::invalid_argument("unknown model preset '" + std::string(name) +
                                "', expected tiny, small or medium");
  }
  c.hidden = 4 * c.d_model;
  return c;
}

ModelDescription reference_model(const ModelConfig& config) {
  config.validate();
  ModelDescription model;
  model.name = config.to_string();
  model.num_units = config.num_units();
  model.vocab = config.vocab;
  model.make_unit = [config](int64_t index) { return make_model_unit(config, index); };
  model.activation = activation_rows(config.d_model);
  model.unit_kind = [last = config.num_units() - 1](int64_t index) -> std::string {
    return index == 0 ? "embedding" : index == last ? "head" : "block";
  };
  return model;
}

std::unique_ptr<Layer> make_model_unit(const ModelConfig& config, int64_t index) {
  if (index < 0 || index >= config.num_units())
    throw std::out_of_range("model unit " + std::to_string(index) + " out of range [0, " +
                            std::to_string(config.num_units()) + ")");
  if (index == 0) return std::make_unique<Embedding>("embed", config.vocab, config.d_model);
  if (index == config.num_units() - 1)
    return std::make_unique<LossHead>("head", config.d_model, config.vocab, config.ln_eps);
  return std::make_unique<MlpBlock>("blocks." + std::to_string(index - 1), config.d_model,
                                    config.hidden, config.activation, config.ln_eps);
}

std::vector<std::unique_ptr<Layer>> make_model_units(const ModelConfig& config, int64_t begin,
                                                     int64_t end) {
  check_unit_range(begin, end, config.num_units(), "make_model_units");
  std::vector<std::unique_ptr<Layer>> units;
  for (int64_t i = begin; i < end; ++i) units.push_back(make_model_unit(config, i));
  return units;
}

int64_t count_parameters(const ModelConfig& c) {
  const std::string what = "model " + c.preset + " (d=" + std::to_string(c.d_model) +
                           ", L=" + std::to_string(c.n_layers) + ", V=" + std::to_string(c.vocab) +
                           ", hidden=" + std::to_string(c.hidden) + ")";
  const auto add = [&](int64_t a, int64_t b) { return checked_add(a, b, what); };
  const auto mul = [&](int64_t a, int64_t b) { return checked_mul(a, b, what); };
  const int64_t d = c.d_model, h = c.hidden, v = c.vocab;
  const int64_t embed = mul(v, d);
  const int64_t block = add(add(mul(2, d), add(mul(d, h), h)), add(mul(h, d), d));
  const int64_t head = add(mul(2, d), add(mul(d, v), v));
  return add(add(embed, mul(c.n_layers, block)), head);
}

}  // namespace conveyor
