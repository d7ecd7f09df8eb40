#include "layers/model.h"

#include <sstream>
#include <stdexcept>

#include "layers/basic_layers.h"
#include "layers/blocks.h"

namespace conveyor {

void ModelConfig::validate() const {
  auto positive = [](int64_t value, const char* field) {
    if (value < 1)
      throw std::invalid_argument(std::string("model ") + field + " must be at least 1, got " +
                                  std::to_string(value));
  };
  positive(d_model, "d_model");
  positive(n_layers, "n_layers");
  positive(vocab, "vocab");
  positive(hidden, "hidden");
  if (vocab > (int64_t{1} << 31) - 1)
    throw std::invalid_argument("model vocab must fit in int32, got " + std::to_string(vocab));
  if (!(ln_eps > 0.0f)) throw std::invalid_argument("model ln_eps must be positive");
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
  std::vector<std::unique_ptr<Layer>> units;
  for (int64_t i = begin; i < end; ++i) units.push_back(make_model_unit(config, i));
  return units;
}

int64_t count_parameters(const ModelConfig& c) {
  const int64_t d = c.d_model, h = c.hidden, v = c.vocab;
  const int64_t embed = v * d;
  const int64_t block = 2 * d + (d * h + h) + (h * d + d);
  const int64_t head = 2 * d + (d * v + v);
  return embed + c.n_layers * block + head;
}

}  // namespace conveyor
