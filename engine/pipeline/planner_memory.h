#pragma once
// The planner's memory model of a partition, per rank: the state of its units, the activations
// its stages hold at the peaks of its action list, the boundary tensors waiting and its largest
// workspace. The peaks are walked once per schedule in counts (RankPeaks) so that the bytes of
// any unit ranges can be put in: the partition search asks for many. Internal to the planner
// (the search sees it through PartitionMemory); rank_memory (planner.h) is its public face.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/partition.h"
#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/partition_sums.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/schedule.h"

namespace conveyor::planning {

// Where one rank's memory can peak, counted in micro-batches and boundary tensors so that the
// bytes of any partition can be put in. At each point of the rank's list: held[j] = (kept,
// rebuilt, pending, forward), how many micro-batches' bytes of its j-th stage are held there (until
// W, as the planner counts them); transit[j] = (inputs, outputs), how many boundary tensors at that
// stage's input and output wait there to be consumed or sent (the list start counts, with none). A
// point another one holds at least as many of everywhere is left out: with bytes
// >= 0 it never holds more.
struct RankPeaks {
  struct Held {
    int kept = 0, rebuilt = 0, pending = 0, forward = 0;
    bool operator<=(const Held& o) const {
      return kept <= o.kept && rebuilt <= o.rebuilt && pending <= o.pending && forward <= o.forward;
    }
  };
  struct Transit {
    int inputs = 0, outputs = 0;
    bool operator<=(const Transit& o) const { return inputs <= o.inputs && outputs <= o.outputs; }
  };
  std::vector<int> stages;                    // the rank's, ascending
  std::vector<std::vector<Held>> held;        // [point][index in stages]
  std::vector<std::vector<Transit>> transit;  // [point][index in stages]
};

// The rank's peaks over its list: activations with the same additions and releases as
// peak_activation_bytes (held until W), and the boundary tensors each action adds or consumes,
// counted per stage.
RankPeaks rank_peaks(const std::vector<schedule::Action>& list, std::vector<int> stages,
                     int last_stage);

// Per rank memory of a partition: the state of its units, the activations its stages hold at
// the peak (with recomputed units their kept inputs and rebuilds, with a split backward what
// I leaves for W), the boundary tensors waiting, and its largest unit workspace.
struct MemoryModel : PartitionMemory {
  const Sums& sums;
  const std::vector<UnitCost>& units;
  const std::vector<bool>& recomputed;
  const schedule::Schedule& schedule;
  std::vector<double> saved, input, pending;  // per unit
  std::vector<RankPeaks> peaks;               // per rank

  MemoryModel(const Sums& sums, const std::vector<UnitCost>& units,
              const std::vector<bool>& recomputed, const schedule::Schedule& schedule)
      : sums(sums), units(units), recomputed(recomputed), schedule(schedule) {
    for (const auto& u : units)
      saved.push_back(u.activation_bytes), input.push_back(u.input_bytes),
          pending.push_back(u.weight_pending_bytes);
    for (int r = 0; r < schedule.num_ranks(); ++r)
      peaks.push_back(rank_peaks(schedule.ranks[static_cast<size_t>(r)],
                                 schedule.placement.stages_of(r), schedule.num_stages() - 1));
    activation_memo.resize((units.size() + 1) * (units.size() + 1));
    activation_known.assign(activation_memo.size(), false);
  }

  // What a stage of units `range` holds per micro-batch, remembered: the searches ask again
  // for every prefix.
  const StageActivationBytes& activations(const StageRange& range) const {
    const size_t at =
        static_cast<size_t>(range.begin) * (units.size() + 1) + static_cast<size_t>(range.end);
    if (!activation_known[at]) {
      activation_memo[at] = stage_activation_bytes(saved, input, {range}, recomputed, pending)[0];
      activation_known[at] = true;
    }
    return activation_memo[at];
  }
  mutable std::vector<StageActivationBytes> activation_memo;  // [begin * (n + 1) + end]
  mutable std::vector<bool> activation_known;
  mutable std::vector<StageActivationBytes> held_bytes;  // per stage of a rank: scratch
  mutable std::vector<double> in_bytes, out_bytes;       // likewise
  // The boundary tensor entering unit `u` (none past the last unit).
  double boundary(int64_t u) const {
    return u < static_cast<int64_t>(units.size()) ? units[static_cast<size_t>(u)].input_bytes : 0.0;
  }
  // The most rank r's held activations reach, with its j-th stage's bytes `bytes[j]`.
  double held_peak(int r, const std::vector<StageActivationBytes>& bytes) const {
    double peak = 0;
    for (const auto& point : peaks[static_cast<size_t>(r)].held) {
      double total = 0;
      for (size_t j = 0; j < point.size(); ++j)
        total += point[j].kept * bytes[j].kept + point[j].rebuilt * bytes[j].rebuilt +
                 point[j].pending * bytes[j].weight_pending +
                 point[j].forward * bytes[j].forward_extra;
      peak = std::max(peak, total);
    }
    return peak;
  }
  // Rank r's bytes with its stages holding `own[j]`: state, held activations, boundary tensors
  // waiting (plus one more message per stage and direction: the executor takes no more ahead
  // of the list, RankStep::may_receive) and the largest workspace.
  double rank_bytes(int r, const std::vector<StageRange>& own) const {
    const RankPeaks& rank = peaks[static_cast<size_t>(r)];
    const int last = schedule.num_stages() - 1;
    held_bytes.resize(own.size()), in_bytes.resize(own.size()), out_bytes.resize(own.size());
    double state = 0, workspace = 0, early = 0;
    for (size_t j = 0; j < own.size(); ++j) {
      held_bytes[j] = activations(own[j]);
      state += sums.state.over(own[j]);
      workspace = std::max(workspace, sums.workspace_over(own[j].begin, own[j].end));
      in_bytes[j] = boundary(own[j].begin), out_bytes[j] = boundary(own[j].end);
      early +=
          (rank.stages[j] > 0 ? in_bytes[j] : 0.0) + (rank.stages[j] < last ? out_bytes[j] : 0.0);
    }
    double transit = 0;
    for (const auto& point : rank.transit) {
      double total = 0;
      for (size_t j = 0; j < point.size(); ++j)
        total += point[j].inputs * in_bytes[j] + point[j].outputs * out_bytes[j];
      transit = std::max(transit, total);
    }
    return state + held_peak(r, held_bytes) + transit + early + workspace;
  }

  std::vector<double> operator()(const std::vector<StageRange>& ranges) const override {
    std::vector<double> bytes(static_cast<size_t>(schedule.num_ranks()));
    std::vector<StageRange> own;
    for (int r = 0; r < schedule.num_ranks(); ++r) {
      own.clear();
      for (int s : peaks[static_cast<size_t>(r)].stages)
        own.push_back(ranges[static_cast<size_t>(s)]);
      bytes[static_cast<size_t>(r)] = rank_bytes(r, own);
    }
    return bytes;
  }
  // Stage s of units [b, e) on a rank that holds only it (chunks == 1).
  double stage(int s, int64_t b, int64_t e) const override {
    return rank_bytes(schedule.placement.rank_of(s), {{b, e}});
  }
  // Rank r's state, held activations and workspace over its stages among the first `known`
  // of `ranges`, the others taken as empty: each term only grows with a stage's units.
  // (Boundary tensors are left out: a stage's count of them can be negative at a point.)
  double known_stages(int r, const std::vector<StageRange>& ranges, int known) const override {
    const RankPeaks& rank = peaks[static_cast<size_t>(r)];
    held_bytes.assign(rank.stages.size(), {});
    double state = 0, workspace = 0;
    for (size_t j = 0; j < rank.stages.size(); ++j) {
      const int s = rank.stages[j];
      if (s >= known) continue;
      const StageRange& range = ranges[static_cast<size_t>(s)];
      held_bytes[j] = activations(range);
      state += sums.state.over(range);
      workspace = std::max(workspace, sums.workspace_over(range.begin, range.end));
    }
    return state + held_peak(r, held_bytes) + workspace;
  }
};

}  // namespace conveyor::planning
