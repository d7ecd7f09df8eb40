#pragma once
// Every cut of `units` units into `stages` contiguous, non-empty ranges, for the tests that
// check an exact partitioner against brute force.
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/pipeline/partition.h"

namespace conveyor::testing {

inline void for_each_contiguous_partition(
    int64_t units, int stages, const std::function<void(const std::vector<StageRange>&)>& visit) {
  std::vector<StageRange> ranges;
  std::function<void(int64_t)> cut_from = [&](int64_t begin) {
    const int64_t stage = static_cast<int64_t>(ranges.size());
    if (stage == stages - 1) {
      ranges.push_back({begin, units});
      visit(ranges);
      ranges.pop_back();
      return;
    }
    // Leave at least one unit for each stage after this one.
    for (int64_t end = begin + 1; end <= units - (stages - 1 - stage); ++end) {
      ranges.push_back({begin, end});
      cut_from(end);
      ranges.pop_back();
    }
  };
  cut_from(0);
}

}  // namespace conveyor::testing
