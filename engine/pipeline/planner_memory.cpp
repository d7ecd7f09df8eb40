#include "engine/pipeline/planner_memory.h"

#include <algorithm>
#include <utility>

namespace conveyor {
namespace planning {
namespace {

// Adds `point` to `points` unless one there holds at least as much everywhere; drops those it
// holds at least as much as.
template <typename Count>
void add_peak(std::vector<std::vector<Count>>& points, const std::vector<Count>& point) {
  auto at_most = [](const std::vector<Count>& a, const std::vector<Count>& b) {
    for (size_t j = 0; j < a.size(); ++j)
      if (!(a[j] <= b[j])) return false;
    return true;
  };
  for (const auto& p : points)
    if (at_most(point, p)) return;
  std::erase_if(points, [&](const auto& p) { return at_most(p, point); });
  points.push_back(point);
}

}  // namespace

RankPeaks rank_peaks(const std::vector<schedule::Action>& list, std::vector<int> stages,
                     int last_stage) {
  using schedule::ActionKind;
  RankPeaks out;
  out.stages = std::move(stages);
  std::vector<RankPeaks::Held> held(out.stages.size());
  std::vector<RankPeaks::Transit> transit(out.stages.size());
  add_peak(out.transit, transit);
  for (const auto& a : list) {
    const auto j = static_cast<size_t>(std::find(out.stages.begin(), out.stages.end(), a.stage) -
                                       out.stages.begin());
    if (j == out.stages.size()) continue;  // not the rank's: nothing of it is held here
    RankPeaks::Held& h = held[j];
    RankPeaks::Transit& t = transit[j];
    const bool has_input = a.stage > 0, has_output = a.stage < last_stage;
    switch (a.kind) {
      case ActionKind::kForward: {
        ++h.kept;
        auto peak = held;  // what the forward holds for a moment on top
        ++peak[j].forward;
        add_peak(out.held, peak);
        t.inputs -= has_input, t.outputs += has_output;
        break;
      }
      case ActionKind::kBackward: {
        auto peak = held;
        ++peak[j].rebuilt, ++peak[j].pending;
        add_peak(out.held, peak);
        --h.kept;
        t.outputs -= has_output, t.inputs += has_input;
        break;
      }
      case ActionKind::kBackwardInput:
        ++h.rebuilt, ++h.pending;
        add_peak(out.held, held);
        t.outputs -= has_output, t.inputs += has_input;
        break;
      case ActionKind::kBackwardWeight:  // releases what the stage held for it
        --h.kept, --h.rebuilt, --h.pending;
        break;
      case ActionKind::kSendAct:
        --t.outputs;
        break;
      case ActionKind::kRecvGrad:
        ++t.outputs;
        break;
      case ActionKind::kSendGrad:
        --t.inputs;
        break;
      case ActionKind::kRecvAct:
        ++t.inputs;
        break;
      case ActionKind::kAllReduceGrad:  // sums gradients: holds no activation
        break;
    }
    add_peak(out.transit, transit);
  }
  return out;
}

}  // namespace planning

std::vector<double> rank_memory(const std::vector<UnitCost>& units,
                                const std::vector<StageRange>& ranges,
                                const schedule::Schedule& schedule,
                                const std::vector<bool>& recomputed) {
  const planning::Sums sums(units);
  return planning::MemoryModel(sums, units, recomputed, schedule)(ranges);
}

std::vector<UnitCost> with_recompute_time(const std::vector<UnitCost>& units,
                                          const std::vector<bool>& recomputed) {
  std::vector<UnitCost> out = units;
  for (size_t u = 0; u < out.size() && u < recomputed.size(); ++u)
    if (recomputed[u]) out[u].backward_input += out[u].forward;
  return out;
}

std::vector<int64_t> blocks_of(const std::vector<StageRange>& ranges) {
  std::vector<int64_t> blocks;
  for (size_t s = 0; s < ranges.size(); ++s)
    blocks.push_back(ranges[s].end - ranges[s].begin - (s == 0 ? 1 : 0) -
                     (s + 1 == ranges.size() ? 1 : 0));
  return blocks;
}

}  // namespace conveyor
