#pragma once
// One pipelined layout's partition problem for the planner (planner.h): its costs with
// recomputation, memory model and partition searcher, searched in steps. Internal to the
// planner.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/planner.h"
#include "engine/pipeline/planner_memory.h"
#include "engine/schedule/simulator.h"

namespace conveyor::planning {

// One pipelined layout's partition problem, prepared to be searched in steps: its costs (with
// recomputation), memory model and searcher, started from the most balanced partition that
// fits. The planner first searches each layout only for what could beat the fastest layout
// found so far, then each on its own, so the searcher keeps what it found between searches.
class LayoutSearch {
 public:
  // PlanError for bad options, and for a cap that no partition fits.
  LayoutSearch(const std::vector<UnitCost>& units, const schedule::Schedule& schedule,
               const PartitionSearch& search);

  // Searches with a fresh budget (`share` of the layout's), skipping the partitions that
  // cannot beat `ceiling`, timing at most `actions` actions in its simulations; the actions it
  // timed.
  int64_t search(double ceiling = kInf, int64_t actions = std::numeric_limits<int64_t>::max(),
                 int64_t share = 1);
  bool found_any() const { return !searcher_.found().ranges.empty(); }
  // The fastest partition found is proven the fastest that fits (or, none found, none fits).
  bool proven() const { return searched_ && proved_ >= searcher_.found().step; }
  // No partition that fits is faster than this: the most any search proved.
  double lower_bound() const {
    return std::min(searcher_.found().step, std::max(root_bound_, proved_));
  }
  double step() const { return searcher_.found().step; }

  // PlanError when no partition that fits was found: none does, or the budget ran out.
  PartitionChoice choice() const;
  // The simulated run of `ranges` (what the plan reports of a layout besides its step time).
  schedule::SimResult simulate(const std::vector<StageRange>& ranges) const {
    return schedule::simulate(schedule_, cost_model(timed_, ranges, transfer_));
  }
  // Bytes per rank of `ranges`, and whether the fullest fits the cap.
  std::vector<double> memory(const std::vector<StageRange>& ranges) const {
    return memory_(ranges);
  }
  bool fits_memory(const std::vector<StageRange>& ranges) const { return fits_cap(ranges); }
  // The simulated step time of `ranges` with `units` in place of the costs searched (their
  // recomputation added alike): what the step time would be were the costs measured so.
  double step_with(const std::vector<UnitCost>& units,
                   const std::vector<StageRange>& ranges) const {
    return schedule::simulate(
               schedule_, cost_model(with_recompute_time(units, recomputed_), ranges, transfer_))
        .makespan;
  }

 private:
  int64_t units_count() const { return static_cast<int64_t>(timed_.size()); }

  // The smallest largest stage compute (F + I + W), within the cap per stage when each rank
  // holds one stage: close to the optimum, so the bounds prune early. With several stages a
  // rank, when the most balanced partition overflows, the leanest one. Empty when the
  // leanest was not found within the budget (the search then looks for one that fits);
  // PlanError when no partition fits.
  std::vector<StageRange> first_incumbent() const;
  bool fits_cap(const std::vector<StageRange>& ranges) const {
    const auto memory = memory_(ranges);
    return fits(*std::max_element(memory.begin(), memory.end()), cap_);
  }

  const schedule::Schedule schedule_;
  const std::vector<bool> recomputed_;
  const std::vector<UnitCost> timed_;
  const Sums sums_;
  const MemoryModel memory_;
  PartitionSearcher searcher_;
  const double cap_;
  const PartitionSearch search_;  // the options it was made with: the cap's sharing
  const double transfer_;
  const SearchBudget budget_;
  std::vector<StageRange> balanced_;
  double root_bound_ = 0;
  double proved_ = 0;  // the highest lower bound a search proved
  bool searched_ = false;
};

}  // namespace conveyor::planning
