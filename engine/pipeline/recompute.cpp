#include "engine/pipeline/recompute.h"

#include <stdexcept>

#include "engine/core/enum_value.h"

namespace conveyor {

std::vector<bool> RecomputeSpec::per_unit(int64_t num_units) const {
  std::vector<bool> out(static_cast<size_t>(num_units), kind == Kind::kStage);
  if (kind != Kind::kUnits) return out;
  for (const int64_t u : units) {
    if (u < 0 || u >= num_units)
      throw std::invalid_argument("recomputed unit " + std::to_string(u) +
                                  " is out of range: the model has units 0 to " +
                                  std::to_string(num_units - 1));
    if (out[static_cast<size_t>(u)])
      throw std::invalid_argument("recomputed unit " + std::to_string(u) +
                                  " is listed twice; list each unit once");
    out[static_cast<size_t>(u)] = true;
  }
  return out;
}

void RecomputeSpec::check_kind(const std::string& field) const {
  check_enum_value(kind, {Kind::kNone, Kind::kStage, Kind::kUnits}, field,
                   "RecomputeSpec::Kind::kNone, kStage or kUnits");
}

std::string to_string(const RecomputeSpec& spec) {
  switch (spec.kind) {
    case RecomputeSpec::Kind::kNone:
      return "none";
    case RecomputeSpec::Kind::kStage:
      return "stage";
    case RecomputeSpec::Kind::kUnits:
      break;
  }
  std::string out = "units:";
  for (size_t i = 0; i < spec.units.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(spec.units[i]);
  }
  return out;
}

}  // namespace conveyor
