#include "engine/pipeline/identical_units.h"

#include <optional>
#include <string>
#include <typeindex>
#include <utility>

namespace conveyor {
namespace {

// What decides a unit's costs, names aside.
struct UnitShape {
  std::string kind;
  std::type_index type = typeid(void);
  std::vector<Shape> parameters;
  std::optional<ActivationMemory> memory;
  std::optional<int64_t> ids;
  ActivationSpec in, out;

  bool operator==(const UnitShape& o) const {
    auto same_memory = [](const std::optional<ActivationMemory>& a,
                          const std::optional<ActivationMemory>& b) {
      if (a.has_value() != b.has_value()) return false;
      return !a || (a->saved == b->saved && a->weight_pending == b->weight_pending &&
                    a->workspace == b->workspace);
    };
    return kind == o.kind && type == o.type && parameters == o.parameters &&
           same_memory(memory, o.memory) && ids == o.ids && in.shape == o.in.shape &&
           in.dtype == o.in.dtype && out.shape == o.out.shape && out.dtype == o.out.dtype;
  }
};

UnitShape shape_of(const ModelDescription& model, int64_t u, int64_t tokens) {
  const std::unique_ptr<Layer> layer = model.unit(u);
  const Layer& built = *layer;
  UnitShape s;
  s.kind = model.unit_kind(u);
  s.type = typeid(built);
  for (Parameter* p : layer->parameters()) s.parameters.push_back(p->shape);
  s.in = model.boundary_spec(u, tokens);
  s.out = model.boundary_spec(u + 1, tokens);
  s.memory = layer->activation_memory(s.in.shape);
  s.ids = layer->accepted_ids();
  return s;
}

}  // namespace

std::vector<int64_t> identical_unit_leaders(const ModelDescription& model, int64_t tokens) {
  std::vector<std::pair<int64_t, UnitShape>> leaders;
  std::vector<int64_t> out;
  if (!model.unit_kind) {
    for (int64_t u = 0; u < model.num_units; ++u) out.push_back(u);
    return out;
  }
  for (int64_t u = 0; u < model.num_units; ++u) {
    UnitShape s = shape_of(model, u, tokens);
    int64_t leader = u;
    for (const auto& [index, shape] : leaders)
      if (shape == s) {
        leader = index;
        break;
      }
    if (leader == u) leaders.emplace_back(u, std::move(s));
    out.push_back(leader);
  }
  return out;
}

}  // namespace conveyor
