#pragma once
// Cutting a model into pipeline stages: contiguous ranges of its units, so the first unit
// (it takes the token ids) always sits on the first stage and the last (the loss) on the
// last stage. The units between them are the blocks (the reference model's MLP blocks). A
// partition gives the blocks per stage:
//   uniform     blocks spread as evenly as possible, the extra ones to the middle stages;
//   parameters  balanced by parameter count: the largest stage is as small as it can be;
//   blocks      explicit counts such as {3, 5, 5, 3}: stage s gets that many blocks (the
//               first also the first unit, the last also the last unit); they must add up
//               to the model's blocks.
// Every stage must hold at least one unit.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "layers/model.h"

namespace conveyor {

struct StageRange {
  int64_t begin = 0;  // first unit
  int64_t end = 0;    // one past the last unit
  bool operator==(const StageRange&) const = default;
};

struct PartitionSpec {
  enum class Kind : uint8_t { kUniform, kParameters, kBlocks };
  Kind kind = Kind::kUniform;
  std::vector<int64_t> blocks;  // kBlocks: blocks per stage

  static PartitionSpec uniform() { return {}; }
  static PartitionSpec by_parameters() { return {Kind::kParameters, {}}; }
  static PartitionSpec explicit_blocks(std::vector<int64_t> per_stage) {
    return {Kind::kBlocks, std::move(per_stage)};
  }
  // Throws std::invalid_argument unless `kind` is one of the enum's values (one made by a
  // cast may not be), naming it as `field` ("TrainConfig::partition.kind").
  void check_kind(const std::string& field) const;
};

// Blocks per stage for `num_stages` stages. Throws std::invalid_argument with what would work.
std::vector<int64_t> partition_blocks(const ModelDescription& model, int num_stages,
                                      const PartitionSpec& spec);
// Unit ranges from blocks per stage.
std::vector<StageRange> stage_ranges(const ModelDescription& model,
                                     const std::vector<int64_t>& blocks_per_stage);
// Throws std::invalid_argument unless `ranges` are non-empty and cut units [0, num_units)
// in order, each stage beginning where the one before ended: a gap would train without some
// units, an overlap would build a unit (and its parameters) twice.
void check_stage_ranges(const std::vector<StageRange>& ranges, int64_t num_units);

}  // namespace conveyor
