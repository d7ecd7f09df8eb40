#include "engine/pipeline/partition.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

#include "engine/core/enum_value.h"
#include "engine/core/number_text.h"

namespace conveyor {
namespace {

std::string join(const std::vector<int64_t>& values) {
  std::ostringstream out;
  for (size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  return out.str();
}

int64_t num_blocks(const ModelDescription& model) { return model.num_units - 2; }

// Stages s in [1, S-2] hold only blocks, so they need one each.
void check_counts(const ModelDescription& model, int num_stages,
                  const std::vector<int64_t>& counts) {
  const int64_t blocks = num_blocks(model);
  if (static_cast<int>(counts.size()) != num_stages)
    throw std::invalid_argument("partition " + join(counts) + " has " +
                                counted(counts.size(), "stage") + ", the pipeline has " +
                                std::to_string(num_stages));
  for (int64_t c : counts)
    if (c < 0)
      throw std::invalid_argument("partition " + join(counts) +
                                  " has a negative block count; expected counts >= 0");
  // Each count at most the model's blocks first, so that the sum below cannot overflow.
  for (size_t s = 0; s < counts.size(); ++s)
    if (counts[s] > blocks)
      throw std::invalid_argument("partition " + join(counts) + " gives stage " +
                                  std::to_string(s) + " " + counted(counts[s], "block") +
                                  ", the model has " + std::to_string(blocks));
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total != blocks)
    throw std::invalid_argument("partition " + join(counts) + " places " + counted(total, "block") +
                                ", the model has " + std::to_string(blocks));
  for (int s = 1; s + 1 < num_stages; ++s)
    if (counts[s] == 0)
      throw std::invalid_argument("partition " + join(counts) + " leaves stage " +
                                  std::to_string(s) +
                                  " empty; every middle stage needs at least one block");
}

std::vector<int64_t> uniform_blocks(int64_t blocks, int num_stages) {
  if (num_stages == 1) return {blocks};
  // Middle stages first get one block each (they must not be empty), then the rest is dealt
  // round-robin starting from the middle, since the ends carry the first and last units.
  std::vector<int64_t> counts(num_stages, 0);
  const int middle = std::max(0, num_stages - 2);
  int64_t left = blocks;
  for (int s = 1; s <= middle; ++s) counts[s] = 1, --left;
  std::vector<int> order;
  for (int s = 1; s <= middle; ++s) order.push_back(s);
  order.push_back(0);
  order.push_back(num_stages - 1);
  for (size_t k = 0; left > 0; k = (k + 1) % order.size()) ++counts[order[k]], --left;
  return counts;
}

// Minimise the largest stage (in parameters) over contiguous cuts of the units, each stage
// non-empty: dynamic programming over (stages, units), O(S·U²) on small sizes.
std::vector<int64_t> parameter_balanced_blocks(const ModelDescription& model, int num_stages) {
  const std::vector<int64_t> w = model.unit_parameter_counts();
  const int units = static_cast<int>(w.size());
  std::vector<int64_t> prefix(units + 1, 0);
  for (int u = 0; u < units; ++u) prefix[u + 1] = prefix[u] + w[u];
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  // best[s][u]: minimal max-stage cost putting units [0, u) into s stages; cut[s][u] the start.
  std::vector<std::vector<int64_t>> best(num_stages + 1, std::vector<int64_t>(units + 1, kInf));
  std::vector<std::vector<int>> cut(num_stages + 1, std::vector<int>(units + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= num_stages; ++s)
    for (int u = s; u <= units; ++u)
      for (int start = s - 1; start < u; ++start) {
        if (best[s - 1][start] == kInf) continue;
        const int64_t cost = std::max(best[s - 1][start], prefix[u] - prefix[start]);
        if (cost < best[s][u]) best[s][u] = cost, cut[s][u] = start;
      }
  std::vector<StageRange> ranges(num_stages);
  for (int s = num_stages, u = units; s >= 1; --s) {
    ranges[s - 1] = {cut[s][u], u};
    u = cut[s][u];
  }
  std::vector<int64_t> counts(num_stages, 0);
  for (int s = 0; s < num_stages; ++s) {
    const int64_t begin = std::max<int64_t>(ranges[s].begin, 1);
    const int64_t end = std::min<int64_t>(ranges[s].end, model.num_units - 1);
    counts[s] = std::max<int64_t>(0, end - begin);
  }
  return counts;
}

}  // namespace

void PartitionSpec::check_kind(const std::string& field) const {
  check_enum_value(kind, {Kind::kUniform, Kind::kParameters, Kind::kBlocks}, field,
                   "PartitionSpec::Kind::kUniform, kParameters or kBlocks");
}

std::vector<int64_t> partition_blocks(const ModelDescription& model, int num_stages,
                                      const PartitionSpec& spec) {
  model.validate();
  if (num_stages < 1) throw std::invalid_argument("a pipeline needs at least one stage");
  const int64_t blocks = num_blocks(model);
  const int64_t max_stages = model.num_units;
  if (num_stages > max_stages)
    throw std::invalid_argument("cannot cut a model of " + counted(blocks, "block") + " into " +
                                std::to_string(num_stages) + " stages: at most " +
                                std::to_string(max_stages) +
                                " (first unit + blocks + last unit, one unit each)");
  // A kind made by a cast would match no case below and read as a partition of no stages.
  spec.check_kind("PartitionSpec::kind");
  std::vector<int64_t> counts;
  switch (spec.kind) {
    case PartitionSpec::Kind::kUniform:
      counts = uniform_blocks(blocks, num_stages);
      break;
    case PartitionSpec::Kind::kParameters:
      counts = parameter_balanced_blocks(model, num_stages);
      break;
    case PartitionSpec::Kind::kBlocks:
      counts = spec.blocks;
      break;
  }
  check_counts(model, num_stages, counts);
  return counts;
}

std::vector<StageRange> stage_ranges(const ModelDescription& model,
                                     const std::vector<int64_t>& blocks_per_stage) {
  check_counts(model, static_cast<int>(blocks_per_stage.size()), blocks_per_stage);
  const int num_stages = static_cast<int>(blocks_per_stage.size());
  std::vector<StageRange> ranges;
  int64_t unit = 0;
  for (int s = 0; s < num_stages; ++s) {
    StageRange r;
    r.begin = unit;
    unit += blocks_per_stage[s] + (s == 0 ? 1 : 0);  // the first unit
    if (s == num_stages - 1) unit += 1;              // the last unit
    r.end = unit;
    ranges.push_back(r);
  }
  return ranges;
}

void check_stage_ranges(const std::vector<StageRange>& ranges, int64_t num_units) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("stage ranges must cover units [0, " + std::to_string(num_units) +
                                ") in order; " + why);
  };
  if (ranges.empty()) fail("none were given");
  int64_t next = 0;
  for (size_t s = 0; s < ranges.size(); ++s) {
    const StageRange& r = ranges[s];
    const std::string stage = "stage " + std::to_string(s);
    if (r.begin != next)
      fail(stage + " begins at unit " + std::to_string(r.begin) +
           (s == 0
                ? std::string(", not at unit 0")
                : ", where stage " + std::to_string(s - 1) + " ended at " + std::to_string(next)));
    if (r.end <= r.begin)
      fail(stage + " is [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
           "), which holds no unit");
    next = r.end;
  }
  if (next != num_units)
    fail("the last stage, " + std::to_string(ranges.size() - 1) + ", ends at unit " +
         std::to_string(next));
}

}  // namespace conveyor
