#pragma once
// Activation recomputation: which units of the model keep only the input of their run instead
// of what their forward saves, and re-run that forward in the backward to rebuild it. A
// maximal contiguous run of recomputed units inside a stage keeps, per micro-batch in flight,
// the tensor entering the run (and the micro-batch's inputs, views of the step's ids); its
// backward re-runs the run's forward and then backs through it, so the bits are those of the
// run without recomputation, at the cost of one more forward of those units.
//   none    nothing is recomputed (the default);
//   stage   every unit of every stage (the first unit and the loss head included);
//   units   the listed global unit indices.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace conveyor {

struct RecomputeSpec {
  enum class Kind : uint8_t { kNone, kStage, kUnits };
  Kind kind = Kind::kNone;
  std::vector<int64_t> units;  // kUnits: global unit indices

  static RecomputeSpec none() { return {}; }
  static RecomputeSpec every_unit() { return {Kind::kStage, {}}; }
  static RecomputeSpec of_units(std::vector<int64_t> indices) {
    return {Kind::kUnits, std::move(indices)};
  }
  bool any() const { return kind != Kind::kNone; }

  // Per unit of a model of `num_units` units: whether it is recomputed. Throws
  // std::invalid_argument for a unit out of range or listed twice.
  std::vector<bool> per_unit(int64_t num_units) const;
  // Throws std::invalid_argument unless `kind` is one of the enum's values (one made by a
  // cast may not be), naming it as `field` ("TrainConfig::recompute.kind").
  void check_kind(const std::string& field) const;
};

// "none", "stage" or "units:2,3,5".
std::string to_string(const RecomputeSpec& spec);

}  // namespace conveyor
