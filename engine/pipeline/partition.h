#pragma once
// Cutting the model into pipeline stages: contiguous ranges of model units (unit 0 the
// embedding, 1..L the blocks, L+1 the loss head), so the embedding always sits on the first
// stage and the head on the last. A partition is given as blocks per stage:
//   explicit  "3,5,5,3": stage s gets that many blocks (the first also the embedding, the
//             last also the head); counts must add up to L;
//   uniform   blocks spread as evenly as possible, the extra ones to the middle stages;
//   params    balanced by parameter count: the largest stage is as small as it can be.
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

// Blocks per stage from a spec: "uniform", "params", or a comma-separated list of counts.
// Throws std::invalid_argument with what would work.
std::vector<int64_t> partition_blocks(const ModelConfig& model, int num_stages,
                                      const std::string& spec);
// Unit ranges from blocks per stage.
std::vector<StageRange> stage_ranges(const ModelConfig& model,
                                     const std::vector<int64_t>& blocks_per_stage);
// Parameter count of each unit.
std::vector<int64_t> unit_parameter_counts(const ModelConfig& model);

}  // namespace conveyor
