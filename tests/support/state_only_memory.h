#pragma once
// A partition memory model that counts each rank's parameter and optimizer state alone (no
// activations), for the partition search tests that need a cap that binds in a simple way.
#include <cstdint>
#include <vector>

#include "engine/pipeline/partition_search.h"
#include "engine/schedule/schedule.h"

namespace conveyor::testing {

struct StateOnlyMemory : planning::PartitionMemory {
  const planning::Sums& sums;
  const schedule::Schedule& sched;
  StateOnlyMemory(const planning::Sums& sums, const schedule::Schedule& sched)
      : sums(sums), sched(sched) {}
  std::vector<double> operator()(const std::vector<StageRange>& ranges) const override {
    std::vector<double> bytes(sched.num_ranks(), 0.0);
    for (int s = 0; s < static_cast<int>(ranges.size()); ++s)
      bytes[sched.placement.rank_of(s)] += sums.state.over(ranges[s]);
    return bytes;
  }
  double stage(int, int64_t b, int64_t e) const override { return sums.state.over(b, e); }
  double known_stages(int r, const std::vector<StageRange>& ranges, int known) const override {
    double bytes = 0;
    for (int s = 0; s < known; ++s)
      if (sched.placement.rank_of(s) == r) bytes += sums.state.over(ranges[s]);
    return bytes;
  }
};

}  // namespace conveyor::testing
